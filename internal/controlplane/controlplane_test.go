package controlplane

import (
	"context"
	"os"
	"syscall"
	"testing"
	"time"

	"github.com/ipwarden/ipwarden/internal/localcluster"
	metav1 "k8s.io/apimachinery/pkg/apis/meta/v1"
	"k8s.io/client-go/kubernetes"
)

// TestStartRestartStop starts a real control plane, proves the client works through an API
// server restart and an etcd restart, and that Stop leaves no process and no directory behind.
func TestStartRestartStop(t *testing.T) {
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	cp, err := Start(ctx, Options{Log: testWriter{t}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = cp.Stop() })

	cs, err := kubernetes.NewForConfig(cp.Config)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err != nil {
		t.Fatalf("admin client cannot read the default namespace: %v", err)
	}
	if _, err := os.Stat(cp.Kubeconfig); err != nil {
		t.Fatalf("kubeconfig not written: %v", err)
	}

	if err := cp.StopAPIServer(); err != nil {
		t.Fatal(err)
	}
	if _, err := cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{}); err == nil {
		t.Fatal("API server answered after it was killed")
	}
	if err := cp.RestartAPIServer(ctx); err != nil {
		t.Fatal(err)
	}
	if err := cp.StopEtcd(); err != nil {
		t.Fatal(err)
	}
	if err := cp.RestartEtcd(ctx); err != nil {
		t.Fatal(err)
	}
	// The API server reconnects to etcd on its own; wait for a read with a deadline.
	err = localcluster.WaitFor(ctx, time.Minute, 100*time.Millisecond, func() error {
		_, err := cs.CoreV1().Namespaces().Get(ctx, "default", metav1.GetOptions{})
		return err
	})
	if err != nil {
		t.Fatalf("API server did not recover after etcd restart: %v", err)
	}

	pids := []int{cp.apiserver.Pid(), cp.etcd.Pid()}
	dir := cp.Dir
	if err := cp.Stop(); err != nil {
		t.Fatal(err)
	}
	for _, pid := range pids {
		if err := syscall.Kill(pid, 0); err == nil {
			t.Errorf("process %d still alive after Stop", pid)
		}
	}
	if _, err := os.Stat(dir); !os.IsNotExist(err) {
		t.Errorf("scratch directory %s left behind (stat err %v)", dir, err)
	}
	if err := cp.Stop(); err != nil {
		t.Errorf("second Stop: %v", err)
	}
}

func TestReadCRDs(t *testing.T) {
	root, err := RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	crds, err := ReadCRDs(root + "/config/crd")
	if err != nil {
		t.Fatal(err)
	}
	names := map[string]bool{}
	for _, c := range crds {
		names[c.Name] = true
	}
	for _, want := range []string{"ippools.ipwarden.io", "nodeipallocations.ipwarden.io"} {
		if !names[want] {
			t.Errorf("CRD %s not found in config/crd (have %v)", want, names)
		}
	}
	if _, err := ReadCRDs(t.TempDir()); err == nil {
		t.Error("ReadCRDs of an empty directory: want an error")
	}
}

type testWriter struct{ t *testing.T }

func (w testWriter) Write(p []byte) (int, error) {
	w.t.Log(string(p))
	return len(p), nil
}
