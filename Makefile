# ipwarden — build, generate, test.
#
#   make test      everything CI runs: generated files up to date, vet, unit + fuzz seeds +
#                  integration tests against a real kube-apiserver and etcd
#   make tools     build the pinned test control plane, kubectl, the real-node suite's kubelet,
#                  kube-controller-manager and kube-scheduler, and controller-gen into _bin/ (once)
#   make generate  regenerate deepcopy code and CRD YAML from api/v1alpha1
#   make fuzz      run each fuzz target for FUZZTIME (default 30s)

SHELL      := /bin/bash
BIN        := $(CURDIR)/_bin
TOOLS_DIR  := hack/tools
GO         ?= go
FUZZTIME   ?= 30s
CONTROLLER_GEN := $(BIN)/controller-gen

export IPWARDEN_BIN_DIR := $(BIN)

.PHONY: all build test unit integration vet verify-generated generate tools fuzz clean

all: build

build:
	$(GO) build -o $(BIN)/ ./cmd/ipwarden ./cmd/ipwarden-cni

# Tools come from hack/tools/go.mod (kube-apiserver and etcd built from the Kubernetes and etcd
# Go modules, controller-gen from controller-tools), so their versions are pinned there. The test
# harness (internal/controlplane) rebuilds kube-apiserver and etcd when hack/tools changes.
tools: $(CONTROLLER_GEN)
	$(GO) run ./hack/controlplane ensure all >/dev/null

$(CONTROLLER_GEN): $(TOOLS_DIR)/go.mod $(TOOLS_DIR)/go.sum
	@mkdir -p $(BIN)
	cd $(TOOLS_DIR) && $(GO) build -o $(BIN)/ sigs.k8s.io/controller-tools/cmd/controller-gen

generate: $(CONTROLLER_GEN)
	$(CONTROLLER_GEN) object paths=./api/...
	$(CONTROLLER_GEN) crd paths=./api/... output:crd:artifacts:config=config/crd

# Regenerates in place and fails if that changed anything (CI: the committed files were stale).
verify-generated: $(CONTROLLER_GEN)
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	  cp -r api config $$tmp/ && \
	  $(CONTROLLER_GEN) object paths=./api/... && \
	  $(CONTROLLER_GEN) crd paths=./api/... output:crd:artifacts:config=config/crd && \
	  if ! diff -ru $$tmp/api api >/dev/null || ! diff -ru $$tmp/config config >/dev/null; then \
	    diff -ru $$tmp/api api; diff -ru $$tmp/config config; \
	    echo "generated files were stale: they are regenerated now; review and commit them" >&2; exit 1; \
	  fi
	@echo ">> generated files are up to date"

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './_bin/*')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted" >&2; exit 1; fi
	$(GO) vet ./...

unit:
	$(GO) test -count=1 $$($(GO) list ./... | grep -v /test/)

integration: tools
	$(GO) test -count=1 ./test/...

test: verify-generated vet tools
	$(GO) test -count=1 -timeout 30m ./...

fuzz:
	@for pkg in $$($(GO) list ./...); do \
	  for f in $$($(GO) test -list '^Fuzz' $$pkg 2>/dev/null | grep '^Fuzz'); do \
	    echo ">> $$pkg $$f"; $(GO) test -run '^$$' -fuzz "^$$f$$" -fuzztime $(FUZZTIME) $$pkg || exit 1; \
	  done; \
	done

clean:
	rm -rf $(BIN)

# The benchmarks of DESIGN.md's targets, each against its reference in the same run (BENCHMARKS.md).
bench: tools
	$(GO) run ./hack/bench all $(BENCH_FLAGS)
.PHONY: bench

# Pod startup on the real-node suite's kubelet and containerd, ipwarden vs host-local (root).
bench-node: tools
	IPWARDEN_NODE_BENCH=1 $(GO) test -count=1 -v -run TestPodStartupBench -timeout 50m ./test/node
.PHONY: bench-node

# kubectl from the same pinned Kubernetes release, to explore the demo (--keep).
$(BIN)/kubectl: $(TOOLS_DIR)/go.mod $(TOOLS_DIR)/go.sum
	$(GO) run ./hack/controlplane ensure kubectl >/dev/null

# The local demonstration: a real control plane, controller and agents; pods through the real
# CNI plugin (in network namespaces on a bridge when run as root).
demo: tools $(BIN)/kubectl
	$(GO) run ./hack/demo $(DEMO_FLAGS)
.PHONY: demo
