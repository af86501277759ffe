"""The console entry points ``muster-agent`` and ``muster-coordinator`` that ``pip install``
puts on the venv's PATH: both run the Rust commands linked into ``muster._native``, so a Python
user needs pip and nothing else."""

from __future__ import annotations

import os
import shutil
import sys

from muster import _native


def _guardian_command() -> str | None:
    """The program the agent re-runs as its guardian (``muster-agent __guard PID``): this
    entry point's own script, or the venv's ``muster-agent`` next to the interpreter."""
    for candidate in (sys.argv[0], os.path.join(os.path.dirname(sys.executable), "muster-agent")):
        if os.path.basename(candidate) == "muster-agent":
            found = shutil.which(candidate) or (candidate if os.access(candidate, os.X_OK) else None)
            if found:
                return os.path.abspath(found)
    return shutil.which("muster-agent")


def agent(args: list[str] | None = None) -> None:
    """``muster-agent ARGS``."""
    guardian = _guardian_command()
    if guardian:
        os.environ.setdefault("MUSTER_AGENT_GUARD_EXE", guardian)
    # A script runs under this interpreter (the venv's), as torchrun's run under its own,
    # unless the user named one.
    if "MUSTER_PYTHON" not in os.environ and "PYTHON_EXEC" not in os.environ:
        os.environ["MUSTER_PYTHON"] = sys.executable
    argv = sys.argv[1:] if args is None else args
    sys.stdout.flush()
    sys.exit(_native.agent_main(["muster-agent", *argv]))


def coordinator(args: list[str] | None = None) -> None:
    """``muster-coordinator ARGS``."""
    argv = sys.argv[1:] if args is None else args
    sys.stdout.flush()
    sys.exit(_native.coordinator_main(["muster-coordinator", *argv]))
