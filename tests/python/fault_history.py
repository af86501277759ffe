"""The fault suite's history lines as its Python workers write them (tests/python/fault_store.py,
tests/python/fault_python.py): the format of worker-sdk/examples/fault_probe.rs, read by
tests/src/faults.rs. One line per `write` on a file opened O_APPEND, so that the lines of
concurrent workers stay whole.
"""

import json
import os
import time


def now_us() -> int:
    """Microseconds since the Unix epoch: the clock of the `kv` lines."""
    return time.time_ns() // 1000


def text(value: bytes | None) -> str | None:
    """A stored value as the history writes it (`None` for an absent key)."""
    return None if value is None else value.decode()


class History:
    """The history file; `head` (generation, rank, node, pid) starts every line."""

    def __init__(self, path: str, head: dict | None = None) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        self.head: dict = head if head is not None else {"pid": os.getpid()}
        self.calls = 0
        # Calls sent without a reply (`send`), not yet known to have been applied.
        self.unanswered: list[tuple[int, int, dict]] = []

    def record(self, event: str, **fields) -> None:
        line = {"t_ms": time.time_ns() // 1_000_000, "event": event, **self.head, **fields}
        os.write(self.fd, (json.dumps(line) + "\n").encode())

    def call(self, fields: dict, run, result):
        """Runs one store call, recorded before (outcome unknown) and after it returned."""
        self.calls += 1
        n = self.calls
        call_us = now_us()
        self.record("kv", n=n, call_us=call_us, ret_us=None, **fields)
        answer = run()
        ret_us = now_us()
        self.answered(ret_us)
        self.record("kv", n=n, call_us=call_us, ret_us=ret_us, **fields, **result(answer))
        return answer

    def send(self, fields: dict, run) -> None:
        """Runs a store call that gets no reply (torch's `set`): its return means only that
        the request was written to the socket. It is recorded before it, and as returned when
        a later call of the same client returns (the server takes a client's requests in
        order), so until then its outcome is unknown. Recorded at its own return, two sets of
        two clients were seen applied in the other order, which the checker rightly called
        not linearizable (found by the soak)."""
        self.calls += 1
        n = self.calls
        call_us = now_us()
        self.record("kv", n=n, call_us=call_us, ret_us=None, **fields)
        run()
        self.unanswered.append((n, call_us, fields))

    def answered(self, ret_us: int) -> None:
        """A call of this client returned at `ret_us`: the calls sent before it were applied."""
        for n, call_us, fields in self.unanswered:
            self.record("kv", n=n, call_us=call_us, ret_us=ret_us, **fields, done=True)
        self.unanswered.clear()
