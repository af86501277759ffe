"""Per-operation latency of torch's own ``TCPStore`` client for ``target/release/store``, run as
two ranks under ``muster-agent launch``: rank 1 times ``set`` (with an empty ``check`` behind it, since a set has no reply), ``get``, ``add``, ``check([])`` and a new client's connection
against the store at MASTER_ADDR:MASTER_PORT, which is the agent's store when the launcher sets
``TORCHELASTIC_USE_AGENT_STORE=True`` and otherwise a TCPStore server that rank 0 opens, as
``env://`` would. ``check`` of no keys is answered by the server without touching its keys (the
agent store makes no coordinator call for it), so it times the loopback hop alone.

Rank 1 prints one line per operation: ``op=set p50_us=... p90_us=... n=...``."""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import time

import torch.distributed as dist

TIMEOUT = datetime.timedelta(seconds=120)


def percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(int(q * len(xs)), len(xs) - 1)]


def timed(op, iters: int, warmup: int) -> list[float]:
    for i in range(warmup):
        op(i)
    out = []
    for i in range(iters):
        t = time.perf_counter_ns()
        op(i)
        out.append((time.perf_counter_ns() - t) / 1e3)
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=1000)
    parser.add_argument("--warmup", type=int, default=100)
    args = parser.parse_args()
    rank = int(os.environ["RANK"])
    agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"],
        int(os.environ["MASTER_PORT"]),
        int(os.environ["WORLD_SIZE"]),
        is_master=rank == 0 and not agent_store,
        timeout=TIMEOUT,
        wait_for_workers=False,
    )
    if rank != 1:
        # Keeps a TCPStore server (when it holds one) up until rank 1 is done with it.
        store.wait(["bench/done"])
        return
    value = b"x" * 16
    store.set("bench/key", value)
    ops = {
        # torch's set has no reply: the empty check behind it answers once the set is applied.
        "set_applied": lambda i: (store.set("bench/key", value), store.check([])),
        "get": lambda i: store.get("bench/key"),
        "add": lambda i: store.add("bench/counter", 1),
        "check_empty": lambda i: store.check([]),
    }
    host, port = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])

    def connect(i: int) -> None:
        # A new client each time: torch's connect and handshake; the agent store also checks
        # that the connection is one of its own workers' (/proc/net/tcp and /proc/PID/fd).
        dist.TCPStore(host, port, is_master=False, timeout=TIMEOUT, wait_for_workers=False)

    ops["connect"] = connect
    for name, op in ops.items():
        # Fewer connections than calls: each leaves a socket in TIME_WAIT behind it.
        n = min(args.iters, 200) if name == "connect" else args.iters
        xs = timed(op, n, min(args.warmup, n // 10))
        print(
            f"op={name} p50_us={percentile(xs, 0.5):.1f} p90_us={percentile(xs, 0.9):.1f} "
            f"mean_us={statistics.fmean(xs):.1f} n={len(xs)}",
            flush=True,
        )
    store.set("bench/done", b"1")


if __name__ == "__main__":
    main()
