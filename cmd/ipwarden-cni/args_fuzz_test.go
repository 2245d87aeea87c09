package main

import (
	"strings"
	"testing"

	"github.com/ipwarden/ipwarden/internal/cniproto"
)

// FuzzPodFromArgs: CNI_ARGS from the runtime (the environment half of the plugin's input) never
// makes the plugin panic, and a pod's identity written the way runtimes write it reads back
// exactly, whatever other keys surround it.
func FuzzPodFromArgs(f *testing.F) {
	f.Add("IgnoreUnknown=1;K8S_POD_NAMESPACE=ns;K8S_POD_NAME=web-0;K8S_POD_INFRA_CONTAINER_ID=x;K8S_POD_UID=u-1", "ns", "web-0", "u-1")
	f.Add("", "", "", "")
	f.Add(";;;=;==;K8S_POD_NAME", "a", "b", "c")
	f.Add("K8S_POD_UID=a=b", "default", "p", "1234-5678")
	f.Fuzz(func(t *testing.T, raw, ns, name, uid string) {
		_ = podFromArgs(raw) // arbitrary input: must not panic
		for _, s := range []string{ns, name, uid} {
			if strings.ContainsAny(s, ";=") {
				return // not a value a runtime can write into CNI_ARGS
			}
		}
		args := "IgnoreUnknown=1;K8S_POD_NAMESPACE=" + ns + ";K8S_POD_NAME=" + name + ";K8S_POD_UID=" + uid
		if raw != "" && !strings.Contains(raw, "K8S_POD_") {
			args = raw + ";" + args
		}
		got := podFromArgs(args)
		if want := (cniproto.Pod{Namespace: ns, Name: name, UID: uid}); got != want {
			t.Fatalf("podFromArgs(%q) = %+v, want %+v", args, got, want)
		}
	})
}
