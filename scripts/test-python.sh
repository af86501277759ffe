#!/usr/bin/env bash
# The Python SDK's tests: builds the `muster` package (worker-sdk/python, maturin) into the
# peers' venv with pip, exactly as a user installs it, and runs its pytest suite under the
# workspace's `muster-agent` (tests launch real agents and workers). Skips with a printed
# reason when the peers' venv cannot be made (no venv support, PyPI unreachable); a failed
# build or test fails the run.
#
# Usage: scripts/test-python.sh [pytest arguments]
#        scripts/test-python.sh --install   (builds the package into the venv and stops: the
#        full tier does this before the end-to-end tests, whose fault suite runs Python SDK
#        workers, and then runs this script with MUSTER_PYTHON_INSTALLED=1)
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(scripts/install-peers.sh | tail -1)
if [ ! -x "$venv/bin/python" ]; then
  echo "test-python.sh: skipped: no Python venv at $venv (see scripts/install-peers.sh's warning)"
  exit 0
fi
if ! "$venv/bin/python" -c 'import pytest' 2>/dev/null; then
  "$venv/bin/python" -m pip install -q --disable-pip-version-check pytest
fi
if [ "${MUSTER_PYTHON_INSTALLED:-}" != 1 ]; then
  echo "test-python.sh: building the muster package into $venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check --force-reinstall --no-deps ./worker-sdk/python
fi
if [ "${1:-}" = "--install" ]; then
  exit 0
fi
cargo build -p muster-agent
cd worker-sdk/python
"$venv/bin/python" -m pytest -q tests "$@"
