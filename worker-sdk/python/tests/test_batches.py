"""``muster.torch.Batches``: a DataLoader read by step. A second loader, given the first one's
``state_dict`` and generators at a step (what an in-place recovery heals), reads the same
batches from there on, mid-epoch included, with worker processes whose random augmentations
match; a rank that redoes a step gets the same batch and draws the same numbers after it; a
loader sharded with torch's ``DistributedSampler`` reads its shard anew each epoch and a
replacement rebuilds its own shard; and what cannot be rebuilt is refused, naming why. In one
process: no job needed."""

from __future__ import annotations

import importlib.util

import pytest

pytestmark = pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="torch is not installed in this venv")

#: Samples per epoch and per batch: 10 batches an epoch.
SAMPLES, BATCH = 40, 4


def _dataset():
    import torch

    class Augmented(torch.utils.data.Dataset):
        """Sample ``i`` plus noise drawn where it is read (in a worker, with workers)."""

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int):
            return torch.full((3,), float(i)) + torch.rand(3)

    return Augmented()


def _loader(workers: int, seed: int | None = None):
    import torch

    generator = None if seed is None else torch.Generator().manual_seed(seed)
    return torch.utils.data.DataLoader(
        _dataset(), batch_size=BATCH, shuffle=True, num_workers=workers, generator=generator
    )


def _run(workers: int, steps: int, seed: int | None, at: set[int]):
    """Reads ``steps`` batches as a training loop does (generators marked before each read,
    a draw after it); returns the batches and, for each step in ``at``, the generators at its
    start and the loader's state after its read."""
    import torch
    from muster.torch import Batches, rng_state

    torch.manual_seed(0)
    batches = Batches(_loader(workers, seed))
    read, saved = [], {}
    for step in range(steps):
        start = rng_state()
        read.append(batches.batch(step))
        if step in at:
            saved[step] = (start, batches.state_dict())
        torch.rand(1)  # the step's own draws
    return read, saved


@pytest.mark.parametrize("seed", [None, 5], ids=["global-generator", "own-generator"])
def test_a_loader_rebuilt_mid_epoch_reads_what_the_first_read(seed) -> None:
    import torch
    from muster.torch import Batches, set_rng_state

    read, saved = _run(2, 25, seed, {13, 20})
    for step in (13, 20):
        start, state = saved[step]
        torch.manual_seed(123)  # a replacement's own start: nothing of it may matter
        again = Batches(_loader(2, None if seed is None else 77))
        again.load_state_dict(state)
        set_rng_state(start)
        for s in range(step, 25):
            assert torch.equal(again.batch(s), read[s]), f"step {s} after a rebuild at {step}"
            torch.rand(1)

    # The control: a fresh iterator from the same generators, moved to the same place, does not
    # read the same batch (another shuffle, other worker seeds).
    start, _ = saved[13]
    set_rng_state(start)
    naive = iter(_loader(2, None if seed is None else 77))
    for _ in range(3):
        next(naive)
    assert not torch.equal(next(naive), read[13])


def test_an_epoch_whose_start_the_state_does_not_carry_begins_from_the_generators() -> None:
    import torch
    from muster.torch import Batches, rng_state, set_rng_state

    # The source had not begun epoch 2 (its state is of epoch 1) when step 20, its first
    # batch, was interrupted: the generators at step 20's start are enough.
    read, saved = _run(2, 22, None, {19})
    torch.manual_seed(0)
    replay = Batches(_loader(2))
    for step in range(20):
        replay.batch(step)
        torch.rand(1)
    start = rng_state()
    again = Batches(_loader(2))
    again.load_state_dict(saved[19][1])
    set_rng_state(start)
    assert torch.equal(again.batch(20), read[20])


def test_a_redone_step_gets_its_batch_and_the_same_draws_after_it() -> None:
    import torch
    from muster.torch import Batches, rng_state, set_rng_state

    torch.manual_seed(0)
    batches = Batches(_loader(0))
    for step in range(14):
        start = rng_state()
        batch = batches.batch(step)
        draw = torch.rand(1)
    # Step 13 interrupted: the generators rewound to its start (muster.torch.recover), redone.
    set_rng_state(start)
    assert batches.batch(13) is batch
    assert torch.equal(torch.rand(1), draw)


def _sharded(rank: int, workers: int = 0):
    """Rank ``rank``'s loader of a 2-process job, sharded with torch's ``DistributedSampler``."""
    import torch

    sampler = torch.utils.data.DistributedSampler(_dataset(), num_replicas=2, rank=rank, shuffle=True, seed=3)
    return torch.utils.data.DataLoader(_dataset(), batch_size=BATCH, sampler=sampler, num_workers=workers)


def _indices(batch) -> list[int]:
    """The sample indices of a batch of ``_dataset`` (each sample is its index plus noise in [0, 1))."""
    return [int(row[0].floor()) for row in batch]


def test_a_sharded_loader_reads_its_shard_anew_each_epoch_and_a_replacement_rebuilds_its_own_shard() -> None:
    import torch
    from muster.torch import Batches, rng_state, set_rng_state

    per_epoch = SAMPLES // 2 // BATCH  # 5 batches a rank and epoch
    read: dict[int, list] = {}
    saved = None
    for rank in (0, 1):
        torch.manual_seed(0)
        batches = Batches(_sharded(rank, workers=2))
        read[rank] = []
        for step in range(3 * per_epoch):
            start = rng_state()
            read[rank].append(batches.batch(step))
            if rank == 0 and step == per_epoch + 2:
                saved = (start, batches.state_dict())
            torch.rand(1)
    assert saved is not None
    for epoch in range(3):
        shards = [[i for b in read[r][epoch * per_epoch : (epoch + 1) * per_epoch] for i in _indices(b)] for r in (0, 1)]
        # The two ranks' shards of an epoch are disjoint and cover the dataset.
        assert sorted(shards[0] + shards[1]) == list(range(SAMPLES)), f"epoch {epoch}: {shards}"
    # Each epoch is shuffled anew: the sampler was told the epoch.
    orders = [[i for b in read[0][e * per_epoch : (e + 1) * per_epoch] for i in _indices(b)] for e in range(3)]
    assert orders[0] != orders[1] != orders[2], orders

    # Rank 1 dies mid-epoch 1; its replacement heals from rank 0 (its state and generators) and
    # reads rank 1's batches from there, its loader's workers drawing what the dead rank's drew.
    start, state = saved
    torch.manual_seed(123)
    again = Batches(_sharded(1, workers=2))
    again.load_state_dict(state)
    set_rng_state(start)
    for step in range(per_epoch + 2, 3 * per_epoch):
        assert torch.equal(again.batch(step), read[1][step]), f"step {step}"
        torch.rand(1)


def test_what_cannot_be_rebuilt_is_refused() -> None:
    import torch
    from muster.torch import Batches

    with pytest.raises(ValueError, match="persistent_workers"):
        Batches(torch.utils.data.DataLoader(_dataset(), num_workers=1, persistent_workers=True))

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="needs a DataLoader with a length"):
        Batches(torch.utils.data.DataLoader(Stream()))
    with pytest.raises(RuntimeError, match="batch 3 of epoch 1, whose start this process did not see"):
        Batches(_loader(0)).batch(13)
