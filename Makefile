# ipwarden — build, generate, test.
#
#   make test      everything CI runs: generated files up to date, gofmt, go vet, staticcheck,
#                  unit + fuzz seeds + integration tests against a real kube-apiserver and etcd,
#                  with -race where a package can take it
#   make tools     build the pinned test control plane, kubectl, the real-node suite's kubelet,
#                  kube-controller-manager and kube-scheduler, and controller-gen into _bin/ (once)
#   make generate  regenerate deepcopy code and CRD YAML from api/v1alpha1 (and the Helm chart's copy)
#   make fuzz      run each fuzz target for FUZZTIME (default 30s)

SHELL      := /bin/bash
BIN        := $(CURDIR)/_bin
TOOLS_DIR  := hack/tools
GO         ?= go
FUZZTIME   ?= 30s
CONTROLLER_GEN := $(BIN)/controller-gen
STATICCHECK    := $(BIN)/staticcheck
# The version both binaries report (ipwarden version, the plugin's VERSION answer).
VERSION    ?= $(shell git describe --tags --always --dirty 2>/dev/null || echo dev)
LDFLAGS    := -X github.com/ipwarden/ipwarden/internal/buildinfo.Version=$(VERSION)

export IPWARDEN_BIN_DIR := $(BIN)

.PHONY: all build test unit integration vet vet-hack staticcheck verify-generated generate tools fuzz clean

all: build

build:
	$(GO) build -ldflags "$(LDFLAGS)" -o $(BIN)/ ./cmd/ipwarden ./cmd/ipwarden-cni

# Tools come from hack/tools/go.mod (kube-apiserver and etcd built from the Kubernetes and etcd
# Go modules, controller-gen from controller-tools), so their versions are pinned there. The test
# harness (internal/controlplane) rebuilds kube-apiserver and etcd when hack/tools changes.
tools: $(CONTROLLER_GEN)
	$(GO) run ./hack/controlplane ensure all >/dev/null

$(CONTROLLER_GEN): $(TOOLS_DIR)/go.mod $(TOOLS_DIR)/go.sum
	@mkdir -p $(BIN)
	cd $(TOOLS_DIR) && $(GO) build -o $(BIN)/ sigs.k8s.io/controller-tools/cmd/controller-gen

# staticcheck comes from its own module (hack/staticcheck/go.mod), so its pin does not touch the
# control plane's in hack/tools.
$(STATICCHECK): hack/staticcheck/go.mod hack/staticcheck/go.sum
	@mkdir -p $(BIN)
	cd hack/staticcheck && $(GO) build -o $(BIN)/ honnef.co/go/tools/cmd/staticcheck

generate: $(CONTROLLER_GEN)
	$(CONTROLLER_GEN) object paths=./api/...
	$(CONTROLLER_GEN) crd paths=./api/... output:crd:artifacts:config=config/crd
	cp config/crd/ipwarden.io_*.yaml deploy/helm/ipwarden/crds/

# Regenerates in place and fails if that changed anything (CI: the committed files were stale).
verify-generated: $(CONTROLLER_GEN)
	@tmp=$$(mktemp -d) && trap 'rm -rf $$tmp' EXIT && \
	  cp -r api config $$tmp/ && \
	  $(CONTROLLER_GEN) object paths=./api/... && \
	  $(CONTROLLER_GEN) crd paths=./api/... output:crd:artifacts:config=config/crd && \
	  cp -r deploy/helm/ipwarden/crds $$tmp/helm-crds && cp config/crd/ipwarden.io_*.yaml deploy/helm/ipwarden/crds/ && \
	  if ! diff -ru $$tmp/api api >/dev/null || ! diff -ru $$tmp/config config >/dev/null || ! diff -ru $$tmp/helm-crds deploy/helm/ipwarden/crds >/dev/null; then \
	    diff -ru $$tmp/api api; diff -ru $$tmp/config config; diff -ru $$tmp/helm-crds deploy/helm/ipwarden/crds; \
	    echo "generated files were stale: they are regenerated now; review and commit them" >&2; exit 1; \
	  fi
	@echo ">> generated files are up to date"

vet:
	@unformatted=$$(gofmt -l $$(git ls-files '*.go' 2>/dev/null || find . -name '*.go' -not -path './_bin/*')); \
	  if [ -n "$$unformatted" ]; then echo "gofmt needed: $$unformatted" >&2; exit 1; fi
	$(GO) vet ./...

staticcheck: $(STATICCHECK)
	$(STATICCHECK) ./...

# The modules under hack/ with Go code of their own: vetted, tested (none has tests yet) and, for
# the small promcheck, staticchecked. hack/bench, hack/demo and hack/controlplane are packages of
# the main module (vet, staticcheck and the tests above cover them); hack/helm and
# hack/staticcheck hold only a build-tagged pin. It runs after `tools` in make test: their
# dependencies (Kubernetes, etcd, Prometheus) are then compiled already and come from the cache.
HACK_MODULES := hack/promcheck hack/tools
vet-hack: $(STATICCHECK)
	@for m in $(HACK_MODULES); do \
	  echo ">> go vet, go test $$m"; \
	  (cd $$m && $(GO) vet ./... && $(GO) test -count=1 ./...) || exit 1; \
	done
	cd hack/promcheck && $(STATICCHECK) ./...

# -race on every package that can take it; a race-built test builds the controller and agent it
# runs with -race too, and a race they report fails the test (internal/localcluster). These run
# without: the chaos suite's faults are timed against a 2 s lease and a 3 s claim settle, and the
# real-node suite runs ipwarden from static container images (no race runtime); the CNI tripwire
# (test/cnitripwire) measures the ADD path against host-local, which a race-built agent would skew.
# (`make test NORACE_PKGS="./test/chaos ./test/node ./test/cnitripwire ./test/integration"` leaves more out.)
NORACE_PKGS ?= ./test/chaos ./test/node ./test/cnitripwire
RACE_PKGS    = $$($(GO) list ./... | grep -vxF -f <($(GO) list $(NORACE_PKGS)))

unit:
	$(GO) test -race -count=1 $$($(GO) list ./... | grep -v /test/)

integration: tools
	$(GO) test -race -count=1 ./test/integration ./test/e2e
	$(GO) test -count=1 $(NORACE_PKGS)

# The raced packages and the two others run side by side, one package of each at a time (two
# at once, as the machine's two cores ran them before).
test: verify-generated vet staticcheck tools vet-hack
	@$(GO) test -p 1 -count=1 -timeout 30m $(NORACE_PKGS) & plain=$$!; \
	  $(GO) test -p 1 -race -count=1 -timeout 30m $(RACE_PKGS); rc=$$?; \
	  wait $$plain || rc=1; exit $$rc

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

# Many nodes on one API server: N nodes served by the real agent code in one process, the real
# controller leader-elected and fenced (BENCHMARKS.md, "Thousands of nodes"). SCALE_NODES=1000.
SCALE_NODES ?= 1000
bench-scale:
	$(GO) run ./hack/controlplane ensure >/dev/null
	$(GO) run ./hack/bench scale -scale-nodes $(SCALE_NODES) $(BENCH_FLAGS)
.PHONY: bench-scale

# Pod startup on the real-node suite's kubelet and containerd, ipwarden vs host-local (root).
bench-node: tools
	IPWARDEN_NODE_BENCH=1 $(GO) test -count=1 -v -run TestPodStartupBench -timeout 50m ./test/node
.PHONY: bench-node

# kubectl from the same pinned Kubernetes release, to explore the demo (--keep).
$(BIN)/kubectl: $(TOOLS_DIR)/go.mod $(TOOLS_DIR)/go.sum
	$(GO) run ./hack/controlplane ensure kubectl >/dev/null

# The local demonstration: a real control plane, controller and agents; pods through the real
# CNI plugin (in network namespaces on a bridge when run as root).
# It builds only what it runs: etcd and kube-apiserver, and kubectl (not the real-node suite's
# kubelet, kube-controller-manager and kube-scheduler, nor controller-gen, which `make tools` adds).
demo: $(BIN)/kubectl
	$(GO) run ./hack/controlplane ensure >/dev/null
	$(GO) run ./hack/demo $(DEMO_FLAGS)
.PHONY: demo
