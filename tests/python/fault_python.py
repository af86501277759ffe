"""The `python` workload of the fault suite (tests/tests/fault_injection.rs): Python SDK
workers (`muster`) looping on barriers, `main_process_first_share`, the job's key-value store
and a `Communicator` all_reduce, recording every step in the suite's history format (the lines
of worker-sdk/examples/fault_probe.rs: `start`, `barrier-enter`/`barrier-exit`, `kv` before
and after each store call, `exit`), so that the suite's checker, linearizability included,
runs over them.

Environment: MUSTER_FAULT_HISTORY (the history file, appended to), MUSTER_FAULT_STOP_FILE (the
run ends once it exists), and what `muster-agent launch` gives every worker.

How it ends: rank 0, seeing the stop file after barrier S, sets `py-stop-at-<generation>` to
S + 2 before it enters barrier S + 1, so every rank reads it after completing S + 1 at the
latest and all stop after the same barrier.
"""

import array
import os
import sys
import time

import muster
from fault_history import History, text
from muster.comm import Communicator

BARRIER = "py"
COUNTER = "py-count"
REGISTER = "py-reg"


def run(history: History, stop_file: str) -> None:
    acc = muster.Accelerator()
    gen, rank = acc.generation, acc.process_index
    history.head = {"gen": gen, "rank": rank, "node": acc.node_rank, "pid": os.getpid()}
    history.record("start", world=acc.num_processes, restart_count=acc.restart_count)
    store = acc.store
    comm = Communicator(acc)
    stop_key = f"py-stop-at-{gen}"
    stop_at = None
    written = None
    seq = 0
    while True:
        seq += 1
        history.record("barrier-enter", name=BARRIER, seq=seq)
        acc.wait_for_everyone(BARRIER)
        history.record("barrier-exit", name=BARRIER, seq=seq)
        # A value computed once, by rank 0 first, and the same on every rank.
        shared = acc.main_process_first_share(lambda s=seq: f"g{gen}s{s}")
        if shared != f"g{gen}s{seq}":
            raise RuntimeError(f"main_process_first_share gave {shared!r} at barrier {seq}")
        buffer = array.array("d", [float(rank)])
        comm.all_reduce(buffer)
        expected = acc.num_processes * (acc.num_processes - 1) / 2
        if buffer[0] != expected:
            raise RuntimeError(f"all_reduce gave {buffer[0]}, not {expected}, at barrier {seq}")
        history.call(
            {"op": "add", "key": COUNTER, "delta": 1},
            lambda: store.add(COUNTER, 1),
            lambda s: {"sum": s},
        )
        if rank % 2 == 0:
            value = f"g{gen}r{rank}s{seq}"
            history.call(
                {"op": "set", "key": REGISTER, "value": value},
                lambda value=value: store.set(REGISTER, value),
                lambda _: {"done": True},
            )
            written = value
        else:
            history.call(
                {"op": "get", "key": REGISTER},
                lambda: store.get(REGISTER),
                lambda v: {"value": text(v)},
            )
        if rank == 0 and seq % 5 == 0:
            desired = f"g{gen}r{rank}s{seq}cas"
            history.call(
                {"op": "cas", "key": REGISTER, "expected": written, "desired": desired},
                lambda e=written, d=desired: store.compare_set(REGISTER, e, d),
                lambda o: {"swapped": o[0], "current": text(o[1])},
            )
        if rank == 1 and seq % 7 == 0:
            history.call(
                {"op": "delete", "key": REGISTER},
                lambda: store.delete(REGISTER),
                lambda existed: {"existed": existed},
            )
        if stop_at is None:
            if rank == 0:
                if os.path.exists(stop_file):
                    stop_at = seq + 2
                    store.set(stop_key, str(stop_at))
            else:
                value = store.get(stop_key)
                if value is not None:
                    stop_at = int(value)
        if stop_at is not None and seq >= stop_at:
            break
        time.sleep(0.05)
    acc.end_training()


def main() -> int:
    history = History(os.environ["MUSTER_FAULT_HISTORY"])
    try:
        run(history, os.environ["MUSTER_FAULT_STOP_FILE"])
    except Exception as e:  # noqa: BLE001 - every failure ends the worker, recorded
        history.record("exit", status=1, error=f"{type(e).__name__}: {e}")
        print(f"fault_python: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    history.record("exit", status=0)
    return 0


if __name__ == "__main__":
    sys.exit(main())
