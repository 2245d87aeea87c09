//go:build tools

// Package tools pins helm (built from its Go module into _bin by internal/controlplane, like the
// other test tools) in its own module, so its dependencies never touch the main module's or
// hack/tools'.
package tools

import _ "helm.sh/helm/v3/cmd/helm"
