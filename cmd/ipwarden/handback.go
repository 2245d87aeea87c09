package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"net/netip"
	"os"
	"strings"
	"time"

	"github.com/spf13/cobra"

	"github.com/ipwarden/ipwarden/internal/cniproto"
	"github.com/ipwarden/ipwarden/internal/handback"
)

func newAgentHandbackCommand() *cobra.Command {
	var socket, to, network string
	var undo, dryRun bool
	cmd := &cobra.Command{
		Use:   "handback --to '<host-local ipam JSON>' --network <name>",
		Short: "Hand this node back to host-local: write its reservations for ipwarden's pods, then refuse every ADD",
		Long: `Run on the node (as root: it talks to the agent's socket and writes host-local's files). It
hands the node back to host-local, the IPAM of the CNI configuration ipwarden took it over from,
without draining it:

  1. It asks the node's agent for its attachments on --network and refuses, writing nothing, if
     any address lies outside the ranges of the host-local ipam object --to (its "ranges" and
     the older top-level "subnet"/"rangeStart"/"rangeEnd"), is a range's gateway, if an address
     is already reserved in host-local's files for another container, if a pod's address was
     adopted from its status (sandbox unknown) and host-local holds no reservation for it, if
     the node has attachments on other networks, or if --to is not host-local (Whereabouts keeps
     its reservations in the cluster's IPPool objects, which ipwarden does not write: drain the
     node instead).
  2. The agent journals the handback mark: from then on it refuses every ADD (CNI error 100)
     until "ipwarden agent handback --undo". DEL, CHECK and GC keep working.
  3. It writes <dataDir>/<network>/<address> = "<container ID>\r\n<ifname>" for every address,
     as host-local does (dataDir from --to, default /var/lib/cni/networks), under host-local's
     lock, each file synced and created without overwriting any; last_reserved_ip is left
     alone. A file identical to the one it would write is kept.

Then switch the node's CNI configuration to bridge + host-local. Host-local never hands out an
address in those files, and frees each at its pod's DEL. ipwarden's own attachments of those
pods are freed by the agent's leak collector once the pods are gone.

--undo clears the mark (ADD served again). It leaves the files: they name pods that still run,
and host-local may own some of them by now.`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
			defer cancel()
			out := cmd.OutOrStdout()
			if undo {
				return runHandbackUndo(ctx, out, socket)
			}
			return runHandback(ctx, out, socket, to, network, dryRun)
		},
	}
	fs := cmd.Flags()
	fs.StringVar(&socket, "socket", cniproto.DefaultSocket, "the agent's unix socket")
	fs.StringVar(&to, "to", "", `the ipam object of the CNI configuration the node goes back to, e.g. '{"type": "host-local", "ranges": [[{"subnet": "10.244.1.0/24"}]]}', or @file`)
	fs.StringVar(&network, "network", "", `the CNI network name (the conflist's "name"; host-local keeps its files in <dataDir>/<name>)`)
	fs.BoolVar(&undo, "undo", false, "clear the handback mark: the agent serves ADD again (the reservation files stay)")
	fs.BoolVar(&dryRun, "dry-run", false, "only say what the handback would write or why it is refused; change nothing")
	return cmd
}

// readTo reads --to: the JSON itself, or @file.
func readTo(to string) ([]byte, error) {
	if to == "" {
		return nil, errors.New(`--to is required: the ipam object of the CNI configuration the node goes back to, e.g. '{"type": "host-local", "ranges": [[{"subnet": "10.244.1.0/24"}]]}'`)
	}
	path, isFile := strings.CutPrefix(to, "@")
	if !isFile {
		return []byte(to), nil
	}
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("--to: %w", err)
	}
	defer f.Close()
	b, err := io.ReadAll(io.LimitReader(f, handback.MaxConfig+1))
	if err != nil {
		return nil, fmt.Errorf("--to: %w", err)
	}
	return b, nil
}

func callHandback(ctx context.Context, socket string, req cniproto.HandbackRequest) (*cniproto.HandbackStatus, error) {
	resp, err := cniproto.Call(ctx, socket, cniproto.Request{Op: cniproto.OpHandback, Handback: &req})
	if err != nil {
		return nil, err
	}
	if err := resp.AsError(); err != nil {
		return nil, err
	}
	if resp.Handback == nil {
		return nil, errors.New("the agent's answer has no handback status (is it older than this ipwarden?)")
	}
	return resp.Handback, nil
}

// attachmentsOf converts the agent's answer for handback.Plan.
func attachmentsOf(st *cniproto.HandbackStatus) ([]handback.Attachment, error) {
	var out []handback.Attachment
	for _, a := range st.Attachments {
		ha := handback.Attachment{ContainerID: a.ContainerID, IfName: a.IfName, Rebuilt: a.Rebuilt}
		if a.Pod.Name != "" {
			ha.Pod = a.Pod.Namespace + "/" + a.Pod.Name
		}
		for _, s := range a.Addresses {
			ip, err := netip.ParseAddr(s)
			if err != nil {
				return nil, fmt.Errorf("the agent answered address %q: %w", s, err)
			}
			ha.Addresses = append(ha.Addresses, ip)
		}
		out = append(out, ha)
	}
	return out, nil
}

func runHandback(ctx context.Context, out io.Writer, socket, to, network string, dryRun bool) error {
	raw, err := readTo(to)
	if err != nil {
		return err
	}
	target, err := handback.ParseTarget(raw)
	if err != nil {
		return fmt.Errorf("--to: %w", err)
	}
	if network == "" || strings.ContainsAny(network, "/\x00") || network == "." || network == ".." {
		return fmt.Errorf("--network %q: give the CNI network name of the node's configuration (the conflist's \"name\")", network)
	}
	dir := target.Dir(network)
	req := cniproto.HandbackRequest{To: string(raw), Network: network, Dir: dir}

	// 1. The plan, from the agent's attachments and host-local's files as they are: a refusal
	// changes nothing.
	st, err := callHandback(ctx, socket, req)
	if err != nil {
		return err
	}
	atts, err := attachmentsOf(st)
	if err != nil {
		return err
	}
	existing, err := handback.ReadExisting(dir)
	if err != nil {
		return fmt.Errorf("read host-local's reservations: %w", err)
	}
	files, err := handback.Plan(atts, target, existing)
	if err != nil {
		return err
	}
	if dryRun {
		fmt.Fprintf(out, "dry run: the handback would write %d reservation files in %s (%d attachments on network %s)\n", len(files), dir, len(atts), network)
		for _, f := range files {
			fmt.Fprintf(out, "  %s  container %s %s  pod %s\n", f.Addr, f.ContainerID, f.IfName, orDash(f.Pod))
		}
		return nil
	}

	// 2. The mark: the agent refuses ADD from now on and answers the attachments as they are.
	req.Mark = true
	st, err = callHandback(ctx, socket, req)
	if err != nil {
		return err
	}
	// 3. The files, planned again under host-local's lock from what is there now.
	written, err := writeHandback(st, target, dir)
	if err != nil {
		if _, uerr := callHandback(ctx, socket, cniproto.HandbackRequest{Undo: true}); uerr != nil {
			return fmt.Errorf("%w; and the handback mark could not be cleared (%v): run ipwarden agent handback --undo", err, uerr)
		}
		return fmt.Errorf("%w (the handback mark was cleared: ipwarden serves ADD on this node again)", err)
	}
	for _, f := range written {
		fmt.Fprintf(out, "wrote %s/%s  container %s %s  pod %s\n", dir, f.Addr, f.ContainerID, f.IfName, orDash(f.Pod))
	}
	// A pod deleted between the agent's answer and the write had its DEL freed by the agent
	// before its file existed: remove the files of attachments gone since.
	req.Mark = false
	if now, err := callHandback(ctx, socket, req); err != nil {
		fmt.Fprintf(out, "warning: cannot re-read the agent's attachments (%v): a file written for a pod deleted meanwhile would stay\n", err)
	} else if removed, err := releaseGone(st, now, dir); err != nil {
		fmt.Fprintf(out, "warning: cannot remove the files of pods deleted meanwhile: %v\n", err)
	} else {
		for _, ip := range removed {
			fmt.Fprintf(out, "removed %s/%s again: its pod was deleted meanwhile\n", dir, ip)
		}
	}
	fmt.Fprintf(out, "node handed back to %s at %s: %d attachments on network %s, %d reservation files written in %s (others were there already).\n"+
		"The ipwarden agent refuses every ADD on this node from now on (undo: ipwarden agent handback --undo).\n"+
		"Next: make the node's CNI configuration use host-local with these ranges again (for network %s), then delete the ipwarden-cni conflist.\n",
		st.To, st.At.UTC().Format(time.RFC3339), len(st.Attachments), network, len(written), dir, network)
	return nil
}

// writeHandback plans the files from the agent's answer and host-local's files, under
// host-local's lock, and writes them.
func writeHandback(st *cniproto.HandbackStatus, target handback.Target, dir string) ([]handback.File, error) {
	atts, err := attachmentsOf(st)
	if err != nil {
		return nil, err
	}
	unlock, err := handback.Lock(dir)
	if err != nil {
		return nil, err
	}
	defer unlock()
	existing, err := handback.ReadExisting(dir)
	if err != nil {
		return nil, fmt.Errorf("read host-local's reservations: %w", err)
	}
	files, err := handback.Plan(atts, target, existing)
	if err != nil {
		return nil, err
	}
	if _, err := handback.Write(dir, files); err != nil {
		return nil, fmt.Errorf("write host-local's reservations (none of this run's files were left): %w", err)
	}
	return files, nil
}

// releaseGone removes host-local's files naming attachments of before that now lacks.
func releaseGone(before, now *cniproto.HandbackStatus, dir string) ([]netip.Addr, error) {
	still := map[cniproto.AttachmentID]bool{}
	for _, a := range now.Attachments {
		still[cniproto.AttachmentID{ContainerID: a.ContainerID, IfName: a.IfName}] = true
	}
	gone := &cniproto.HandbackStatus{}
	for _, a := range before.Attachments {
		if !still[cniproto.AttachmentID{ContainerID: a.ContainerID, IfName: a.IfName}] {
			gone.Attachments = append(gone.Attachments, a)
		}
	}
	atts, err := attachmentsOf(gone)
	if err != nil || len(atts) == 0 {
		return nil, err
	}
	return handback.Release(dir, atts)
}

func runHandbackUndo(ctx context.Context, out io.Writer, socket string) error {
	was, err := callHandback(ctx, socket, cniproto.HandbackRequest{Undo: true})
	if err != nil {
		return err
	}
	if was.To == "" {
		fmt.Fprintln(out, "the node is not handed back: nothing to undo")
		return nil
	}
	fmt.Fprintf(out, "handback to %s (since %s) undone: the ipwarden agent serves ADD on this node again.\n"+
		"The reservation files in %s stay: they name pods that still run, and host-local frees each at its pod's DEL.\n",
		was.To, was.At.UTC().Format(time.RFC3339), orDash(was.Dir))
	return nil
}
