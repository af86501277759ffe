"""``muster.Accelerator`` under the real ``muster-agent launch``: process control with
Accelerate's names, failures as exceptions naming the rank, waits that Ctrl-C interrupts, other
threads, forked children, the key-value store and NCCL unique ids."""

from __future__ import annotations

import subprocess
import sys

import muster


def test_without_a_launcher_it_is_a_world_of_one() -> None:
    # A fresh interpreter with no MUSTER_* variables, as a script run by hand.
    code = """
import muster
a = muster.Accelerator()
assert (a.process_index, a.num_processes, a.num_nodes, a.is_main_process) == (0, 1, 1, True)
assert not a.is_distributed and a.generation == 1 and a.restart_count == 0
a.wait_for_everyone()
with a.main_process_first():
    pass
assert a.main_process_first_share(lambda: [1, 2]) == [1, 2]
a.store.set("k", "v")
assert a.store.get("k") == b"v" and a.store.get("nope") is None
assert a.store.get_many(["k", "k"], timeout=0) == [b"v", b"v"]
try:
    a.store.get_many(["k", "nope"], timeout=3600)
except muster.NotFoundError as e:
    assert "'nope'" in str(e), e
else:
    raise AssertionError("a batch with a key nobody can set returned")
try:
    a.store.get("nope", timeout=0.05)
except muster.NotFoundError as e:
    print("not found:", e)
else:
    raise AssertionError("a wait for a key nobody can set returned")
print("ok")
"""
    env = {"PATH": "/usr/bin:/bin"}
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=30)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip().endswith("ok")


def test_properties_match_the_launch(launch) -> None:
    run = launch(
        3,
        """
        import muster
        a = muster.Accelerator()
        print(f"place={a.process_index},{a.local_process_index},{a.num_processes},{a.local_num_processes},"
              f"{a.num_nodes},{a.node_rank},{a.is_main_process},{a.is_local_main_process},{a.generation},"
              f"{a.restart_count},{a.is_distributed}")
        """,
    )
    assert run.code == 0, run.dump()
    for rank in range(3):
        main = rank == 0
        assert run.value(rank, "place") == f"{rank},{rank},3,3,1,0,{main},{main},1,0,True"


def test_main_process_first_runs_the_main_process_before_the_others(launch) -> None:
    run = launch(
        4,
        """
        import time, muster
        a = muster.Accelerator()
        with a.main_process_first():
            print(f"start={time.time_ns()}", flush=True)
            if a.is_main_process:
                time.sleep(0.2)
            print(f"done={time.time_ns()}", flush=True)
        """,
    )
    assert run.code == 0, run.dump()
    # Judged by the clock each line carries: lines of several processes may land in any order.
    main_done = int(run.value(0, "done"))
    for rank in range(1, 4):
        assert main_done <= int(run.value(rank, "start")), run.dump()


def test_main_process_first_share_computes_once_per_generation(launch) -> None:
    # Generation 1: rank 0 shares, then rank 1 fails; generation 2 must get generation 2's value,
    # never generation 1's (the seed's stale-cache complaint).
    run = launch(
        3,
        """
        import os, muster
        a = muster.Accelerator()
        computed = []
        def build():
            computed.append(1)
            return {"made_in_generation": a.generation}
        value = a.main_process_first_share(build)
        print(f"gen{a.generation}={value['made_in_generation']},{len(computed)}", flush=True)
        a.wait_for_everyone()
        if a.generation == 1 and a.process_index == 1:
            os._exit(4)
        a.wait_for_everyone()
        """,
        "--max-restarts",
        "1",
    )
    assert run.code == 0, run.dump()
    for rank in range(3):
        assert run.value(rank, "gen2") == f"2,{1 if rank == 0 else 0}", run.dump()


def test_a_killed_rank_makes_every_waiting_rank_raise_naming_it(launch) -> None:
    run = launch(
        4,
        """
        import os, signal, sys, time, muster
        a = muster.Accelerator()
        a.wait_for_everyone()
        if a.process_index == 2:
            time.sleep(0.3)
            os.kill(os.getpid(), signal.SIGKILL)
        start = time.monotonic()
        try:
            a.wait_for_everyone()
        except muster.RankFailedError as e:
            print(f"raised={e.rank},{e.node},{e.host},{time.monotonic() - start:.3f}", flush=True)
            print(f"cause={e.cause}", flush=True)
            sys.exit(3)
        print("raised=none", flush=True)
        """,
    )
    assert run.code != 0, run.dump()
    for rank in (0, 1, 3):
        who, node, host, waited = run.value(rank, "raised").split(",")
        assert (who, node) == ("2", "0"), run.dump()
        assert host, run.dump()
        # The kill lands 0.3 s into the wait; the verdict comes within milliseconds of the
        # agent seeing the exit. Seconds of margin against a loaded machine.
        assert float(waited) < 5.0, run.dump()
        assert "2" in run.value(rank, "cause"), run.dump()


def test_divergent_barriers_raise_naming_both_call_sites(launch) -> None:
    run = launch(
        2,
        """
        import sys, muster
        a = muster.Accelerator()
        try:
            if a.is_main_process:
                a.wait_for_everyone()  # line 6
            else:
                a.wait_for_everyone()  # line 8
        except muster.DivergedError as e:
            print(f"diverged={e}", flush=True)
            sys.exit(5)
        """,
    )
    assert run.code != 0, run.dump()
    message = run.value(0, "diverged") if run.lines(0) else run.value(1, "diverged")
    assert "worker.py:6" in message and "worker.py:8" in message, run.dump()


def test_ctrl_c_interrupts_a_wait_quickly(launch) -> None:
    run = launch(
        2,
        """
        import os, signal, threading, time, muster
        a = muster.Accelerator()
        if a.process_index == 1:
            time.sleep(3)  # never reaches the barrier in time
        else:
            sent = []
            def interrupt():
                time.sleep(0.3)
                sent.append(time.monotonic())
                os.kill(os.getpid(), signal.SIGINT)
            threading.Thread(target=interrupt).start()
            try:
                a.wait_for_everyone()
                print("interrupted=no", flush=True)
            except KeyboardInterrupt:
                print(f"interrupted={time.monotonic() - sent[0]:.3f}", flush=True)
        """,
    )
    waited = run.value(0, "interrupted")
    assert waited != "no", run.dump()
    # The wait looks for signals every 50 ms.
    assert float(waited) < 0.2, run.dump()


def test_ctrl_c_interrupts_a_store_wait_and_a_handler_may_use_the_store(launch) -> None:
    run = launch(
        1,
        """
        import os, signal, threading, time, muster
        a = muster.Accelerator()
        # A handler that uses the store itself while the main thread's wait is under way.
        def handler(signum, frame):
            a.store.set("from-the-handler", b"yes")
            raise KeyboardInterrupt
        signal.signal(signal.SIGINT, handler)
        sent = []
        def interrupt():
            time.sleep(0.3)
            sent.append(time.monotonic())
            os.kill(os.getpid(), signal.SIGINT)
        threading.Thread(target=interrupt).start()
        try:
            a.store.get_many(["never-set"], timeout=30)
            print("interrupted=no", flush=True)
        except KeyboardInterrupt:
            print(f"interrupted={time.monotonic() - sent[0]:.3f}", flush=True)
        # The store is usable after the interrupted call.
        print(f"handler={a.store.get('from-the-handler')!r}", flush=True)
        a.store.set("after", b"1")
        print(f"after={a.store.get_many(['after'], timeout=5)!r}", flush=True)
        """,
    )
    assert run.code == 0, run.dump()
    waited = run.value(0, "interrupted")
    assert waited != "no", run.dump()
    assert float(waited) < 0.2, run.dump()
    assert run.value(0, "handler") == "b'yes'", run.dump()
    assert run.value(0, "after") == "[b'1']", run.dump()


def test_a_thread_other_than_the_main_one_can_wait(launch) -> None:
    run = launch(
        2,
        """
        import threading, muster
        a = muster.Accelerator()
        out = []
        def work():
            a.wait_for_everyone("from-a-thread")
            out.append(a.main_process_first_share(lambda: "shared from a thread"))
        t = threading.Thread(target=work)
        t.start()
        t.join(30)
        print(f"thread={out}", flush=True)
        """,
    )
    assert run.code == 0, run.dump()
    for rank in range(2):
        assert run.value(rank, "thread") == "['shared from a thread']", run.dump()


def test_a_forked_child_gets_a_clear_error_not_a_deadlock(launch) -> None:
    run = launch(
        2,
        """
        import os, muster
        a = muster.Accelerator()
        pid = os.fork()
        if pid == 0:
            try:
                a.wait_for_everyone()
                print("child=waited", flush=True)
            except muster.MusterError as e:
                print(f"child={e}", flush=True)
            os._exit(0)
        os.waitpid(pid, 0)
        a.wait_for_everyone()
        print(f"parent=ok", flush=True)
        """,
        timeout=60,
    )
    assert run.code == 0, run.dump()
    for rank in range(2):
        assert "forked child" in run.value(rank, "child"), run.dump()
        assert run.value(rank, "parent") == "ok"


#: A worker that reports whether ``import muster`` began its connection, whether a Python
#: process it starts itself (a tool, a spawned child) would have, and then waits as usual.
EARLY = """
import os, subprocess, sys
import muster
import muster.accelerator as acc
print(f"early={acc._CONNECTING is not None}", flush=True)
child = subprocess.run(
    [sys.executable, "-c", "import muster.accelerator as a; print(a._CONNECTING is not None)"],
    capture_output=True, text=True, check=True,
)
print(f"child_early={child.stdout.strip()}", flush=True)
a = muster.Accelerator()
a.wait_for_everyone()
print(f"rank={a.process_index} taken={acc._CONNECTING is None}", flush=True)
"""


def test_import_connects_early_in_the_agents_worker_only(launch) -> None:
    run = launch(2, EARLY)
    assert run.code == 0, run.dump()
    for rank in range(2):
        assert run.value(rank, "early") == "True", run.dump()
        # The worker's own child (its parent is the worker, not the agent) does not register
        # the rank a second time.
        assert run.value(rank, "child_early") == "False", run.dump()
        assert run.value(rank, "rank") == f"{rank} taken=True", run.dump()


def test_early_connection_can_be_turned_off(launch) -> None:
    run = launch(2, EARLY, env={"MUSTER_EARLY_CONNECT": "0"})
    assert run.code == 0, run.dump()
    for rank in range(2):
        assert run.value(rank, "early") == "False", run.dump()
        assert run.value(rank, "rank") == f"{rank} taken=True", run.dump()


def test_an_early_connection_unused_leaves_cleanly_and_a_fork_cannot_take_it(launch) -> None:
    # Rank 1 imports muster, forks (the child may not take the connection being made), and
    # exits without an Accelerator: its early connection leaves the job at exit, so rank 0,
    # waiting, hears that it left instead of waiting for it.
    run = launch(
        2,
        """
        import os, muster
        if int(os.environ["RANK"]) == 1:
            pid = os.fork()
            if pid == 0:
                try:
                    muster.Accelerator()
                    print("child=made", flush=True)
                except muster.MusterError as e:
                    print(f"child={e}", flush=True)
                os._exit(0)
            os.waitpid(pid, 0)
            raise SystemExit(0)
        try:
            muster.Accelerator().wait_for_everyone(timeout=30)
            print("waited=yes", flush=True)
        except muster.RankLeftError as e:
            print(f"left={e.rank}", flush=True)
        """,
        timeout=60,
    )
    assert "forked from muster worker" in run.value(1, "child"), run.dump()
    assert run.value(0, "left") == "1", run.dump()

def test_the_key_value_store_is_shared_and_atomic(launch) -> None:
    run = launch(
        4,
        """
        import muster
        a = muster.Accelerator()
        kv = a.store
        for _ in range(25):
            kv.add("count", 1)
        swapped, _ = kv.compare_set("winner", None, str(a.process_index))
        a.wait_for_everyone()
        if a.is_main_process:
            kv.set("greeting", "hello")
        print(f"count={int(kv.get('count'))}", flush=True)
        print(f"swapped={swapped}", flush=True)
        print(f"greeting={kv.get('greeting', timeout=30).decode()}", flush=True)
        kv.set(f"rank{a.process_index}", str(a.process_index))
        every = kv.get_many([f"rank{r}" for r in reversed(range(4))], timeout=30)
        print(f"every={b','.join(every).decode()}", flush=True)
        try:
            kv.get("never-set", timeout=0.2)
        except muster.WaitTimeoutError as e:
            print(f"timeout={type(e).__name__}", flush=True)
        a.wait_for_everyone()
        """,
    )
    assert run.code == 0, run.dump()
    swaps = [run.value(r, "swapped") for r in range(4)]
    assert swaps.count("True") == 1, run.dump()
    for rank in range(4):
        assert run.value(rank, "count") == "100", run.dump()
        assert run.value(rank, "greeting") == "hello"
        assert run.value(rank, "every") == "3,2,1,0", run.dump()
        assert run.value(rank, "timeout") == "WaitTimeoutError"


def test_nccl_unique_ids_reach_every_rank(launch) -> None:
    run = launch(
        3,
        """
        import hashlib, os, muster
        a = muster.Accelerator()
        if a.is_main_process:
            a.publish_nccl_unique_id("world", os.urandom(muster.NCCL_UNIQUE_ID_BYTES))
        uid = a.fetch_nccl_unique_id("world")
        print(f"id={hashlib.sha256(uid).hexdigest()},{len(uid)}", flush=True)
        """,
    )
    assert run.code == 0, run.dump()
    ids = {run.value(r, "id") for r in range(3)}
    assert len(ids) == 1 and ids.pop().endswith(",128"), run.dump()


def test_on_main_process_and_print(launch) -> None:
    run = launch(
        2,
        """
        import muster
        a = muster.Accelerator()
        @a.on_main_process
        def only_main():
            return "ran"
        print(f"decorated={only_main()}", flush=True)
        a.print("printed once per node")
        """,
    )
    assert run.code == 0, run.dump()
    assert run.value(0, "decorated") == "ran" and run.value(1, "decorated") == "None"
    assert run.stdout.count("printed once per node") == 1, run.dump()


def test_errors_are_one_family() -> None:
    assert issubclass(muster.RankFailedError, muster.MusterError)
    assert issubclass(muster.RankLeftError, muster.RankFailedError)
    assert issubclass(muster.WaitTimeoutError, TimeoutError)
    e = muster.RankFailedError("rank 3 failed", rank=3, node=1, host="h", cause="killed")
    assert (e.rank, e.node, e.host, e.cause) == (3, 1, "h", "killed")


def test_barrier_names_are_the_callers_file_and_line() -> None:
    from muster.accelerator import _call_site

    def site() -> str:
        return _call_site(1)

    looped = [site() for _ in range(3)]  # one line: one name, however often it runs
    here = site()
    assert len(set(looped)) == 1 and looped[0].startswith("test_accelerator.py:"), looped
    assert here == f"test_accelerator.py:{int(looped[0].split(':')[1]) + 1}", (here, looped)
    # Another file at the same line: its own base name, not the cached one of this file.
    elsewhere = eval(compile("site()", "/elsewhere/other.py", "eval"), {"site": site})
    assert elsewhere == "other.py:1"
