#!/usr/bin/env bash
# The Python linter for CI: ruff (default rules) over every Python file of the repository (the
# interop and comparison test scripts, the gloo benchmark script). Installs ruff once into its
# own virtual environment ($MUSTER_RUFF_VENV, default ~/.cache/muster-ruff) from PyPI.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${MUSTER_RUFF_VENV:-${HOME:-/tmp}/.cache/muster-ruff}
if [ ! -x "$venv/bin/ruff" ]; then
  python3 -m venv "$venv"
  "$venv/bin/python" -m pip install -q --disable-pip-version-check ruff
fi
"$venv/bin/ruff" check .
