"""The launcher that comes with ``pip install``: the venv's ``muster-agent`` and
``muster-coordinator`` entry points and ``python -m muster.launch`` run the Rust commands
linked into the package, with the venv's interpreter for scripts and a working guardian."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

BIN = Path(sys.executable).parent


def entry(name: str) -> str:
    path = BIN / name
    if not path.exists():
        pytest.skip(f"{path} is not installed (pip install ./worker-sdk/python)")
    return str(path)


def clean_env() -> dict:
    return {k: v for k, v in os.environ.items() if not k.startswith(("MUSTER_", "PET_", "PYTHON_EXEC"))}


def test_the_entry_point_launches_a_script_with_the_venvs_python(tmp_path: Path) -> None:
    script = tmp_path / "job.py"
    script.write_text("import sys, muster\na = muster.Accelerator()\na.wait_for_everyone()\nprint('exe=' + sys.executable)\n")
    # PATH without the venv: the script must still run under the venv's interpreter.
    env = clean_env() | {"PATH": "/usr/bin:/bin"}
    done = subprocess.run(
        [entry("muster-agent"), "launch", "--nproc-per-node", "2", str(script)],
        check=False, capture_output=True, text=True, env=env, timeout=120, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.count(f"exe={sys.executable}") == 2, done.stdout


def test_python_dash_m_muster_launch(tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "muster.launch", "--nproc-per-node", "2", "--", "/bin/echo", "hello"],
        check=False, capture_output=True, text=True, env=clean_env(), timeout=60, cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.count("hello") == 2


def test_the_coordinator_entry_point_serves_and_refuses_bad_flags() -> None:
    bad = subprocess.run([entry("muster-coordinator"), "--bogus"], check=False, capture_output=True, text=True, timeout=30)
    assert bad.returncode != 0 and "--bogus" in bad.stderr
    version = subprocess.run([entry("muster-coordinator"), "--version"], check=False, capture_output=True, text=True, timeout=30)
    assert version.returncode == 0 and version.stdout.startswith("muster-coordinator ")


def test_the_guardian_stops_the_workers_of_a_killed_agent(tmp_path: Path) -> None:
    # The agent re-runs its own entry point as the guardian; SIGKILL the agent and the
    # workers must go too.
    pidfile = tmp_path / "pids"
    script = tmp_path / "sleeper.py"
    script.write_text(f"import os, time\nopen({str(pidfile)!r}, 'a').write(f'{{os.getpid()}}\\n')\ntime.sleep(60)\n")
    agent = subprocess.Popen(
        [entry("muster-agent"), "launch", "--nproc-per-node", "2", str(script)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=clean_env(), cwd=tmp_path,
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and (not pidfile.exists() or len(pidfile.read_text().split()) < 2):
        time.sleep(0.05)
    workers = [int(p) for p in pidfile.read_text().split()]
    assert len(workers) == 2
    agent.send_signal(signal.SIGKILL)
    agent.wait(10)
    deadline = time.monotonic() + 10
    alive = workers
    while alive and time.monotonic() < deadline:
        alive = [p for p in workers if Path(f"/proc/{p}").exists() and "Z" not in Path(f"/proc/{p}/stat").read_text().split(")")[1][:3]]
        time.sleep(0.05)
    assert not alive, f"workers {alive} outlived the SIGKILLed agent"
