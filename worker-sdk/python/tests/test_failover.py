"""A torch gloo DDP job initialised through ``muster.torch`` goes on through a coordinator
failover: two ``muster-coordinator`` replicas on a real etcd (Debian's ``etcd-server``, on
loopback ports), the leader SIGKILLed while the job trains and uses the store and barriers."""

from __future__ import annotations

import importlib.util
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
from conftest import REPO

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed in this venv"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_for(predicate, what: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def accepts(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
        return True
    except OSError:
        return False


@pytest.fixture
def etcd(tmp_path: Path):
    binary = "/usr/bin/etcd" if os.path.exists("/usr/bin/etcd") else shutil.which("etcd")
    if not binary:
        pytest.skip("no etcd binary (scripts/install-deps.sh installs etcd-server)")
    client, peer = free_port(), free_port()
    proc = subprocess.Popen(
        [
            binary, "--name", "m0", "--data-dir", str(tmp_path / "etcd"),
            "--listen-client-urls", f"http://127.0.0.1:{client}",
            "--advertise-client-urls", f"http://127.0.0.1:{client}",
            "--listen-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-advertise-peer-urls", f"http://127.0.0.1:{peer}",
            "--initial-cluster", f"m0=http://127.0.0.1:{peer}",
            "--log-level", "warn",
        ],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    wait_for(lambda: accepts(client), "etcd")
    yield f"http://127.0.0.1:{client}"
    proc.kill()
    proc.wait()


def start_replica(etcd: str, port: int, log: Path) -> subprocess.Popen:
    binary = REPO / "target" / "debug" / "muster-coordinator"
    if not binary.exists():
        pytest.skip(f"no {binary}: run `cargo build -p muster-coordinator` first")
    addr = f"127.0.0.1:{port}"
    return subprocess.Popen(
        [str(binary), "--store", "etcd", "--etcd-endpoints", etcd, "--lease-ttl-ms", "1000",
         "--listen", addr, "--advertise-addr", addr],
        stdout=subprocess.DEVNULL, stderr=log.open("w"),
    )


def test_a_ddp_job_survives_a_leader_sigkill(launch, etcd, tmp_path: Path) -> None:
    ports = [free_port(), free_port()]
    logs = [tmp_path / "replica0.log", tmp_path / "replica1.log"]
    leader = start_replica(etcd, ports[0], logs[0])
    wait_for(lambda: "election: leading" in logs[0].read_text(), "replica 0 to lead")
    standby = start_replica(etcd, ports[1], logs[1])
    wait_for(lambda: accepts(ports[1]), "replica 1 to listen")
    marker = tmp_path / "training"
    try:
        script = f"""
        import os, time
        for k in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(k, None)
        import torch, torch.distributed as dist
        import muster, muster.torch
        accelerator = muster.torch.init_process_group("gloo")
        store = muster.torch.Store(accelerator, prefix="steps/")
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(40):
            opt.zero_grad()
            model(torch.randn(8, 4)).sum().backward()
            opt.step()
            store.add("count", 1)
            accelerator.wait_for_everyone()
            if step == 5 and accelerator.is_main_process:
                open({str(marker)!r}, "w").close()
            time.sleep(0.1)
        print(f"count={{store.add('count', 0)}}", flush=True)
        dist.destroy_process_group()
        """

        def kill_leader_when_training() -> None:
            wait_for(marker.exists, "the job to train", timeout=120)
            leader.send_signal(signal.SIGKILL)

        import threading

        killer = threading.Thread(target=kill_leader_when_training, daemon=True)
        killer.start()
        run = launch(
            2, script, "--coordinator", f"127.0.0.1:{ports[0]},127.0.0.1:{ports[1]}",
            "--job-id", "py-failover", timeout=240,
        )
        killer.join(5)
        assert leader.poll() is not None, "the leader was never killed\n" + run.dump()
        assert run.code == 0, run.dump() + "\n--- replica 1\n" + logs[1].read_text()
        for rank in range(2):
            assert run.value(rank, "count") == "80", run.dump()
        assert "election: leading" in logs[1].read_text()
    finally:
        for p in (leader, standby):
            if p.poll() is None:
                p.kill()
            p.wait()
