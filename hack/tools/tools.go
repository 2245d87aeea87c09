//go:build tools

// Package tools pins the versions of build-time tools.
package tools

import _ "sigs.k8s.io/controller-tools/cmd/controller-gen"
