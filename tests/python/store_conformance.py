"""The agent store against torch's own TCPStore server, sequence for sequence.

Each sequence below runs twice, with torch's own client: once against a TCPStore server
started here (torch's libuv server, what torchrun's rank 0 runs) and once against muster's
agent store at the port given. A sequence returns what it observed (results, and the type of
every exception), and the two must be equal. Prints one line per sequence and exits 1 when any
differs (agent/tests/tcpstore.rs asserts on it).

Usage: store_conformance.py AGENT_STORE_PORT
"""

import datetime
import hashlib
import sys
import threading
import time

import torch.distributed as dist

# torch's libuv server: a key's wire length (the client puts "/" before it) and a value's
# length, each at most these; beyond, the server closes the connection.
MAX_KEY_BYTES = 8 * 1024
MAX_VALUE_BYTES = 8 * 1024 * 1024


class Store:
    """Opens clients of one server: torch's own (`master`) or the agent store (`port`)."""

    def __init__(self, name: str, port: int) -> None:
        self.name = name
        self.port = port

    def client(self, timeout_s: float = 30.0) -> dist.TCPStore:
        return dist.TCPStore(
            "127.0.0.1",
            self.port,
            is_master=False,
            timeout=datetime.timedelta(seconds=timeout_s),
            wait_for_workers=False,
        )


def attempt(call):
    """The call's result, or the name of the exception it raised."""
    try:
        return call()
    except Exception as e:  # noqa: BLE001 - the type is what is compared
        return f"raised {type(e).__name__}"


def every_operation(store: Store, p: str) -> list:
    """Every operation torch's client sends, each result kept."""
    s = store.client()
    seen = []
    seen.append(attempt(lambda: s.set(f"{p}k", "v")))
    seen.append(attempt(lambda: s.get(f"{p}k")))
    seen.append(attempt(lambda: s.check([f"{p}k"])))
    seen.append(attempt(lambda: s.check([f"{p}k", f"{p}absent"])))
    seen.append(attempt(lambda: s.add(f"{p}n", 5)))
    seen.append(attempt(lambda: s.add(f"{p}n", -7)))
    seen.append(attempt(lambda: s.add(f"{p}n", 0)))
    seen.append(attempt(lambda: s.get(f"{p}n")))
    seen.append(attempt(lambda: s.compare_set(f"{p}k", "v", "w")))
    seen.append(attempt(lambda: s.compare_set(f"{p}k", "nope", "x")))
    seen.append(attempt(lambda: s.compare_set(f"{p}fresh", "", "f")))
    seen.append(attempt(lambda: s.compare_set(f"{p}missing", "e", "d")))
    seen.append(attempt(lambda: s.check([f"{p}missing"])))
    seen.append(attempt(lambda: s.append(f"{p}log", "a")))
    seen.append(attempt(lambda: s.append(f"{p}log", b"\x00\xff")))
    seen.append(attempt(lambda: s.get(f"{p}log")))
    seen.append(attempt(lambda: s.multi_set([f"{p}m1", f"{p}m2"], ["1", b"\x00"])))
    seen.append(attempt(lambda: s.multi_get([f"{p}m1", f"{p}m2", f"{p}k"])))
    seen.append(attempt(lambda: s.wait([f"{p}k", f"{p}m1"])))
    seen.append(attempt(lambda: s.wait([f"{p}k"], datetime.timedelta(seconds=1))))
    seen.append(attempt(lambda: s.delete_key(f"{p}m2")))
    seen.append(attempt(lambda: s.delete_key(f"{p}m2")))
    seen.append(attempt(lambda: s.check([f"{p}m2"])))
    # Empty values are values.
    seen.append(attempt(lambda: s.set(f"{p}empty", b"")))
    seen.append(attempt(lambda: s.get(f"{p}empty")))
    seen.append(attempt(lambda: s.check([f"{p}empty"])))
    # Keys beyond ASCII.
    seen.append(attempt(lambda: s.set(f"{p}ключ/ü", "u")))
    seen.append(attempt(lambda: s.get(f"{p}ключ/ü")))
    # Queues.
    seen.append(attempt(lambda: s.queue_push(f"{p}q", "first")))
    seen.append(attempt(lambda: s.queue_push(f"{p}q", b"second")))
    seen.append(attempt(lambda: s.queue_len(f"{p}q")))
    seen.append(attempt(lambda: s.check([f"{p}q"])))
    seen.append(attempt(lambda: s.queue_pop(f"{p}q")))
    seen.append(attempt(lambda: s.queue_pop(f"{p}q", block=False)))
    seen.append(attempt(lambda: s.queue_pop(f"{p}q", block=False)))
    seen.append(attempt(lambda: s.queue_len(f"{p}q")))
    return seen


def counting_keys(store: Store, p: str) -> list:
    """num_keys and list_keys, as changes: each server holds keys of its own besides."""
    s = store.client()
    before = s.num_keys()
    listed_before = set(s.list_keys())
    for i in range(3):
        s.set(f"{p}c{i}", str(i))
    s.queue_push(f"{p}cq", "item")
    after = s.num_keys()
    s.delete_key(f"{p}c0")
    deleted = s.num_keys()
    listed = sorted(set(s.list_keys()) - listed_before)
    return [after - before, deleted - before, listed]


def timeouts(store: Store, p: str) -> list:
    """A get and a wait of a key nobody sets end with torch's timeout error, within the
    timeout, and the connection still serves."""
    s = store.client(timeout_s=1.0)
    seen = []
    for call in (
        lambda: s.get(f"{p}never"),
        lambda: s.wait([f"{p}never"]),
        lambda: s.wait([f"{p}never"], datetime.timedelta(seconds=0.5)),
    ):
        started = time.monotonic()
        seen.append(attempt(call))
        seen.append(time.monotonic() - started < 5)
    seen.append(attempt(lambda: s.set(f"{p}after", "1")))
    seen.append(attempt(lambda: s.get(f"{p}after")))
    return seen


def woken(store: Store, p: str) -> list:
    """A wait and a blocking get, each woken by another client's set."""
    waiter = store.client()
    getter = store.client()
    setter = store.client()
    seen = {}

    def wait() -> None:
        seen["wait"] = attempt(lambda: waiter.wait([f"{p}w"]))

    def get() -> None:
        seen["get"] = attempt(lambda: getter.get(f"{p}g"))

    threads = [threading.Thread(target=wait), threading.Thread(target=get)]
    for t in threads:
        t.start()
    time.sleep(0.3)
    asleep = [t.is_alive() for t in threads]
    setter.set(f"{p}w", "1")
    setter.set(f"{p}g", "value")
    for t in threads:
        t.join(10)
    return [asleep, seen.get("wait", "never woke"), seen.get("get", "never woke")]


def sixteen_clients(store: Store, p: str) -> list:
    """16 clients at once: adds that all count, a compare_set race with one winner, appends
    that are all kept."""
    clients = [store.client() for _ in range(16)]
    won = []
    lock = threading.Lock()

    def work(i: int, s: dist.TCPStore) -> None:
        for _ in range(20):
            s.add(f"{p}counter", 1)
        if s.compare_set(f"{p}race", "", f"r{i}") == f"r{i}".encode():
            with lock:
                won.append(i)
        s.append(f"{p}appended", "x")

    threads = [threading.Thread(target=work, args=(i, s)) for i, s in enumerate(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    s = store.client()
    winner = s.get(f"{p}race")
    return [
        s.get(f"{p}counter"),
        len(won),
        winner == f"r{won[0]}".encode() if won else "nobody won",
        s.get(f"{p}appended"),
    ]


def digest(value: bytes) -> str:
    return f"{len(value)} bytes, sha256 {hashlib.sha256(value).hexdigest()[:16]}"


def sizes_within(store: Store, p: str) -> list:
    """The longest key and the largest value torch's server takes, through every operation
    that carries them."""
    s = store.client(timeout_s=60.0)
    # The client puts "/" before the key: the wire key is at the limit.
    key = p + "k" * (MAX_KEY_BYTES - 1 - len(p))
    value = bytes(i % 251 for i in range(MAX_VALUE_BYTES))
    seen = []
    seen.append(attempt(lambda: s.set(key, "long key")))
    seen.append(attempt(lambda: s.get(key)))
    seen.append(attempt(lambda: s.check([key])))
    seen.append(attempt(lambda: s.delete_key(key)))
    seen.append(attempt(lambda: s.set(f"{p}big", value)))
    seen.append(attempt(lambda: digest(s.get(f"{p}big"))))
    seen.append(attempt(lambda: digest(s.multi_get([f"{p}big"])[0])))
    seen.append(attempt(lambda: digest(s.compare_set(f"{p}big", value, value[::-1]))))
    seen.append(attempt(lambda: digest(s.get(f"{p}big"))))
    seen.append(attempt(lambda: s.queue_push(f"{p}bigq", value)))
    seen.append(attempt(lambda: digest(s.queue_pop(f"{p}bigq"))))
    seen.append(attempt(lambda: s.delete_key(f"{p}big")))
    return seen


def past_limit(store: Store, p: str, key: str, value: bytes) -> list:
    """One set past torch's limits, then what its client and a new one see."""
    s = store.client(timeout_s=10.0)
    # The set gets no reply: whether it raises itself (the connection was reset while it was
    # still sending) or its client's next call does is a race, with either server.
    refused = attempt(lambda: s.set(key, value))
    if refused is None:
        refused = attempt(lambda: s.get(key))
    fresh = store.client(timeout_s=1.0)
    return [
        refused,
        # The connection is gone.
        attempt(lambda: s.get(key)),
        # Nothing was stored (a check of a too-long key would itself be refused).
        attempt(lambda: fresh.check([key]) if len(key) < MAX_KEY_BYTES else "n/a"),
        # A new client is served.
        attempt(lambda: fresh.set(f"{p}served", "1")),
    ]


def sizes_beyond(store: Store, p: str) -> list:
    """A key or a value past torch's limits: the connection is closed (the call, or the next
    one on that client, raises), nothing is stored, and a new client is served."""
    return [
        past_limit(store, p, p + "k" * (MAX_KEY_BYTES - len(p)), b"v"),
        past_limit(store, p, f"{p}huge", b"x" * (MAX_VALUE_BYTES + 1)),
    ]


SEQUENCES = [
    every_operation,
    counting_keys,
    timeouts,
    woken,
    sixteen_clients,
    sizes_within,
    sizes_beyond,
]


def main() -> None:
    agent = Store("agent store", int(sys.argv[1]))
    master = dist.TCPStore(
        "127.0.0.1",
        0,
        is_master=True,
        wait_for_workers=False,
        timeout=datetime.timedelta(seconds=30),
    )
    torch_store = Store("torch's TCPStore", master.port)
    differ = 0
    for i, sequence in enumerate(SEQUENCES):
        prefix = f"conformance/{i}/"
        ours = sequence(agent, prefix)
        theirs = sequence(torch_store, prefix)
        if ours == theirs:
            print(f"{sequence.__name__}: equal ({len(theirs)} observations)", flush=True)
        else:
            differ += 1
            print(f"{sequence.__name__}: DIFFERS", flush=True)
            for n, (a, b) in enumerate(zip(theirs, ours)):
                if a != b:
                    print(f"  #{n}: torch {str(a)[:200]!r}, agent store {str(b)[:200]!r}")
            if len(ours) != len(theirs):
                print(f"  torch saw {len(theirs)} things, the agent store {len(ours)}")
    print(f"conformance: {len(SEQUENCES) - differ} of {len(SEQUENCES)} sequences equal")
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
