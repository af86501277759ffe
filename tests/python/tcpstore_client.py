"""torch's own TCPStore client against muster's agent store (agent/tests/tcpstore.rs, and
tests/tests/agent_store_ha.rs for `in-flight`): one mode per check, each printing what it saw
so that the Rust test asserts on it.

Usage: tcpstore_client.py PORT MODE [ARGS...]
"""

import datetime
import os
import sys
import threading
import time

import torch.distributed as dist


def connect(port: int, timeout_s: float = 30.0) -> dist.TCPStore:
    return dist.TCPStore(
        "127.0.0.1",
        port,
        is_master=False,
        timeout=datetime.timedelta(seconds=timeout_s),
        wait_for_workers=False,
    )


def every_operation(s: dist.TCPStore) -> None:
    """Every operation torch's client sends, each checked against torch's own semantics."""
    s.set("k", "v")
    assert s.get("k") == b"v", s.get("k")
    assert s.check(["k"]) and not s.check(["k", "absent"])
    assert s.add("n", 5) == 5 and s.add("n", -2) == 3
    assert s.get("n") == b"3"
    # compare_set: swaps on a match, answers the current value on a mismatch, creates with an
    # empty expected value, and answers `expected` when the key is absent and stays absent.
    assert s.compare_set("k", "v", "w") == b"w"
    assert s.compare_set("k", "nope", "x") == b"w"
    assert s.compare_set("fresh", "", "f") == b"f"
    assert s.compare_set("missing", "e", "d") == b"e"
    assert not s.check(["missing"])
    s.append("log", "a")
    s.append("log", "b")
    assert s.get("log") == b"ab"
    s.multi_set(["m1", "m2"], ["1", "2"])
    assert s.multi_get(["m1", "m2"]) == [b"1", b"2"]
    s.wait(["k", "m1"])
    s.wait(["k"], datetime.timedelta(seconds=1))
    # Keys so far: k, n, fresh, log, m1, m2.
    assert s.num_keys() == 6, s.num_keys()
    keys = sorted(s.list_keys())
    print("list_keys", keys)
    assert s.delete_key("m2") and not s.delete_key("m2")
    assert s.num_keys() == 5
    s.queue_push("q", "first")
    s.queue_push("q", b"second")
    assert s.queue_len("q") == 2
    assert s.check(["q"])
    assert s.queue_pop("q") == b"first"
    assert s.queue_pop("q") == b"second"
    assert s.queue_len("q") == 0
    try:
        s.queue_pop("q", block=False)
        raise AssertionError("a pop of an empty queue returned")
    except dist.QueueEmptyError:
        pass
    # Queues are not keys.
    assert s.num_keys() == 5
    print("every operation ok")


def in_flight(port: int, go: str, counter: str, cas: str, log: str, queue: str) -> None:
    """One mutation that is not idempotent per connection (so per lane at the agent), all sent
    at once while the test holds the coordinator leader frozen and then kills it: each must
    complete on the next leader, applied once. Prints "connected" once every connection is
    made, then waits for the file `go` (the test freezes the leader first: a frozen leader loses
    its lease within the TTL, so the calls must go out at once), and prints "calling OP" just
    before each call and "OP RESULT" after it."""
    calls = {
        "add": lambda s: s.add(counter, 7),
        "compare_set": lambda s: s.compare_set(cas, "v1", "v2").decode(),
        "append": lambda s: s.append(log, "x"),
        "queue_push": lambda s: s.queue_push(queue, "item"),
    }
    # Past the failover: torch's own timeout would end a call first.
    stores = {op: connect(port, timeout_s=180.0) for op in calls}
    failed = []
    printing = threading.Lock()

    def say(line: str) -> None:
        with printing:
            print(line, flush=True)

    def run(op: str) -> None:
        say(f"calling {op}")
        try:
            result = calls[op](stores[op])
            say(f"{op} {'done' if result is None else result}")
        except Exception as e:  # noqa: BLE001 - reported to the test, which fails on it
            failed.append(f"{op}: {e!r}")

    say("connected")
    deadline = time.monotonic() + 300
    while not os.path.exists(go):
        if time.monotonic() > deadline:
            sys.exit(f"{go} never appeared")
        time.sleep(0.01)

    threads = [threading.Thread(target=run, args=(op,)) for op in calls]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if failed:
        sys.exit("in-flight calls failed: " + "; ".join(failed))


def main() -> None:
    port = int(sys.argv[1])
    mode = sys.argv[2]
    args = sys.argv[3:]
    if mode == "ops":
        every_operation(connect(port))
    elif mode == "wait-timeout":
        # get and wait of a key nobody sets: torch's timeout error within the timeout.
        s = connect(port, timeout_s=1.0)
        for what, call in [
            ("get", lambda: s.get("never")),
            ("wait", lambda: s.wait(["never"], datetime.timedelta(seconds=1))),
        ]:
            started = time.monotonic()
            try:
                call()
                print(f"{what} returned")
            except dist.DistStoreError as e:
                print(f"{what} DistStoreError after {time.monotonic() - started:.2f} s: {e}")
        # The connection is still good after the timeouts.
        s.set("after", "1")
        print("after", s.get("after").decode())
    elif mode == "wait-for":
        # Blocks until another process sets the key.
        s = connect(port)
        started = time.monotonic()
        value = s.get(args[0])
        print(f"got {value.decode()} after {time.monotonic() - started:.2f} s")
    elif mode == "add":
        s = connect(port)
        for _ in range(int(args[1])):
            s.add(args[0], 1)
        print("added")
    elif mode == "cas":
        s = connect(port)
        me = args[1]
        won = s.compare_set(args[0], "", me) == me.encode()
        print("won" if won else "lost")
    elif mode == "set":
        connect(port).set(args[0], args[1])
        print("set")
    elif mode == "get":
        print("value", connect(port).get(args[0]).decode())
    elif mode == "pop":
        print("popped", connect(port).queue_pop(args[0]).decode())
    elif mode == "try":
        # One get through a new client: what it got, or the type of what it raised.
        try:
            print("got", connect(port, timeout_s=5.0).get(args[0]).decode(), flush=True)
        except Exception as e:  # noqa: BLE001 - its type is the answer
            print(f"raised {type(e).__name__} pid {os.getpid()}", flush=True)
    elif mode == "refused-set":
        # A set the store refuses: its client's next call raises; nothing was stored.
        s = connect(port, timeout_s=5.0)
        s.set("refused", b"x" * int(args[0]))
        try:
            s.get("refused")
            print("next call returned")
        except Exception as e:  # noqa: BLE001 - its type is the answer
            print(f"next call {type(e).__name__}")
        print("stored", connect(port).check(["refused"]))
    elif mode == "in-flight":
        in_flight(port, *args)
    elif mode == "push":
        connect(port).queue_push(args[0], args[1])
        print("pushed")
    else:
        sys.exit(f"unknown mode {mode}")


if __name__ == "__main__":
    main()
