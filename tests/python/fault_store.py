"""The `torch-store` workload of the fault suite (tests/tests/fault_injection.rs): torch's own
TCPStore client on muster's agent store, doing set, get, add, compare_set, wait and
multi_get in a loop, and recording every call in the suite's history format (the same `kv`
lines as worker-sdk/examples/fault_probe.rs: one before the call, one after it returned; a
`set`, which torch sends without waiting for a reply, counts as returned when the client's
next call returns), so that the suite checks them for linearizability.

Environment: MUSTER_FAULT_HISTORY (the history file, appended to), MUSTER_FAULT_STOP_FILE (the
run stops once it exists), and what `muster-agent launch` gives a torch worker (RANK,
GROUP_RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT, MUSTER_GENERATION,
TORCHELASTIC_RESTART_COUNT).

Keys: the agent store keeps each generation's keys apart (`torch/g<generation>/`), so the
history names them `g<generation>/<key>`. Every rank adds 1 to `count`; rank 0 sets `reg`
first (the others wait for it), even ranks then set it and odd ranks read it with `get` and,
every 3 rounds, with `multi_get` of both keys; every 5 rounds rank 0 compare-and-sets it from
the value it last wrote.
"""

import datetime
import os
import sys
import time

import torch.distributed as dist
from fault_history import History, now_us, text


def main() -> int:
    gen = int(os.environ["MUSTER_GENERATION"])
    rank = int(os.environ["RANK"])
    history = History(
        os.environ["MUSTER_FAULT_HISTORY"],
        {"gen": gen, "rank": rank, "node": int(os.environ["GROUP_RANK"]), "pid": os.getpid()},
    )
    stop_file = os.environ["MUSTER_FAULT_STOP_FILE"]
    history.record(
        "start",
        world=int(os.environ["WORLD_SIZE"]),
        restart_count=int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
    )
    try:
        store = dist.TCPStore(
            os.environ["MASTER_ADDR"],
            int(os.environ["MASTER_PORT"]),
            is_master=False,
            timeout=datetime.timedelta(seconds=300),
            wait_for_workers=False,
        )
        count, reg = f"g{gen}/count", f"g{gen}/reg"
        written = f"g{gen}r{rank}s0"
        if rank == 0:
            history.send(
                {"op": "set", "key": reg, "value": written},
                lambda: store.set("reg", written),
            )
        store.wait(["reg"])
        seq = 0
        while not os.path.exists(stop_file):
            seq += 1
            history.call(
                {"op": "add", "key": count, "delta": 1},
                lambda: store.add("count", 1),
                lambda s: {"sum": s},
            )
            if rank % 2 == 0:
                value = f"g{gen}r{rank}s{seq}"
                history.send(
                    {"op": "set", "key": reg, "value": value},
                    lambda value=value: store.set("reg", value),
                )
                written = value
            elif seq % 3 == 0:
                # One call, two keys: recorded as a read of each (a linearizable multi-key
                # read projects onto linearizable reads of each key).
                call_us = now_us()
                values = store.multi_get(["count", "reg"])
                ret_us = now_us()
                history.answered(ret_us)
                for key, value in zip((count, reg), values):
                    history.calls += 1
                    history.record(
                        "kv",
                        n=history.calls,
                        op="get",
                        key=key,
                        call_us=call_us,
                        ret_us=ret_us,
                        value=text(value),
                    )
            else:
                history.call(
                    {"op": "get", "key": reg},
                    lambda: store.get("reg"),
                    lambda v: {"value": text(v)},
                )
            if rank == 0 and seq % 5 == 0:
                desired = f"g{gen}r{rank}s{seq}cas"
                expected = written

                def outcome(current: bytes, expected=expected, desired=desired) -> dict:
                    # torch answers the value after the call, or `expected` for an absent key
                    # (which `reg` never is once set); the desired value is unique, so seeing
                    # it means the swap happened.
                    got = text(current)
                    return {"swapped": got == desired, "current": got}

                history.call(
                    {"op": "cas", "key": reg, "expected": expected, "desired": desired},
                    lambda e=expected, d=desired: store.compare_set("reg", e, d),
                    outcome,
                )
                written = desired
            time.sleep(0.05)
    except Exception as e:  # noqa: BLE001 - every failure ends the worker, recorded
        history.record("exit", status=1, error=f"{type(e).__name__}: {e}")
        print(f"fault_store: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    history.record("exit", status=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
