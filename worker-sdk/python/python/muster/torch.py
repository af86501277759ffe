"""PyTorch on muster: :class:`Store`, a ``torch.distributed.Store`` backed by the job's
key-value store at the coordinator (authenticated with the worker's job token, scoped to the
generation, surviving a coordinator failover with etcd); :func:`init_process_group`, which takes
rank and world size from muster and uses that store, so no TCPStore opens on rank 0 and no
``MASTER_PORT`` is needed; and the ``muster://`` rendezvous handler, registered when this module
is imported, so ``torch.distributed.init_process_group("gloo", init_method="muster://")`` works.

In-place recovery (``muster-agent launch --recovery in-place``): :func:`interrupted` tells a
step that a rank's death broke (torch raises a ``RuntimeError`` from a collective whose peer
died) and closes this rank's process group so that its peers' collectives fail too;
:func:`rebuild_process_group` makes the process group again for a quorum's epoch through the
muster store, and :func:`heal` moves the training state from live ranks to the replacement
over it. :func:`begin_step` marks where a step starts: :func:`recover` rewinds every random
generator there and heals the replacement with the same generators (:func:`rng_state`).
:class:`Batches` reads a ``DataLoader`` by step, so that a replacement continues at the same
place of the same epoch, its loader's worker processes drawing what the dead rank's drew. See
docs/python.md for the whole loop.

Importing this module imports torch; ``import muster`` alone does not.
"""

from __future__ import annotations

import contextlib
import datetime
import io
import os
import random
import socket
import sys
import time
import traceback
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist

from muster.accelerator import Accelerator, Quorum
from muster.errors import MusterError, NotFoundError, WaitTimeoutError

#: Every Store made in this process (see Store.__init__).
_LIVE_STORES: list[Store] = []

#: torch's default store timeout.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)

#: In-place recovery: how long one wait of a blocking store read lasts before the membership is
#: checked again (a rank that died while a process group forms never sets its keys).
_IN_PLACE_SLICE = 0.5

#: gloo's switch (read when a process group connects) for reading the ranks' addresses with
#: one multi_get from a store that has the extended API, as this one has.
_GLOO_BATCHED_READS = "GLOO_ENABLE_STORE_V2_API"

#: The key under which :func:`recover` sends the random generators with the healed state.
_RNG_KEY = "muster.rng"

#: The step :func:`begin_step` last marked, and the random generators' state when it did.
_STEP_START: tuple[int, dict[str, Any]] | None = None

#: (membership epoch, process groups this process initialised through muster's store in it):
#: see :func:`_fresh_prefix`.
_INITS = (0, 0)

#: Whether forked children drop the sockets they inherit (:func:`_guard_forks`).
_FORKS_GUARDED = False


def _guard_forks(accelerator: Accelerator) -> None:
    """In place, makes every process forked from this one from now on (a DataLoader's
    workers) close the internet sockets it inherits (:func:`_drop_inherited_sockets`)."""
    global _FORKS_GUARDED
    if accelerator.recovery == "in-place" and not _FORKS_GUARDED:
        os.register_at_fork(after_in_child=_drop_inherited_sockets)
        _FORKS_GUARDED = True


def _drop_inherited_sockets() -> None:
    """In a child just forked from a trainer: closes the internet sockets it inherited, gloo's
    connections to the other ranks among them. The child never uses them (a DataLoader worker
    talks to its parent over pipes and Unix sockets); while it holds them, the trainer closing
    its process group (:func:`interrupted`) closes nothing for its peers, and a neighbour
    blocked in a collective waits for gloo's timeout instead of failing at once."""
    try:
        fds = [int(fd) for fd in os.listdir("/proc/self/fd")]
    except OSError:
        return
    for fd in fds:
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            sock = socket.socket(fileno=fd)
        except (OSError, ValueError):
            continue
        inet = sock.family in (socket.AF_INET, socket.AF_INET6)
        sock.detach()
        if inet:
            with contextlib.suppress(OSError):
                os.close(fd)


def _fresh_prefix(accelerator: Accelerator) -> str:
    """The store prefix of this process's next process group initialisation: none for the
    first, ``init<N>/`` for the N-th after it. Every rank counts alike, so a group initialised
    again in the same generation (after ``destroy_process_group``) reads its peers' new
    addresses, never the keys an earlier group left, as a fresh TCPStore would. After an
    in-place recovery the count starts again under the membership's epoch
    (``e<epoch>/init<N>/``, N from 1: ``e<epoch>/`` is :func:`rebuild_process_group`'s): a
    replacement, which did not see the groups before its quorum, counts as the survivors do."""
    global _INITS
    epoch = accelerator.epoch
    last_epoch, count = _INITS
    n = count if epoch == last_epoch else 0
    _INITS = (epoch, n + 1)
    if epoch == 0:
        return f"init{n}/" if n else ""
    return f"e{epoch}/init{n + 1}/"


class Store(dist.Store):
    """A ``torch.distributed.Store`` over the job's key-value store. Keys live under
    ``torch/g<generation>/`` (plus ``prefix``), so a restarted generation never reads the keys of
    the one before it. Blocking reads wait at the coordinator and raise torch's timeout error
    (``torch.distributed.DistStoreError``) naming the key when the store's timeout runs out; in
    a job that recovers in place, also as soon as the membership changes (a rank died, so a
    process group being formed never completes: :func:`interrupted` says so).

    ``multi_get`` reads its keys as one batch (about one round trip), and making a Store sets
    ``GLOO_ENABLE_STORE_V2_API=1`` unless the environment already says otherwise: gloo then
    reads every rank's address with one ``multi_get`` instead of a wait and a get per rank
    (at 8 processes, 2 store calls per rank instead of 17)."""

    def __init__(
        self,
        accelerator: Accelerator | None = None,
        prefix: str = "",
        timeout: datetime.timedelta = DEFAULT_TIMEOUT,
    ) -> None:
        super().__init__()
        self._accelerator = accelerator or Accelerator()
        self._kv = self._accelerator.store
        self._prefix = f"torch/g{self._accelerator.generation}/{prefix}"
        self.set_timeout(timeout)
        os.environ.setdefault(_GLOO_BATCHED_READS, "1")
        # torch holds a Python store by its C++ half only: once the Python object is collected,
        # torch's calls into it fail ("Not implemented"). Stores live as long as the process.
        _LIVE_STORES.append(self)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _wait_many(self, keys: list[str], timeout: datetime.timedelta | None) -> list[bytes]:
        seconds = (timeout or self.timeout).total_seconds()
        full = [self._key(key) for key in keys]
        if self._accelerator.recovery != "in-place":
            try:
                return self._kv.get_many(full, timeout=seconds)
            except (WaitTimeoutError, NotFoundError) as e:
                raise self._not_set(keys, seconds, e) from e
        # In place, a rank that dies while the group forms never sets its keys: the wait ends
        # when the membership changes (checked between slices), not at the store's timeout.
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            try:
                return self._kv.get_many(full, timeout=max(min(left, _IN_PLACE_SLICE), 0.0))
            except (WaitTimeoutError, NotFoundError) as e:
                if self._accelerator.membership_changed():
                    raise dist.DistStoreError(
                        f"muster store: stopped waiting for {_names(keys)}: the job's "
                        f"membership changed (a rank died; job {self._accelerator.job_id})"
                    ) from e
                if left <= _IN_PLACE_SLICE:
                    raise self._not_set(keys, seconds, e) from e

    def _not_set(self, keys: list[str], seconds: float, cause: Exception) -> dist.DistStoreError:
        unset = "not set" if len(keys) == 1 else "not all set"
        return dist.DistStoreError(
            f"muster store: {_names(keys)} {unset} within {seconds:g} s "
            f"(job {self._accelerator.job_id}, generation {self._accelerator.generation}): {cause}"
        )

    def set(self, key: str, value: Any) -> None:
        self._kv.set(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait_many([key], None)[0]

    def multi_get(self, keys: list[str]) -> list[bytes]:
        return self._wait_many(keys, None)

    def has_extended_api(self) -> bool:
        # multi_get is one batch of reads; append and multi_set are torch's defaults over
        # compare_set and set.
        return True

    def add(self, key: str, value: int) -> int:
        return self._kv.add(self._key(key), int(value))

    def compare_set(self, key: str, expected_value: Any, desired_value: Any) -> bytes:
        # torch: an empty `expected` means "only if the key is unset"; the answer is the value
        # the key holds after the call, or `expected` when the key is unset and stays unset.
        expected = _bytes(expected_value)
        _, current = self._kv.compare_set(
            self._key(key), expected if expected else None, _bytes(desired_value)
        )
        if current is None:
            return expected
        return current

    def delete_key(self, key: str) -> bool:
        return self._kv.delete(self._key(key))

    def num_keys(self) -> int:
        return len(self._kv.items(self._prefix))

    def check(self, keys: list[str]) -> bool:
        return all(self._kv.get(self._key(k)) is not None for k in keys)

    def wait(self, keys: list[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_many(keys, timeout)


def _names(keys: list[str]) -> str:
    """``key 'a'`` or ``keys 'a', 'b'``, for an error message."""
    quoted = ", ".join(f"'{key}'" for key in keys)
    return f"key {quoted}" if len(keys) == 1 else f"keys {quoted}"


def _bytes(value: Any) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


def init_process_group(
    backend: str = "gloo",
    accelerator: Accelerator | None = None,
    timeout: datetime.timedelta | None = None,
    **kwargs: Any,
) -> Accelerator:
    """``torch.distributed.init_process_group`` with muster's rank, world size and store: no
    TCPStore, no ``MASTER_ADDR``/``MASTER_PORT``. Returns the process's :class:`Accelerator`."""
    accelerator = accelerator or Accelerator()
    _guard_forks(accelerator)
    store = Store(accelerator, prefix=_fresh_prefix(accelerator), timeout=timeout or DEFAULT_TIMEOUT)
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(
        backend,
        store=store,
        rank=accelerator.process_index,
        world_size=accelerator.num_processes,
        **kwargs,
    )
    return accelerator


def interrupted(
    error: BaseException, accelerator: Accelerator | None = None, wait: float = 30.0
) -> bool:
    """Whether ``error``, raised by a collective or a muster call during a step, means that a
    rank died and the job recovers in place: then discard the step and recover (ask
    :meth:`muster.Accelerator.quorum`, :func:`rebuild_process_group`, :func:`heal`); else
    re-raise it.

    A muster error answers with its ``recoverable`` attribute. A ``RuntimeError`` (what torch
    raises when a gloo connection to a dead peer breaks) counts in in-place mode once the
    coordinator has pushed the membership change, which is waited for up to ``wait`` seconds
    (the broken connection can be seen first); a ``RuntimeError`` with no membership change
    behind it is not an interruption. Either way, this rank's process group is closed first:
    a peer blocked on this rank in the same collective (gloo's ring only talks to neighbours)
    then fails at once instead of waiting for torch's timeout."""
    accelerator = accelerator or Accelerator()
    if accelerator.recovery != "in-place":
        return False
    if isinstance(error, MusterError):
        if not error.recoverable:
            return False
        _release(error)
        abort_process_group()
        return True
    if not isinstance(error, RuntimeError):
        return False
    deadline = time.monotonic() + wait
    _release(error)
    abort_process_group()
    while not accelerator.membership_changed():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.002)
    return True


def _release(error: BaseException) -> None:
    """Drops the local variables of the finished frames ``error`` went through: torch's
    collective frames hold the process group and its work, and while they do, destroying the
    group does not close its connections (the traceback itself, for printing, is kept)."""
    traceback.clear_frames(error.__traceback__)


def abort_process_group() -> None:
    """Aborts and destroys the default process group, if there is one: its connections close,
    so collectives of other ranks waiting on this one fail instead of hanging. Errors of a
    group already broken are ignored (it is being thrown away). The connections close only
    once nothing refers to the group any more: not a pending ``Work`` of an ``async_op``
    collective, nor the traceback of the error a collective raised (:func:`interrupted`
    clears those frames)."""
    if not dist.is_initialized():
        return
    group = dist.group.WORLD
    # A broken group may refuse either call; nothing of it is kept.
    with contextlib.suppress(Exception):
        group.abort()
    del group
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


def rebuild_process_group(
    quorum: Quorum,
    backend: str = "gloo",
    accelerator: Accelerator | None = None,
    timeout: datetime.timedelta | None = None,
    **kwargs: Any,
) -> None:
    """Makes torch's default process group again for ``quorum``'s membership, on every rank
    after the same quorum (a replacement: after its first, ``quorum(None)``): the old group is
    aborted and destroyed, and the new one meets through the muster store under the quorum's
    epoch (``Store(prefix=f"e{epoch}/")``, so it never reads an older membership's keys), with
    the quorum's world size and this rank. ``kwargs`` go to ``init_process_group``."""
    accelerator = accelerator or Accelerator()
    abort_process_group()
    _guard_forks(accelerator)
    store = Store(accelerator, prefix=f"e{quorum.epoch}/", timeout=timeout or DEFAULT_TIMEOUT)
    if timeout is not None:
        kwargs["timeout"] = timeout
    dist.init_process_group(
        backend,
        store=store,
        rank=accelerator.process_index,
        world_size=quorum.world_size,
        **kwargs,
    )


def heal(quorum: Quorum, state: dict[str, Any], accelerator: Accelerator | None = None) -> dict[str, Any]:
    """Moves the training state to the ranks ``quorum`` heals, over the process group
    :func:`rebuild_process_group` made: a source ``torch.save``s ``state`` (model and
    optimizer ``state_dict()``s, step, data position: anything ``torch.save`` takes) and sends
    it to every rank it heals, in rank order (its length, then its bytes); a healed rank
    returns what its source sent (load it with ``load_state_dict``); every other rank returns
    ``state`` as it is, at once. Tensors arrive on the CPU. A source that dies while sending
    makes the healed rank's ``recv`` raise: :func:`interrupted` says so, and the next quorum
    names another source."""
    accelerator = accelerator or Accelerator()
    rank = accelerator.process_index
    source = quorum.source_of(rank)
    if source is not None:
        length = torch.zeros(1, dtype=torch.int64)
        dist.recv(length, src=source)
        blob = torch.empty(int(length.item()), dtype=torch.uint8)
        dist.recv(blob, src=source)
        # The bytes come from a rank of this job (same credentials): trusted as its own.
        received = torch.load(io.BytesIO(blob.numpy().tobytes()), map_location="cpu", weights_only=False)
        accelerator.healed(quorum.epoch)
        return received
    healed = quorum.healed_by(rank)
    if not healed:
        return state
    buffer = io.BytesIO()
    torch.save(state, buffer)
    blob = torch.frombuffer(bytearray(buffer.getbuffer()), dtype=torch.uint8)
    for peer in healed:
        dist.send(torch.tensor([blob.numel()], dtype=torch.int64), dst=peer)
        dist.send(blob, dst=peer)
    return state


def recover(
    step: int | None,
    state: dict[str, Any],
    backend: str = "gloo",
    accelerator: Accelerator | None = None,
    timeout: datetime.timedelta | None = None,
) -> tuple[Quorum, dict[str, Any] | None]:
    """The whole in-place recovery of a torch training loop, after :func:`interrupted` said
    so or :meth:`muster.Accelerator.membership_changed` at a step boundary (and first thing in
    a replacement, with ``step=None``): closes the old process group (peers blocked on this
    rank fail instead of hanging), asks the quorum with the ``step`` this rank committed,
    rebuilds the process group (:func:`rebuild_process_group`) and heals (:func:`heal`, with
    ``state`` this rank's current state); a death during any of it starts it again. Returns the
    quorum and, on a healed rank, the state it received (None elsewhere): load it and continue
    from its step.

    The random generators (:func:`rng_state`) travel with the state: a healed rank continues
    with its source's, and every other rank rewinds its own to where :func:`begin_step` marked
    the interrupted step (with no mark for ``step``, the call is taken to be at a step boundary
    and the generators stay as they are). A loop that marks its steps and seeds every rank
    alike, as ``accelerate.utils.set_seed`` does by default, then redoes the step with the
    same draws as a run without the failure (dropout masks, augmentations, shuffles)."""
    accelerator = accelerator or Accelerator()
    rank = accelerator.process_index
    generators = _generators_at(step)
    sent = {**state, _RNG_KEY: generators}
    while True:
        abort_process_group()
        quorum = accelerator.quorum(step)
        try:
            rebuild_process_group(quorum, backend, accelerator, timeout)
            received = heal(quorum, sent, accelerator)
        except Exception as e:
            if interrupted(e, accelerator):
                continue
            raise
        if quorum.source_of(rank) is None:
            set_rng_state(generators)
            return quorum, None
        received = dict(received)
        set_rng_state(received.pop(_RNG_KEY))
        return quorum, received


def begin_step(step: int, accelerator: Accelerator | None = None) -> None:
    """Marks the start of training step ``step`` (call it before the step draws anything):
    remembers every random generator's state (:func:`rng_state`), which :func:`recover` rewinds
    to when this step is interrupted, and sends to the ranks it heals; and marks the step for
    the job's effective training time (:meth:`muster.Accelerator.begin_step`). 56 us a call
    with numpy imported (numpy's own state getter is 36 us of it), 12 us without."""
    global _STEP_START
    _STEP_START = (step, rng_state())
    (accelerator or Accelerator()).begin_step(step)


def _generators_at(step: int | None) -> dict[str, Any]:
    """The generators' state at the start of ``step``: :func:`begin_step`'s, if it marked that
    step, else the present state."""
    if _STEP_START is not None and step is not None and _STEP_START[0] == step:
        return _STEP_START[1]
    return rng_state()


def rng_state() -> dict[str, Any]:
    """The state of every random generator a torch training step draws from: Python's
    ``random``, numpy's global generator (if numpy is imported), torch's CPU generator and,
    once CUDA is initialised, every CUDA device's. :func:`set_rng_state` restores it."""
    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict[str, Any]) -> None:
    """Restores what :func:`rng_state` returned, here or in another process of the job."""
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


class Batches:
    """A ``torch.utils.data.DataLoader`` read by training step, for in-place recovery: ``batch(step)``
    is batch ``step % len(loader)`` of epoch ``step // len(loader)``. Put :meth:`state_dict` in
    the state :func:`recover` heals, and have a healed rank :meth:`load_state_dict` what it
    received: its next ``batch(step)`` rebuilds that epoch's iterator as the epoch began (the
    loader's generator as it was then, so the shuffle and the workers' ``base_seed`` are the
    same) and reads the batches before ``step`` again (the workers' random augmentations advance
    as they did), so the batch and everything drawn for it are the dead rank's. A rank that
    redoes a step gets the batch it already read (with ``num_workers=0`` torch's, Python's and
    numpy's generators put where that read left them, as the loader drew from them).

    Each epoch's iterator is made after the loader's sampler is told the epoch
    (``set_epoch(epoch)``, on the sampler and the batch sampler that have it), as a training loop
    does for torch's ``DistributedSampler``: a loader sharded with one (``num_replicas`` the
    world size, ``rank`` the process index) gives each rank its own shard, shuffled anew each
    epoch, and a replacement rebuilds the dead rank's shard of the epoch, not its healing
    source's.

    Call :func:`begin_step` before ``batch(step)``. Exact for ranks seeded alike (as for the
    generators); not for ``persistent_workers=True`` (a worker's generators then run on across
    epochs, which a replacement cannot rebuild without reading every epoch again) nor for a
    loader without a length (an ``IterableDataset``): both are refused. Re-reading costs the
    replacement the epoch's batches before ``step`` (in the loader's workers). Accelerate's
    prepared loaders synchronise generators with a collective at each epoch's start, which a
    lone replacement cannot join: wrap the plain ``DataLoader``."""

    def __init__(self, loader: torch.utils.data.DataLoader) -> None:
        if getattr(loader, "persistent_workers", False):
            raise ValueError(
                "muster.torch.Batches: persistent_workers=True keeps each worker's random generators "
                "running across epochs, which a replacement cannot rebuild; use persistent_workers=False"
            )
        try:
            per_epoch = len(loader)
        except TypeError:
            raise TypeError(
                "muster.torch.Batches needs a DataLoader with a length (a map-style dataset); "
                f"{type(loader.dataset).__name__} has none"
            ) from None
        if per_epoch == 0:
            raise ValueError("muster.torch.Batches: the DataLoader yields no batch")
        self._loader = loader
        self._per_epoch = per_epoch
        self._iterator: Iterator[Any] | None = None
        #: The epoch of the open iterator and the index of the batch it yields next.
        self._epoch = -1
        self._next = 0
        #: Epoch to the state of the loader's generator just before its iterator was made.
        self._starts: dict[int, torch.Tensor] = {}
        #: The last batch read: its step, the batch, and the generators after the read (None
        #: where the workers read it: the read drew nothing here).
        self._last: tuple[int, Any, dict[str, Any] | None] | None = None

    def __len__(self) -> int:
        """Batches per epoch."""
        return self._per_epoch

    def _generator(self) -> torch.Generator:
        """The generator the loader draws its shuffle and its workers' seed from."""
        return self._loader.generator if self._loader.generator is not None else torch.default_generator

    def batch(self, step: int) -> Any:
        """The batch of training step ``step`` (see the class)."""
        if self._last is not None and self._last[0] == step:
            _, batch, after = self._last
            if after is not None:
                set_rng_state(after)
            return batch
        epoch, index = divmod(step, self._per_epoch)
        if self._iterator is None or epoch != self._epoch or index < self._next:
            self._open(epoch, index)
        iterator = self._iterator
        assert iterator is not None
        while self._next < index:
            next(iterator)
            self._next += 1
        batch = next(iterator)
        self._next += 1
        self._last = (step, batch, rng_state() if self._loader.num_workers == 0 else None)
        return batch

    def _open(self, epoch: int, index: int) -> None:
        """Makes epoch ``epoch``'s iterator as it was made at the epoch's start, and reads its
        batches before ``index`` (leaving the process's generators as they were)."""
        self._iterator = None
        generator = self._generator()
        start = self._starts.get(epoch)
        if start is None:
            if index > 0:
                raise RuntimeError(
                    f"muster.torch.Batches: step {epoch * self._per_epoch + index} is batch {index} of "
                    f"epoch {epoch}, whose start this process did not see: load_state_dict() the "
                    "state of a rank that read it (what muster.torch.recover returns)"
                )
            start = generator.get_state()
        now = rng_state()
        generator.set_state(start)
        self._starts = {epoch: start}
        self._set_epoch(epoch)
        self._iterator = iter(self._loader)
        self._epoch, self._next = epoch, 0
        if index > 0:
            # The first read draws the shuffle's seed (a sampler draws when first read): from
            # the epoch's start, as then. The generators then go back to this step's.
            next(self._iterator)
            self._next = 1
            while self._next < index:
                next(self._iterator)
                self._next += 1
            set_rng_state(now)

    def _set_epoch(self, epoch: int) -> None:
        """Tells the loader's samplers that have ``set_epoch`` (torch's ``DistributedSampler``,
        Accelerate's seedable sampler) which epoch the next iterator reads, each once."""
        batch_sampler = getattr(self._loader, "batch_sampler", None)
        told: list[Any] = []
        for sampler in (self._loader.sampler, batch_sampler, getattr(batch_sampler, "sampler", None)):
            set_epoch = getattr(sampler, "set_epoch", None)
            if callable(set_epoch) and not any(sampler is t for t in told):
                set_epoch(epoch)
                told.append(sampler)

    def state_dict(self) -> dict[str, Any]:
        """Where the loader stands, for :meth:`load_state_dict` in another rank: the open
        epoch, its generator's state at its start, and the loader's own generator now (if it
        has one)."""
        own = self._loader.generator
        return {
            "epoch": self._epoch,
            "start": self._starts.get(self._epoch),
            "generator": own.get_state() if own is not None else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Takes another rank's :meth:`state_dict`: the next :meth:`batch` rebuilds its epoch."""
        self._iterator, self._last, self._epoch, self._next = None, None, -1, 0
        self._starts = {} if state["start"] is None else {int(state["epoch"]): state["start"]}
        if state["generator"] is not None and self._loader.generator is not None:
            self._loader.generator.set_state(state["generator"])


def _rendezvous(url: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT, **_: Any) -> Iterator:
    """``init_method="muster://"``: muster's store, rank and world size (the URL's rank and
    world size, if any, are ignored: the launcher's are the truth)."""
    accelerator = Accelerator()
    _guard_forks(accelerator)
    store = Store(accelerator, prefix=_fresh_prefix(accelerator), timeout=timeout)
    yield (store, accelerator.process_index, accelerator.num_processes)
    raise RuntimeError("muster:// rendezvous does not restart within a process; muster-agent restarts the workers")


dist.register_rendezvous_handler("muster", _rendezvous)

__all__ = [
    "DEFAULT_TIMEOUT",
    "Batches",
    "Store",
    "abort_process_group",
    "begin_step",
    "heal",
    "init_process_group",
    "interrupted",
    "rebuild_process_group",
    "recover",
    "rng_state",
    "set_rng_state",
]
