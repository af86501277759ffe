"""``muster.Communicator`` under the real ``muster-agent launch``: every collective on numpy
arrays, CPU torch tensors and plain buffers, in place, and a dead peer named by every rank."""

from __future__ import annotations

import importlib.util

import pytest

needs_numpy = pytest.mark.skipif(importlib.util.find_spec("numpy") is None, reason="numpy is not installed")
needs_torch = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed")


@needs_numpy
def test_collectives_on_numpy_arrays(launch) -> None:
    run = launch(
        3,
        """
        import numpy as np, muster
        comm = muster.Communicator()
        r, w = comm.rank, comm.world_size
        a = np.full(1000, r + 1, dtype=np.float32)
        before = a.ctypes.data
        comm.all_reduce(a)
        print(f"sum={a[0]},{a[-1]},{a.ctypes.data == before}", flush=True)
        m = np.array([r, -r], dtype=np.int64)
        comm.all_reduce(m, "max")
        print(f"max={m.tolist()}", flush=True)
        b = np.arange(5, dtype=np.float64) * (r + 10)
        comm.broadcast(b, root=2)
        print(f"bcast={b.tolist()}", flush=True)
        out = np.zeros(2 * w, dtype=np.int32)
        comm.all_gather(out, np.array([r, r * 10], dtype=np.int32))
        print(f"gather={out.tolist()}", flush=True)
        mine = np.zeros(2, dtype=np.float32)
        comm.reduce_scatter(mine, np.arange(2 * w, dtype=np.float32), "avg")
        print(f"scatter={mine.tolist()}", flush=True)
        comm.barrier()
        for bad in (np.zeros(4, dtype=np.complex64), np.zeros((4, 4), dtype=np.float32)[:, 1]):
            try:
                comm.all_reduce(bad)
            except (TypeError, ValueError) as e:
                print(f"refused={type(e).__name__}", flush=True)
        """,
    )
    assert run.code == 0, run.dump()
    for rank in range(3):
        assert run.value(rank, "sum") == "6.0,6.0,True", run.dump()
        assert run.value(rank, "max") == "[2, 0]"
        assert run.value(rank, "bcast") == str([float(i * 12) for i in range(5)])
        assert run.value(rank, "gather") == "[0, 0, 1, 10, 2, 20]"
        assert run.value(rank, "scatter") == str([float(2 * rank), float(2 * rank + 1)])
    assert run.stdout.count("refused=") == 6, run.dump()


@needs_torch
def test_collectives_on_cpu_torch_tensors_and_plain_buffers(launch) -> None:
    run = launch(
        2,
        """
        import array, torch, muster
        comm = muster.Communicator()
        t = torch.full((64,), float(comm.rank + 1), dtype=torch.bfloat16)
        comm.all_reduce(t)
        print(f"bf16={t[0].item()}", flush=True)
        big = torch.ones(16 << 20, dtype=torch.float32)  # 64 MiB
        comm.all_reduce(big, "sum")
        print(f"big={big[0].item()},{big[-1].item()}", flush=True)
        buf = array.array("d", [comm.rank] * 3)
        comm.all_reduce(buf)
        print(f"array={list(buf)}", flush=True)
        """,
        timeout=120,
    )
    assert run.code == 0, run.dump()
    for rank in range(2):
        assert run.value(rank, "bf16") == "3.0", run.dump()
        assert run.value(rank, "big") == "2.0,2.0"
        assert run.value(rank, "array") == "[1.0, 1.0, 1.0]"


@needs_numpy
def test_a_dead_peer_is_named_by_every_rank(launch) -> None:
    run = launch(
        3,
        """
        import os, signal, sys, time, numpy as np, muster
        comm = muster.Communicator()
        a = np.ones(1 << 20, dtype=np.float32)
        comm.all_reduce(a)
        if comm.rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            for _ in range(1000):
                comm.all_reduce(a)
        except muster.RankFailedError as e:
            print(f"lost={e.rank},{time.monotonic() - start:.2f}", flush=True)
            sys.exit(3)
        """,
    )
    assert run.code != 0, run.dump()
    for rank in (0, 2):
        who, waited = run.value(rank, "lost").split(",")
        assert who == "1" and float(waited) < 10, run.dump()
