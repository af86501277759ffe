#!/usr/bin/env bash
# The test command: installs what the tests need, builds every binary and example (the
# end-to-end tests run the built programs), then runs the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/install-deps.sh
cargo build --workspace --all-targets
cargo test --workspace --all-targets "$@"
