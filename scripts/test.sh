#!/usr/bin/env bash
# The test command: installs what the tests need, builds every binary and example (the
# end-to-end tests run the built programs), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
# PyTorch and Accelerate for tests/tests/interop.rs (skipped with a reason when it cannot install).
scripts/install-peers.sh >/dev/null
cargo build --workspace --all-targets
cargo test --workspace --all-targets --no-fail-fast "$@"
# The Python SDK, built with pip into the peers' venv, and its pytest suite.
scripts/test-python.sh
