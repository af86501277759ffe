#!/usr/bin/env bash
# The test command. `scripts/test.sh` is the full tier (what CI runs): installs what the tests
# need, builds every binary and example (the end-to-end tests run the built programs), then
# runs every Rust test and the Python SDK's pytest suite.
#
# `scripts/test.sh --fast` is the everyday tier: each crate's unit tests and in-process
# integration tests (a coordinator on a loopback port, the relay, the CPU collectives), without
# the end-to-end crate (`tests/`: real agents, etcd, PyTorch), the benchmarks or Python.
set -euo pipefail
cd "$(dirname "$0")/.."
# Every test, and every agent, worker and peer a test starts, makes its temporary files in a
# folder of this run's own, removed when the run ends: torchrun's log folders, Python's
# multiprocessing folders, the agents' default log folders and the test PKIs would otherwise
# stay in /tmp after every run.
run_tmp=$(mktemp -d)
trap 'rm -rf "$run_tmp"' EXIT
if [[ "${1:-}" == "--fast" ]]; then
    shift
    # protoc, which etcd-client's build needs; it installs only what is missing.
    scripts/install-deps.sh
    TMPDIR="$run_tmp" cargo test --workspace --exclude muster-tests --exclude muster-bench --exclude muster-python \
        --all-targets --no-fail-fast "$@"
    exit 0
fi
scripts/install-deps.sh
# PyTorch and Accelerate for tests/tests/interop.rs (skipped with a reason when it cannot install).
scripts/install-peers.sh >/dev/null
# The muster package into the peers' venv first: the fault suite's `python` workload runs it.
scripts/test-python.sh --install
cargo build --workspace --all-targets
TMPDIR="$run_tmp" cargo test --workspace --all-targets --no-fail-fast "$@"
# The Python SDK, built with pip into the peers' venv, and its pytest suite.
TMPDIR="$run_tmp" MUSTER_PYTHON_INSTALLED=1 scripts/test-python.sh
