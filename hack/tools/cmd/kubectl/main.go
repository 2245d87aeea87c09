// Command kubectl is the upstream kubectl, built from the same pinned Kubernetes release as the
// test API server, so `make demo DEMO_FLAGS=--keep` can be explored without installing one.
package main

import (
	"k8s.io/component-base/cli"
	"k8s.io/kubectl/pkg/cmd"
)

func main() {
	cli.RunNoErrOutput(cmd.NewDefaultKubectlCommand())
}
