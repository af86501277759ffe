"""In-place recovery of a Python training loop under the real ``muster-agent launch --recovery
in-place``: a torch CPU loop (a small MLP, gradients averaged with ``dist.all_reduce`` on gloo,
SGD with momentum) whose last rank aborts itself at step 15. The survivors keep their processes,
rebuild the process group through the muster store, heal the replacement over it, and end with
the same weights, bit for bit, as a run without the failure. The same loop on
``muster.Communicator`` (``reconfigure`` and ``heal_bytes``) checks the SDK's own collectives.
A variant that draws random numbers every step (dropout, Python's and numpy's generators) heals
its generators too, and ends with the same weights only when it marks its steps; another reads
its data from a shuffled ``DataLoader``, sharded by rank, whose two worker processes augment
every sample (``muster.torch.Batches``), interrupted mid-epoch."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys

import muster
import pytest

needs_torch = pytest.mark.skipif(
    importlib.util.find_spec("torch") is None, reason="torch is not installed in this venv"
)

#: The training loop, run once per ``(COMM, DRAWS)`` of ``LOOPS``. ``COMM`` (gloo or muster)
#: picks what averages the gradients; ``DRAWS``: 0, no random draws; 1, dropout and noise from
#: Python's and numpy's generators, each step marked with ``muster.torch.begin_step``; 2, the
#: same draws with no marks; 3, dropout and marks, the data from a DataLoader sharded by rank
#: (torch's ``DistributedSampler``, 7 batches a rank and epoch) read by step, its workers
#: drawing noise. ``FAIL_AT`` (0: never) is the step after
#: which the last rank aborts in the job's first life.
TRAIN = """
import hashlib, io, os, random, sys
import numpy
import torch, torch.distributed as dist
import muster, muster.torch

LOOPS, FAIL_AT, STEPS = {loops}, {fail_at}, 24
acc = muster.Accelerator()
rank, world = acc.process_index, acc.num_processes
print(f"started rank={{rank}} pid={{os.getpid()}}", flush=True)


def state():
    got = {{"model": model.state_dict(), "opt": opt.state_dict(), "step": step}}
    if DRAWS == 3:
        got["data"] = data.state_dict()
    return got


def load(got):
    global step
    model.load_state_dict(got["model"])
    opt.load_state_dict(got["opt"])
    step = got["step"]
    if DRAWS == 3:
        data.load_state_dict(got["data"])


class Augmented(torch.utils.data.Dataset):
    def __len__(self):
        return 112

    def __getitem__(self, i):
        x = torch.randn(8, generator=torch.Generator().manual_seed(i))
        # Drawn in the worker process that reads the sample.
        return x * (1 + 0.1 * torch.rand(1)), x.sum(dim=0, keepdim=True).sin()


def recover(committed):
    if COMM == "gloo":
        quorum, got = muster.torch.recover(committed, state(), accelerator=acc)
    else:
        while True:
            quorum = acc.quorum(committed)
            try:
                comm.reconfigure(quorum)
                payload = None
                if quorum.healed_by(rank):
                    buffer = io.BytesIO()
                    torch.save(state(), buffer)
                    payload = buffer.getvalue()
                blob = comm.heal_bytes(quorum, payload)
            except muster.RecoverableError:
                continue
            got = None if blob is None else torch.load(io.BytesIO(blob), weights_only=False)
            break
    if got is not None:
        load(got)
    print(f"recovered rank={{rank}} epoch={{quorum.epoch}} step={{quorum.step}} heal={{quorum.heal}}", flush=True)


for COMM, DRAWS in LOOPS:
    torch.manual_seed(0)
    random.seed(1)
    numpy.random.seed(2)
    dropout = [torch.nn.Dropout(0.25)] if DRAWS else []
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), *dropout, torch.nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    params = list(model.parameters())
    if DRAWS == 3:
        # Each rank its shard (28 samples), shuffled anew each epoch (Batches tells the sampler).
        shard = torch.utils.data.DistributedSampler(Augmented(), num_replicas=world, rank=rank, shuffle=True, seed=4)
        data = muster.torch.Batches(torch.utils.data.DataLoader(Augmented(), batch_size=4, sampler=shard, num_workers=2))
    step, loss_avg = 0, float("nan")
    comm = None
    if acc.is_replacement:
        if COMM == "muster":
            # A replacement takes part in a quorum before it makes a communicator.
            first = acc.quorum(None)
            comm = muster.Communicator(acc)
            blob = comm.heal_bytes(first, None)
            load(torch.load(io.BytesIO(blob), weights_only=False))
            print(f"recovered rank={{rank}} epoch={{first.epoch}} step={{first.step}} heal={{first.heal}}", flush=True)
        else:
            recover(None)
    elif COMM == "gloo":
        muster.torch.init_process_group("gloo")
    else:
        comm = muster.Communicator(acc)

    while step < STEPS:
        if acc.membership_changed():
            recover(step)
            continue
        if DRAWS in (1, 3):
            muster.torch.begin_step(step)
        g = torch.Generator().manual_seed(1000 * step + rank)
        x = torch.randn(16, 8, generator=g)
        y = x.sum(dim=1, keepdim=True).sin()
        if DRAWS == 3:
            x, y = data.batch(step)
        elif DRAWS:
            noise = torch.from_numpy(numpy.random.standard_normal(x.shape)).float()
            x = x * (1 + 0.1 * random.random()) + 0.01 * noise
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [loss.detach().reshape(1)])
        try:
            if COMM == "gloo":
                dist.all_reduce(flat)
            else:
                comm.all_reduce(flat)
        except Exception as e:
            # The step is discarded: nothing of it was applied.
            if (COMM == "gloo" and muster.torch.interrupted(e, acc)) or getattr(e, "recoverable", False):
                print(f"interrupted rank={{rank}} step={{step}}: {{type(e).__name__}}", file=sys.stderr, flush=True)
                recover(step)
                continue
            raise
        flat /= world
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        loss_avg = flat[-1].item()
        opt.step()
        step += 1
        if step == FAIL_AT and rank == world - 1 and acc.restart_count == 0:
            print(f"aborting rank={{rank}} step={{step}}", file=sys.stderr, flush=True)
            os.abort()

    digest = hashlib.sha256(b"".join(p.detach().numpy().tobytes() for p in params)).hexdigest()
    if rank == 0:
        print(f"final loop={{COMM}}/{{DRAWS}} steps={{step}} loss={{loss_avg!r}} checksum={{digest}}", flush=True)
    if COMM == "gloo":
        dist.barrier()
        dist.destroy_process_group()
    else:
        comm.barrier()
"""

FLAGS = ("--recovery", "in-place", "--max-restarts", "1")


def _finals(run) -> dict[str, dict[str, str]]:
    """Rank 0's ``final`` lines, by loop: ``{"gloo/0": {"steps": ..., ...}}``."""
    finals = {}
    for line in run.lines(0):
        if line.startswith("final "):
            fields = dict(kv.split("=", 1) for kv in line.split()[1:])
            finals[fields.pop("loop")] = fields
    return finals


def _pids(run, rank: int) -> list[str]:
    return [m.group(1) for ln in run.lines(rank) if (m := re.match(r"started rank=\d+ pid=(\d+)", ln))]


@needs_torch
def test_a_torch_loop_recovers_in_place_with_the_same_weights(launch) -> None:
    # The failure-free runs of every loop, in one launch.
    loops = [("gloo", 0), ("muster", 0), ("gloo", 1), ("gloo", 3)]
    clean = launch(4, TRAIN.format(loops=loops, fail_at=0), *FLAGS, timeout=120)
    assert clean.code == 0, clean.dump()
    expected = _finals(clean)
    assert sorted(expected) == ["gloo/0", "gloo/1", "gloo/3", "muster/0"], clean.dump()
    for loop in expected.values():
        assert loop["steps"] == "24", clean.dump()

    # The loop that draws random numbers marks its steps: the survivors rewind their
    # generators to the interrupted step's start and the replacement gets its source's, so the
    # redone step draws what the run without the failure drew.
    for loop in loops:
        key = f"{loop[0]}/{loop[1]}"
        run = launch(4, TRAIN.format(loops=[loop], fail_at=15), *FLAGS, timeout=120)
        assert run.code == 0, run.dump()
        assert "aborting rank=3 step=15" in run.stderr, run.dump()
        # The survivors kept their processes; only the dead rank started twice.
        for rank in range(3):
            assert len(_pids(run, rank)) == 1, run.dump()
        assert len(set(_pids(run, 3))) == 2, run.dump()
        # Every rank took part in a recovery that healed rank 3 to step 15.
        for rank in range(4):
            recovered = [ln for ln in run.lines(rank) if ln.startswith("recovered ")]
            assert recovered, run.dump()
            assert "step=15 heal=[(3, " in recovered[-1], run.dump()
        # The discarded step was redone at full world size: the same weights, bit for bit.
        assert _finals(run) == {key: expected[key]}, run.dump()

    # The control: with no marks the survivors redo the step with generators that already
    # drew for it, and the weights differ.
    unmarked = launch(4, TRAIN.format(loops=[("gloo", 2)], fail_at=15), *FLAGS, timeout=120)
    assert unmarked.code == 0, unmarked.dump()
    assert "aborting rank=3 step=15" in unmarked.stderr, unmarked.dump()
    got = _finals(unmarked)["gloo/2"]
    assert got["steps"] == "24", unmarked.dump()
    assert got["checksum"] != expected["gloo/1"]["checksum"], unmarked.dump()


def test_without_a_launcher_recovery_is_a_world_of_one() -> None:
    # A fresh interpreter with no MUSTER_* variables: restart mode, nothing ever changes, and a
    # quorum is this process alone.
    code = """
import muster
a = muster.Accelerator()
assert (a.recovery, a.is_replacement, a.epoch, a.membership_changed()) == ("restart", False, 0, False)
q = a.quorum(7)
assert (q.epoch, q.world_size, q.step, q.heal, q.source_of(0), q.healed_by(0)) == (0, 1, 7, [], None, [])
a.begin_step(3)  # a step marker with no coordinator to count it: nothing to do
print(repr(q))
"""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MUSTER_", "PET_"))}
    done = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "Quorum(epoch=0, world_size=1, step=7, heal=[])", done.stdout


def test_a_membership_change_is_a_recoverable_rank_failure() -> None:
    error = muster.MembershipChangedError("rank 3 died", rank=3, node=0, host="h", cause="killed", epoch=2)
    # Code written for restart mode still catches it as a dead rank.
    assert isinstance(error, muster.RankFailedError) and isinstance(error, muster.RecoverableError)
    assert (error.rank, error.epoch, error.recoverable) == (3, 2, True)
    assert not muster.RankFailedError("rank 3 died").recoverable
    assert not muster.MusterError("anything").recoverable
