#!/usr/bin/env bash
# Installs what muster's build and tests need beyond the Rust toolchain, on Debian. Safe to run
# again: it installs only what is missing. Today that is nothing but iproute2 (ip netns, for
# later multi-host tests) and procps (ps/pgrep, used by end-to-end tests); our own .proto files
# compile with protox, so no protoc is needed.
set -euo pipefail
need=()
command -v ps >/dev/null 2>&1 || need+=(procps)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
