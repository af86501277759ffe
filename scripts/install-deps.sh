#!/usr/bin/env bash
# Installs what muster's build and tests need beyond the Rust toolchain, on Debian. Safe to run
# again: it installs only what is missing: protoc (etcd-client compiles etcd's .proto files
# with it; our own compile with protox), etcd (the etcd store's tests start real servers on
# loopback ports), iproute2 (ip netns, for the multi-host tests), procps (ps/pgrep, used by
# end-to-end tests), systemd (systemd-analyze verify checks the units in deploy/systemd),
# libunwind and liblzma (the agent unwinds its workers' native stacks with py-spy's libunwind
# unwinder, and reads compressed debug sections) and python3-venv (the peers' venv and ruff's).
set -euo pipefail
need=()
command -v ps >/dev/null 2>&1 || need+=(procps)
command -v ip >/dev/null 2>&1 || need+=(iproute2)
command -v protoc >/dev/null 2>&1 || need+=(protobuf-compiler)
command -v etcd >/dev/null 2>&1 || need+=(etcd-server)
command -v systemd-analyze >/dev/null 2>&1 || need+=(systemd)
have_lib() { [ -e "/usr/lib/$(gcc -print-multiarch 2>/dev/null)/$1" ] || [ -e "/usr/lib/$1" ]; }
have_lib libunwind-ptrace.so || need+=(libunwind-dev)
have_lib liblzma.so || need+=(liblzma-dev)
# Virtual environments (the peers' venv, ruff's for scripts/lint-python.sh).
python3 -c 'import ensurepip' >/dev/null 2>&1 || need+=(python3-venv)
if [ ${#need[@]} -gt 0 ]; then
  sudo=""; [ "$(id -u)" -eq 0 ] || sudo="sudo"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq "${need[@]}" >/dev/null
fi
