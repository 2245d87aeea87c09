# Image with both binaries: `ipwarden` (controller, agent, CLI) and `ipwarden-cni` (installed on
# each node by the agent DaemonSet's init container).
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
# Both binaries carry the version (`ipwarden version`, the plugin's VERSION answer):
#   docker build --build-arg VERSION=v0.1.0 -t REGISTRY/ipwarden:v0.1.0 .
ARG VERSION=dev
RUN LDFLAGS="-s -w -X github.com/ipwarden/ipwarden/internal/buildinfo.Version=${VERSION}" && \
    CGO_ENABLED=0 go build -trimpath -ldflags "$LDFLAGS" -o /out/ipwarden ./cmd/ipwarden && \
    CGO_ENABLED=0 go build -trimpath -ldflags "$LDFLAGS" -o /out/ipwarden-cni ./cmd/ipwarden-cni

# busybox provides the /bin/sh the install-cni init container uses.
FROM busybox:1.37-musl
COPY --from=build /out/ipwarden /out/ipwarden-cni /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/ipwarden"]
