"""Fixtures of the Python SDK's tests: ``launch`` runs a script under the real
``muster-agent launch`` (the workspace's build, or ``MUSTER_AGENT_BIN``) with this interpreter,
so every test goes through a real agent, its embedded coordinator and real worker processes."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]


def agent_binary() -> Path:
    """The agent to launch with: ``MUSTER_AGENT_BIN``, else the workspace's debug build."""
    given = os.environ.get("MUSTER_AGENT_BIN")
    path = Path(given) if given else REPO / "target" / "debug" / "muster-agent"
    if not path.exists():
        pytest.skip(f"no muster-agent at {path}: run `cargo build -p muster-agent` first")
    return path


@dataclass
class Run:
    """A finished launch: its exit status and each rank's output lines."""

    code: int
    stdout: str
    stderr: str

    def lines(self, rank: int) -> list[str]:
        """The lines rank ``rank`` printed (the agent's ``[rank N] `` prefix removed)."""
        prefix = f"[rank {rank}] "
        return [line[len(prefix) :] for line in self.stdout.splitlines() if line.startswith(prefix)]

    def value(self, rank: int, key: str) -> str:
        """The ``key=value`` that rank ``rank`` printed on a line of its own."""
        for line in self.lines(rank):
            if line.startswith(key + "="):
                return line[len(key) + 1 :]
        raise AssertionError(f"rank {rank} printed no {key}=\n{self.dump()}")

    def dump(self) -> str:
        return f"exit {self.code}\n--- stdout\n{self.stdout}\n--- stderr\n{self.stderr}"


@pytest.fixture
def launch(tmp_path: Path):
    """``launch(nproc, script, *agent_flags, env=None, timeout=60)``: writes ``script`` (dedented)
    to a file and runs it under ``muster-agent launch --nproc-per-node nproc``."""
    agent = agent_binary()

    def run(
        nproc: int,
        script: str,
        *flags: str,
        env: dict[str, str] | None = None,
        timeout: float = 60,
    ) -> Run:
        path = tmp_path / "worker.py"
        path.write_text(textwrap.dedent(script))
        environ = {k: v for k, v in os.environ.items() if not k.startswith(("MUSTER_", "PET_"))}
        environ.update(env or {})
        done = subprocess.run(
            [str(agent), "launch", "--nproc-per-node", str(nproc), *flags, sys.executable, str(path)],
            check=False,
            capture_output=True,
            text=True,
            timeout=timeout,
            env=environ,
            cwd=tmp_path,
        )
        return Run(done.returncode, done.stdout, done.stderr)

    return run
