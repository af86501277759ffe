# syntax=docker/dockerfile:1
# muster's container image: muster-coordinator and muster-agent (release builds) on Debian
# slim. Build: docker build -t muster/muster:0.1.0 .
# The Kubernetes manifests in deploy/kubernetes run either binary from this image; for the
# agent, extend it with the training code and its runtime (Python, CUDA libraries), e.g.
#   FROM muster/muster:0.1.0
#   USER root
#   RUN apt-get update && apt-get install -y --no-install-recommends python3 ...
#   USER muster

FROM rust:1.88-bookworm AS build
# etcd-client (the coordinator's etcd store) compiles etcd's .proto files with protoc in its
# build script; muster's own .proto files are compiled in pure Rust (protox).
RUN apt-get update \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends protobuf-compiler \
 && rm -rf /var/lib/apt/lists/*
WORKDIR /src
COPY . .
# Cache the registry and the target directory across builds (BuildKit); the binaries are
# copied out of the cached target directory, which is not part of the image.
RUN --mount=type=cache,target=/usr/local/cargo/registry \
    --mount=type=cache,target=/src/target \
    cargo build --release --locked -p muster-coordinator -p muster-agent --bins \
 && mkdir -p /out \
 && cp target/release/muster-coordinator target/release/muster-agent /out/

FROM debian:bookworm-slim
# No TLS roots or other libraries are needed: the binaries link only glibc (etcd TLS uses the
# CA file the configuration names). tini is not needed either: both binaries handle SIGTERM
# themselves (the manifests run them as the container's command).
RUN groupadd --gid 65532 muster \
 && useradd --uid 65532 --gid 65532 --no-create-home --home-dir /nonexistent \
      --shell /usr/sbin/nologin muster
COPY --from=build /out/muster-coordinator /out/muster-agent /usr/local/bin/
USER 65532:65532
# The coordinator's gRPC port, and the plaintext health port (--health-addr) for probes.
EXPOSE 29470 29473
ENTRYPOINT ["/usr/local/bin/muster-coordinator"]
# Listening on 0.0.0.0 needs TLS and the cluster token (mounted as deploy/kubernetes does), or
# --insecure on a network you trust; the default reads them from a mounted config file.
CMD ["--config", "/etc/muster/coordinator.toml"]
