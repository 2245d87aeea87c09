//go:build tools

// Package staticcheck pins staticcheck (honnef.co/go/tools) for `make staticcheck`, in a module of
// its own so the control plane's pins in hack/tools stay untouched.
package staticcheck

import _ "honnef.co/go/tools/cmd/staticcheck"
