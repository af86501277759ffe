#!/usr/bin/env bash
# Creates (once) the Python virtual environment of muster's peers: PyTorch with gloo, Hugging
# Face Accelerate, safetensors, grpcio with reflection and health checking. The interoperability
# tests (tests/tests/interop.rs) and the peer benchmarks (bench/) use it. About 5 GB and a few
# minutes the first time; later calls return at once (no package is imported to check). The
# project's own copy of ../shared/peers/setup.sh.
#
# Usage: scripts/install-peers.sh [VENV_DIR]
#   VENV_DIR defaults to $MUSTER_PEERS_VENV, else ~/.cache/muster-peers (outside any checkout).
# Prints the venv's path on its last line: venv=$(scripts/install-peers.sh | tail -1)
#
# Never fails a test run: when the venv cannot be made (no venv support in python3, PyPI
# unreachable) it prints a warning on stderr and exits 0; the tests that need it then skip
# with a printed reason.
set -uo pipefail
venv=${1:-${MUSTER_PEERS_VENV:-${HOME:-/tmp}/.cache/muster-peers}}
modules='"torch", "accelerate", "safetensors", "grpc", "grpc_reflection", "grpc_health"'

# Whether every module is installed, without importing any (torch alone takes seconds).
installed() {
  "$venv/bin/python" -c "import importlib.util, sys
sys.exit(any(importlib.util.find_spec(m) is None for m in ($modules)))" 2>/dev/null
}

warn() {
  echo "install-peers.sh: warning: $*; the tests that need PyTorch and Accelerate will be skipped" >&2
}

if ! installed; then
  fresh=0
  [ -e "$venv" ] || fresh=1
  echo "install-peers.sh: installing PyTorch and Accelerate into $venv (about 5 GB, a few minutes)" >&2
  if ! python3 -m venv "$venv" >&2; then
    warn "python3 -m venv $venv failed (on Debian: apt-get install python3-venv)"
  elif ! "$venv/bin/python" -m pip install -q --disable-pip-version-check --retries 2 --timeout 30 \
      torch accelerate safetensors grpcio grpcio-reflection grpcio-health-checking grpcio-tools >&2; then
    warn "pip could not install the peers into $venv (is PyPI reachable?)"
  fi
  if ! installed && [ "$fresh" = 1 ]; then
    # No half-made venv left behind: the next run starts over.
    rm -rf "$venv"
  fi
fi
if installed; then
  "$venv/bin/python" -c 'from importlib.metadata import version
print("torch", version("torch"), "accelerate", version("accelerate"))' >&2
fi
echo "$venv"
