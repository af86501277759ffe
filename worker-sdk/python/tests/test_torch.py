"""``muster.torch`` under the real ``muster-agent launch``: a gloo DDP job initialised through
``muster.torch.init_process_group`` and through ``init_method="muster://"`` with
``MASTER_ADDR``/``MASTER_PORT`` removed (so no TCPStore can be opened), and the store's
operations as torch calls them."""

from __future__ import annotations

import importlib.util
import pickle
import random
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed in this venv"
)

DDP = """
import os, sys
for k in ("MASTER_ADDR", "MASTER_PORT"):
    os.environ.pop(k, None)
import torch, torch.distributed as dist
import muster.torch
if sys.argv[-1] == "api":
    muster.torch.init_process_group("gloo")
else:
    dist.init_process_group("gloo", init_method="muster://")
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 2))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
torch.manual_seed(dist.get_rank())
for _ in range(3):
    opt.zero_grad()
    model(torch.randn(8, 4)).sum().backward()
    opt.step()
# DDP keeps the replicas identical: the average of the weights is every rank's weights.
w = model.module.weight.detach().clone()
dist.all_reduce(w)
w /= dist.get_world_size()
print(f"ddp={dist.get_rank()},{dist.get_world_size()},{torch.allclose(w, model.module.weight)}", flush=True)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.mark.parametrize("how", ["api", "url"])
def test_a_ddp_job_needs_no_master_port(launch, how) -> None:
    script = DDP.replace('sys.argv[-1] == "api"', f'"{how}" == "api"')
    run = launch(3, script, timeout=180)
    assert run.code == 0, run.dump()
    for rank in range(3):
        assert run.value(rank, "ddp") == f"{rank},3,True", run.dump()


def test_the_store_serves_what_torch_asks(launch) -> None:
    run = launch(
        2,
        """
        import datetime, time
        import torch.distributed as dist
        import muster.torch
        store = muster.torch.Store(timeout=datetime.timedelta(seconds=30))
        rank = muster.Accelerator().process_index
        store.add("count", 1)
        if rank == 0:
            store.set("k", b"v0")
        print(f"get={store.get('k').decode()}", flush=True)  # rank 1 blocks until rank 0 sets it
        store.wait(["count"])
        # torch's compare_set: empty expected means "only if unset"; one rank wins.
        won = store.compare_set("lock", "", f"rank{rank}")
        print(f"lock={won.decode()}", flush=True)
        muster.Accelerator().wait_for_everyone()
        print(f"count={store.add('count', 0)}", flush=True)
        print(f"check={store.check(['k', 'count'])},{store.check(['nope'])}", flush=True)
        start = time.monotonic()
        try:
            store.wait(["never"], datetime.timedelta(seconds=0.3))
        except dist.DistStoreError as e:
            print(f"timeout={time.monotonic() - start:.1f},{'never' in str(e)}", flush=True)
        # multi_get: every key, in the order asked, each waited for (rank 1's own key is set
        # after rank 0 starts waiting for it).
        if rank == 1:
            time.sleep(0.2)
        store.set(f"m{rank}", f"v{rank}")
        print(f"multi={[v.decode() for v in store.multi_get(['m1', 'm0', 'k'])]}", flush=True)
        print(f"extended={store.has_extended_api()}", flush=True)
        store.set_timeout(datetime.timedelta(seconds=0.3))
        try:
            store.multi_get(["m0", "never"])
        except dist.DistStoreError as e:
            print(f"multi_timeout={'never' in str(e)}", flush=True)
        store.set_timeout(datetime.timedelta(seconds=30))
        muster.Accelerator().wait_for_everyone()
        if rank == 0:
            print(f"deleted={store.delete_key('k')},{store.delete_key('k')}", flush=True)
            print(f"keys={store.num_keys()}", flush=True)
        """,
    )
    assert run.code == 0, run.dump()
    locks = {run.value(r, "lock") for r in range(2)}
    assert len(locks) == 1 and locks.pop() in ("rank0", "rank1"), run.dump()
    for rank in range(2):
        assert run.value(rank, "get") == "v0"
        assert run.value(rank, "count") == "2"
        assert run.value(rank, "check") == "True,False"
        waited, named = run.value(rank, "timeout").split(",")
        assert float(waited) < 5 and named == "True", run.dump()
        assert run.value(rank, "multi") == "['v1', 'v0', 'v0']", run.dump()
        assert run.value(rank, "extended") == "True", run.dump()
        assert run.value(rank, "multi_timeout") == "True", run.dump()
    assert run.value(0, "deleted") == "True,False"
    # count, lock, m0 and m1 remain.
    assert run.value(0, "keys") == "4", run.dump()


def test_gloo_reads_every_address_in_one_batch(launch) -> None:
    """gloo's rendezvous through ``muster.torch.Store`` reads the ranks' addresses with one
    ``multi_get`` (the store's extended API and ``GLOO_ENABLE_STORE_V2_API``, which the store
    sets), not a ``wait`` and a ``get`` per rank: one round trip instead of two per rank."""
    run = launch(
        4,
        """
        import collections, os
        import torch, torch.distributed as dist
        import muster.torch

        calls = collections.Counter()

        class Counting(muster.torch.Store):
            def get(self, key):
                calls["get"] += 1
                return super().get(key)

            def wait(self, keys, timeout=None):
                calls["wait"] += 1
                return super().wait(keys, timeout)

            def multi_get(self, keys):
                calls[f"multi_get{len(keys)}"] += 1
                return super().multi_get(keys)

        accelerator = muster.Accelerator()
        store = Counting(accelerator)
        dist.init_process_group(
            "gloo", store=store, rank=accelerator.process_index,
            world_size=accelerator.num_processes,
        )
        print(f"reads={sorted(calls.items())}", flush=True)
        print(f"env={os.environ['GLOO_ENABLE_STORE_V2_API']}", flush=True)
        t = torch.ones(1)
        dist.all_reduce(t)
        print(f"sum={int(t.item())}", flush=True)
        dist.destroy_process_group()
        """,
        timeout=120,
    )
    assert run.code == 0, run.dump()
    for rank in range(4):
        assert run.value(rank, "reads") == "[('multi_get4', 1)]", run.dump()
        assert run.value(rank, "env") == "1", run.dump()
        assert run.value(rank, "sum") == "4", run.dump()


def test_the_agent_store_and_muster_torch_store_are_two_doors_to_the_same_keys(launch) -> None:
    """torch's own TCPStore client at MASTER_PORT (the agent's store, as ``env://`` reaches it)
    and ``muster.torch.Store`` read and write the same keys of the same generation."""
    run = launch(
        2,
        """
        import datetime, os
        import torch.distributed as dist
        import muster, muster.torch
        timeout = datetime.timedelta(seconds=30)
        ours = muster.torch.Store(timeout=timeout)
        theirs = dist.TCPStore(
            os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False,
            timeout=timeout,
        )
        rank = muster.Accelerator().process_index
        if rank == 0:
            ours.set("from-sdk", b"s")
        else:
            theirs.set("from-tcpstore", b"t")
        print(f"tcpstore_sees={theirs.get('from-sdk').decode()}", flush=True)
        print(f"sdk_sees={ours.get('from-tcpstore').decode()}", flush=True)
        ours.add("n", 1)
        theirs.add("n", 10)
        muster.Accelerator().wait_for_everyone()
        print(f"n={theirs.add('n', 0)},{ours.add('n', 0)}", flush=True)
        print(f"agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}", flush=True)
        """,
        timeout=120,
    )
    assert run.code == 0, run.dump()
    for rank in range(2):
        assert run.value(rank, "tcpstore_sees") == "s", run.dump()
        assert run.value(rank, "sdk_sees") == "t", run.dump()
        assert run.value(rank, "n") == "22,22", run.dump()
        assert run.value(rank, "agent_store") == "True", run.dump()


def test_a_generator_state_restores_every_generator_in_another_process() -> None:
    # No launcher: muster.torch's generator helpers are plain torch, numpy and random calls.
    code = """
import pickle, random, sys
import numpy, torch
import muster.torch
torch.manual_seed(5); random.seed(6); numpy.random.seed(7)
state = muster.torch.rng_state()
draws = (torch.rand(3).tolist(), random.random(), numpy.random.random(2).tolist())
sys.stdout.buffer.write(pickle.dumps((state, draws)))
"""
    done = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)
    import muster.torch
    import numpy
    import torch

    state, draws = pickle.loads(done.stdout)
    assert sorted(state) == ["numpy", "python", "torch"]
    torch.manual_seed(0)
    random.seed(0)
    numpy.random.seed(0)
    muster.torch.set_rng_state(state)
    assert (torch.rand(3).tolist(), random.random(), numpy.random.random(2).tolist()) == draws


def test_each_init_reads_its_own_namespace_and_a_replacement_counts_as_the_survivors(
    monkeypatch,
) -> None:
    import types

    import muster.torch as mt

    monkeypatch.setattr(mt, "_INITS", (0, 0))
    survivor = types.SimpleNamespace(epoch=0)
    # Before any recovery: the first group reads the plain namespace, each later one its own.
    assert [mt._fresh_prefix(survivor) for _ in range(3)] == ["", "init1/", "init2/"]
    # After a recovery to epoch 4, the survivor counts again under the epoch...
    survivor.epoch = 4
    after = [mt._fresh_prefix(survivor) for _ in range(2)]
    assert after == ["e4/init1/", "e4/init2/"]
    # ... as the replacement does, which saw none of the groups before its quorum.
    monkeypatch.setattr(mt, "_INITS", (0, 0))
    replacement = types.SimpleNamespace(epoch=4)
    assert [mt._fresh_prefix(replacement) for _ in range(2)] == after
