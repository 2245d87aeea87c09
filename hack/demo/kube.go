package main

import (
	"context"
	"fmt"
	"time"

	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/apimachinery/pkg/runtime"
	clientgoscheme "k8s.io/client-go/kubernetes/scheme"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/util/retry"
	"sigs.k8s.io/controller-runtime/pkg/client"

	ipwardenv1 "github.com/ipwarden/ipwarden/api/v1alpha1"
	"github.com/ipwarden/ipwarden/internal/check"
	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/localcluster"
)

// kube is what the demo does through the API server in place of a kubelet and a user.
type kube struct{ c client.Client }

func newKube(cfg *rest.Config) (*kube, error) {
	s := runtime.NewScheme()
	if err := clientgoscheme.AddToScheme(s); err != nil {
		return nil, err
	}
	if err := ipwardenv1.AddToScheme(s); err != nil {
		return nil, err
	}
	c, err := client.New(cfg, client.Options{Scheme: s})
	return &kube{c: c}, err
}

func (k *kube) createPool(ctx context.Context) error {
	return k.c.Create(ctx, &ipwardenv1.IPPool{ObjectMeta: metav1.ObjectMeta{Name: "demo-v4"}, Spec: ipwardenv1.IPPoolSpec{
		CIDRs:         []ipwardenv1.CIDR{"10.244.0.0/24"},
		Gateway:       "10.244.0.1",
		Scaling:       ipwardenv1.Scaling{BatchSize: 16, BufferPercent: 50, MaxPerNode: 250},
		ReuseCooldown: metav1.Duration{Duration: 3 * time.Second},
	}})
}

func (k *kube) pool(ctx context.Context) (ipwardenv1.IPPoolStatus, error) {
	p := &ipwardenv1.IPPool{}
	err := k.c.Get(ctx, client.ObjectKey{Name: "demo-v4"}, p)
	return p.Status, err
}

func (k *kube) createNode(ctx context.Context, name string) error {
	return k.c.Create(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name, Labels: map[string]string{"kubernetes.io/hostname": name}}})
}

func (k *kube) deleteNode(ctx context.Context, name string) error {
	return k.c.Delete(ctx, &corev1.Node{ObjectMeta: metav1.ObjectMeta{Name: name}})
}

func (k *kube) allocationGone(ctx context.Context, name string) (bool, error) {
	err := k.c.Get(ctx, client.ObjectKey{Name: name}, &ipwardenv1.NodeIPAllocation{})
	if apierrors.IsNotFound(err) {
		return true, nil
	}
	return false, err
}

// createPod creates a pod bound to a node, as the scheduler leaves it before the kubelet runs it.
func (k *kube) createPod(ctx context.Context, name, node string) (string, error) {
	p := &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name},
		Spec: corev1.PodSpec{NodeName: node, Containers: []corev1.Container{{Name: "app", Image: "demo"}}}}
	if err := k.c.Create(ctx, p); err != nil {
		return "", fmt.Errorf("create pod %s: %w", name, err)
	}
	return string(p.UID), nil
}

// setPodRunning records the pod's addresses, as the kubelet does after CNI ADD.
func (k *kube) setPodRunning(ctx context.Context, name string, ips []string) error {
	return retry.RetryOnConflict(retry.DefaultRetry, func() error {
		p := &corev1.Pod{}
		if err := k.c.Get(ctx, client.ObjectKey{Namespace: "default", Name: name}, p); err != nil {
			return err
		}
		p.Status.Phase = corev1.PodRunning
		p.Status.PodIP = ips[0]
		p.Status.PodIPs = nil
		for _, ip := range ips {
			p.Status.PodIPs = append(p.Status.PodIPs, corev1.PodIP{IP: ip})
		}
		return k.c.Status().Update(ctx, p)
	})
}

func (k *kube) deletePod(ctx context.Context, name string) error {
	err := k.c.Delete(ctx, &corev1.Pod{ObjectMeta: metav1.ObjectMeta{Namespace: "default", Name: name}}, client.GracePeriodSeconds(0))
	if apierrors.IsNotFound(err) {
		return nil
	}
	return err
}

type attachment struct{ podName string }

func listAttachments(socket string) ([]attachment, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cniproto.Call(ctx, socket, cniproto.Request{Version: cniproto.Version, Op: cniproto.OpList})
	if err != nil {
		return nil, err
	}
	if err := resp.AsError(); err != nil {
		return nil, err
	}
	out := make([]attachment, 0, len(resp.Attachments))
	for _, a := range resp.Attachments {
		out = append(out, attachment{podName: a.Pod.Name})
	}
	return out, nil
}

func poolStatus(socket string) (cniproto.PoolStatus, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := cniproto.Call(ctx, socket, cniproto.Request{Version: cniproto.Version, Op: cniproto.OpList})
	if err != nil {
		return cniproto.PoolStatus{}, err
	}
	for _, p := range resp.Pools {
		if p.Pool == "demo-v4" {
			return p, nil
		}
	}
	return cniproto.PoolStatus{}, fmt.Errorf("the agent does not serve pool demo-v4")
}

// check runs ipwarden's invariant checker over the API objects and every agent's attachments.
func (d *demo) check(ctx context.Context) (check.Report, error) {
	in, err := check.Collect(ctx, d.kube.c)
	if err != nil {
		return check.Report{}, err
	}
	in.Attachments = map[string][]check.Attachment{}
	in.Grace = 2 * time.Second
	for _, n := range d.nodes {
		atts, err := check.AskAgent(ctx, n.name, n.socket)
		if err != nil {
			return check.Report{}, err
		}
		in.Attachments[n.name] = atts
	}
	return check.Check(in), nil
}

// freeAddr is a free loopback host:port (localcluster.FreeAddr), or port 0 if none is found.
func freeAddr() string {
	a, err := localcluster.FreeAddr()
	if err != nil {
		return "127.0.0.1:0"
	}
	return a
}
