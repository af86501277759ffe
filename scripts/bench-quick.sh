#!/usr/bin/env bash
# The quick benchmark check (run by hand before resolving an issue that touches a hot path; not
# in CI): builds the release binaries it needs, makes sure the peers' venv exists, and runs
# target/release/quick, which prints each headline (launch, barrier, restart, CPU all_reduce)
# with muster's median, the peer's in the same run, the ratio, the goal and PASS/FAIL.
# About 3 minutes on 2 cores once built (the first release build takes longer).
#
# Usage: scripts/bench-quick.sh [quick's flags, e.g. --rounds 5]
# Exits non-zero when a goal is missed (after printing every line).
set -euo pipefail
cd "$(dirname "$0")/.."
cargo build --release -p muster-agent -p muster-coordinator -p muster-bench --bins && cargo build --release -p muster --examples
venv=$(scripts/install-peers.sh | tail -1)
# torchrun makes a log folder per launch and muster's agents make theirs: in a folder of this
# run's own, removed at the end (as scripts/test.sh does for the tests).
run_tmp=$(mktemp -d)
trap 'rm -rf "$run_tmp"' EXIT
TMPDIR="$run_tmp" MUSTER_PEERS_VENV=$venv target/release/quick "$@"
