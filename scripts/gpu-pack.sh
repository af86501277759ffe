#!/usr/bin/env bash
# Builds what `scripts/gpu-check.sh` runs on a GPU machine that has no Rust toolchain, stripped,
# into .gpu/ (ignored by git): bin/muster-agent, bin/nccl_check, bin/muster-lib-tests (the SDK's
# unit tests, NCCL ones included) and site/ (the `muster` Python package, unpacked from its
# abi3 wheel, for PYTHONPATH).
#
# Usage: scripts/gpu-pack.sh [PYTHON] (PYTHON builds the wheel; default: the peers' venv).
set -euo pipefail
cd "$(dirname "$0")/.."
python=${1:-$(scripts/install-peers.sh | tail -1)/bin/python}
rm -rf .gpu
mkdir -p .gpu/bin .gpu/site
cargo build --release -p muster-agent
cargo build --release -p muster --example nccl_check
tests=$(cargo test --release -p muster --lib --no-run --message-format=json \
    | "$python" -c 'import json, sys
for line in sys.stdin:
    m = json.loads(line)
    if m.get("reason") == "compiler-artifact" and m.get("executable") and m["target"]["name"] == "muster":
        print(m["executable"])')
cp target/release/muster-agent target/release/examples/nccl_check .gpu/bin/
cp "$tests" .gpu/bin/muster-lib-tests
strip .gpu/bin/*
wheels=$(mktemp -d)
"$python" -m pip wheel -q --no-deps -w "$wheels" ./worker-sdk/python
"$python" -m zipfile -e "$wheels"/muster-*.whl .gpu/site
rm -rf "$wheels"
strip .gpu/site/muster/*.so
du -sh .gpu/bin/* .gpu/site
