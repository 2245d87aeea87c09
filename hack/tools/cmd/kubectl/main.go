// Command kubectl is the upstream kubectl, built from the same pinned Kubernetes release as the
// test API server, so `make demo DEMO_FLAGS=--keep` can be explored without installing one and the
// tests run the real kustomize built into it. Its main is upstream's cmd/kubectl: without
// util.CheckErr, errors would be swallowed and the exit status would be 0.
package main

import (
	"os"

	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	"k8s.io/kubectl/pkg/cmd"
	"k8s.io/kubectl/pkg/cmd/util"
)

func main() {
	logs.GlogSetter(cmd.GetLogVerbosity(os.Args)) // nolint:errcheck
	command := cmd.NewDefaultKubectlCommand()
	if err := cli.RunNoErrOutput(command); err != nil {
		util.CheckErr(err)
	}
}
