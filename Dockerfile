# Image with both binaries: `ipwarden` (controller, agent, CLI) and `ipwarden-cni` (installed on
# each node by the agent DaemonSet's init container).
#   docker build -t REGISTRY/ipwarden:TAG .
FROM golang:1.26 AS build
WORKDIR /src
COPY go.mod go.sum ./
RUN go mod download
COPY . .
ARG VERSION=dev
RUN CGO_ENABLED=0 go build -trimpath -ldflags "-s -w -X github.com/ipwarden/ipwarden/internal/buildinfo.Version=${VERSION}" \
      -o /out/ipwarden ./cmd/ipwarden && \
    CGO_ENABLED=0 go build -trimpath -ldflags "-s -w" -o /out/ipwarden-cni ./cmd/ipwarden-cni

# busybox provides the /bin/sh the install-cni init container uses.
FROM busybox:1.37-musl
COPY --from=build /out/ipwarden /out/ipwarden-cni /usr/local/bin/
ENTRYPOINT ["/usr/local/bin/ipwarden"]
