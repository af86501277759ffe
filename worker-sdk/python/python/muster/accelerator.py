"""``muster.Accelerator``: Accelerate's process model (``wait_for_everyone``,
``main_process_first``, ``is_main_process``, ...) over muster's agent and coordinator, so a
dead rank is an exception naming it instead of a hang. Every wait is the Rust SDK's, through
``muster._native``; this module only gives it Accelerate's names."""

from __future__ import annotations

import atexit
import builtins
import contextlib
import functools
import os
import pickle
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

from muster import _native
from muster.errors import MusterError

T = TypeVar("T")

#: The membership every rank agreed on after a rank died (:meth:`Accelerator.quorum`):
#: ``epoch``, ``world_size``, ``step`` (None when no rank had state), ``heal`` (``(rank,
#: source)`` pairs), ``members`` (``(rank, node, host)``), ``source_of(rank)``,
#: ``healed_by(rank)``.
Quorum = _native.Quorum

#: Bytes in an NCCL unique id (``ncclUniqueId``).
NCCL_UNIQUE_ID_BYTES: int = _native.NCCL_UNIQUE_ID_BYTES


#: ``file:line`` names by (path, line): a program has few call sites, and a barrier's name is
#: then a dictionary lookup (0.7 us) instead of a path split and a format (1.7 us).
_SITES: dict[tuple[str, int], str] = {}


def _call_site(depth: int) -> str:
    """``file:line`` of the caller ``depth`` frames up: what names a barrier, so that ranks
    arriving from different lines raise :class:`muster.errors.DivergedError`. The file's base
    name only, so that checkouts at different paths on different nodes agree."""
    frame = sys._getframe(depth + 1)
    where = (frame.f_code.co_filename, frame.f_lineno)
    site = _SITES.get(where)
    if site is None:
        site = _SITES[where] = f"{os.path.basename(where[0])}:{where[1]}"
    return site


def _as_bytes(value: str | bytes | bytearray | memoryview) -> bytes:
    if isinstance(value, str):
        return value.encode()
    return bytes(value)


#: Set once this process marked a step itself (:meth:`Accelerator.begin_step`): the agent's
#: start-up hook, which marks rank 0's optimizer steps for scripts that mark none, then stops.
STEPS_MARKED = False

class KeyValueStore:
    """The job's key-value store (TCPStore's operations), scoped to the job at the coordinator:
    authenticated with the worker's job token and, with coordinators on etcd, surviving a
    failover. Values are bytes; ``str`` values are stored as UTF-8."""

    def __init__(self, native: _native.Native) -> None:
        self._native = native

    def set(self, key: str, value: str | bytes) -> None:
        """Sets ``key`` to ``value``."""
        self._native.kv_set(key, _as_bytes(value))

    def get(self, key: str, timeout: float | None = None) -> bytes | None:
        """The value of ``key``: None when unset, or with ``timeout`` (seconds) waits for it to
        be set and raises :class:`muster.errors.WaitTimeoutError` when it is not."""
        if timeout is None:
            return self._native.kv_get(key)
        return self._native.kv_wait(key, float(timeout))

    def get_many(self, keys: list[str], timeout: float) -> list[bytes]:
        """The values of ``keys``, in their order, waiting up to ``timeout`` seconds for every
        one to be set (:class:`muster.errors.WaitTimeoutError` naming a key that was not). The
        reads go out together: about one round trip in all, not one per key."""
        return self._native.kv_wait_many(list(keys), float(timeout))

    def add(self, key: str, delta: int = 1) -> int:
        """Adds ``delta`` to the integer at ``key`` (0 when unset), atomically at the
        coordinator; returns the new value."""
        return self._native.kv_add(key, int(delta))

    def compare_set(
        self, key: str, expected: str | bytes | None, desired: str | bytes
    ) -> tuple[bool, bytes | None]:
        """Sets ``key`` to ``desired`` if its value is ``expected`` (None: unset), atomically;
        returns ``(swapped, current value)``."""
        exp = None if expected is None else _as_bytes(expected)
        return self._native.kv_compare_set(key, exp, _as_bytes(desired))

    def delete(self, key: str) -> bool:
        """Deletes ``key``; whether it existed."""
        return self._native.kv_delete(key)

    def items(self, prefix: str = "") -> list[tuple[str, bytes]]:
        """Every ``(key, value)`` whose key starts with ``prefix``."""
        return [(k, v) for k, v in self._native.kv_list(prefix)]


class Accelerator:
    """This process's place in a muster job, with Accelerate's names.

    Made from the launcher's environment (``muster-agent launch``); run without a launcher it is
    a world of one process, as Accelerate's is. Waits release the GIL, can be interrupted with
    Ctrl-C, work from any thread, and raise a :class:`muster.errors.MusterError` naming the
    cause: when a rank dies, every rank waiting on it raises
    :class:`muster.errors.RankFailedError` with its ``rank``, ``node``, ``host`` and ``cause``.
    A process forked from this one (a DataLoader worker) cannot wait and says so.
    """

    def __init__(self) -> None:
        # One connection per process, as Accelerate's state is one per process: every
        # Accelerator() of a process (and muster.torch) shares it.
        self._native = _process_native()
        self._info: dict[str, Any] = self._native.info()

    # -- the process's place -------------------------------------------------------------
    @property
    def process_index(self) -> int:
        """Global rank, ``0 .. num_processes``."""
        return self._info["rank"]

    @property
    def local_process_index(self) -> int:
        """Rank among this node's processes."""
        return self._info["local_rank"]

    @property
    def num_processes(self) -> int:
        """Processes in the job."""
        return self._info["world_size"]

    @property
    def local_num_processes(self) -> int:
        """Processes on this node."""
        return self._info["local_world_size"]

    @property
    def num_nodes(self) -> int:
        """Nodes (machines) in the job."""
        return self._info["num_nodes"]

    @property
    def node_rank(self) -> int:
        """This node's rank, ``0 .. num_nodes``."""
        return self._info["node_rank"]

    @property
    def is_main_process(self) -> bool:
        """Whether this is global rank 0."""
        return self.process_index == 0

    @property
    def is_local_main_process(self) -> bool:
        """Whether this is rank 0 of its node."""
        return self.local_process_index == 0

    @property
    def is_last_process(self) -> bool:
        """Whether this is the last global rank."""
        return self.process_index == self.num_processes - 1

    @property
    def generation(self) -> int:
        """The restart round this process belongs to, from 1."""
        return self._info["generation"]

    @property
    def restart_count(self) -> int:
        """Restarts of the job so far (0 in the first generation)."""
        return self._info["restart_count"]

    @property
    def job_id(self) -> str:
        """The job's id."""
        return self._info["job_id"]

    @property
    def host(self) -> str:
        """The host this node advertises."""
        return self._info["host"]

    @property
    def is_distributed(self) -> bool:
        """Whether a launcher started this process (False: a world of one)."""
        return self._info["distributed"]

    # -- in-place recovery ---------------------------------------------------------------
    @property
    def recovery(self) -> str:
        """The job's recovery mode: ``"restart"`` (a death restarts every worker) or
        ``"in-place"`` (only the dead worker is respawned; the others recover through
        :meth:`quorum`)."""
        return self._native.recovery()

    @property
    def is_replacement(self) -> bool:
        """Whether this process replaces a rank that died in place: it calls
        ``quorum(None)`` before anything else and is healed from a live rank."""
        return self._native.is_replacement()

    @property
    def epoch(self) -> int:
        """The membership epoch of the last quorum this process took part in (0 before any)."""
        return self._native.epoch()

    def membership_changed(self) -> bool:
        """The per-step check of in-place recovery: whether a rank died since this process's
        last quorum (or it is a replacement that has not had one). No coordinator call: the
        coordinator pushes changes and this reads a local epoch, so call it every step."""
        return self._native.membership_changed()

    def begin_step(self, step: int) -> None:
        """Marks the start of training step ``step``, for the job's effective training time
        (ETTR, in ``muster-agent describe`` and the metrics): rank 0's markers go to the
        coordinator (no wait); a step counts when the next marker names a higher step than any
        before, and a step begun again after a recovery, or redone after a restart, is time
        lost. ``muster.torch.begin_step`` calls it. The agent's own markers for scripts that
        mark no steps (its start-up hook's, after each optimizer step) stop at the first call:
        the hook reads :data:`STEPS_MARKED`."""
        global STEPS_MARKED
        STEPS_MARKED = True
        self._native.begin_step(step)

    def healed(self, epoch: int) -> None:
        """Says that this rank finished healing for the quorum of membership epoch ``epoch``
        (it received its source's state), for the recovery's timeline in ``muster-agent
        describe``. ``muster.torch.heal`` and :meth:`muster.Communicator.heal_bytes` call it;
        a loop that heals by other means calls it once its state is loaded. No wait."""
        self._native.healed(epoch)

    def quorum(self, step: int | None) -> Quorum:
        """Agrees on the new membership with every other rank after a death and returns it
        (blocks until every rank of the job is alive and has asked). ``step``: the training
        steps this rank has committed (None in a replacement that has no state yet); the
        quorum's ``step`` is the highest any rank committed, and every rank behind it is
        healed from one that has it. Then rebuild communicators (:meth:`Communicator.reconfigure`,
        :func:`muster.torch.rebuild_process_group`) and heal. Raises a
        :class:`muster.errors.MusterError` when the job does not recover in place or the
        generation ended."""
        return self._native.quorum(None if step is None else int(step))

    def __repr__(self) -> str:
        return (
            f"Accelerator(process_index={self.process_index}, num_processes={self.num_processes}, "
            f"node_rank={self.node_rank}, num_nodes={self.num_nodes}, job_id={self.job_id!r}, "
            f"generation={self.generation})"
        )

    # -- synchronisation -----------------------------------------------------------------
    def wait_for_everyone(self, name: str | None = None, timeout: float | None = None) -> None:
        """Blocks until every process reaches this call. The barrier is named after the
        caller's ``file:line`` (or ``name``), so ranks arriving from different lines raise
        :class:`muster.errors.DivergedError` naming both. With ``timeout`` (seconds) it raises
        :class:`muster.errors.WaitTimeoutError` listing who had not arrived."""
        self._native.barrier(name or _call_site(1), False, timeout)

    def wait_for_local(self, name: str | None = None, timeout: float | None = None) -> None:
        """Blocks until every process of this node reaches this call."""
        self._native.barrier(name or _call_site(1), True, timeout)

    @contextlib.contextmanager
    def main_process_first(self) -> Iterator[None]:
        """``with accelerator.main_process_first():`` runs the block on the main process
        first and on the others once it is done (to load what the main process cached). If
        the main process dies in the block, the others raise instead of running it."""
        site = _call_site(2)
        if self.is_main_process:
            yield
            self._native.barrier(site, False, None)
        else:
            self._native.barrier(site, False, None)
            yield

    @contextlib.contextmanager
    def local_main_process_first(self) -> Iterator[None]:
        """Like :meth:`main_process_first` per node: each node's local main process first."""
        site = _call_site(2)
        if self.is_local_main_process:
            yield
            self._native.barrier(site, True, None)
        else:
            self._native.barrier(site, True, None)
            yield

    def main_process_first_share(self, fn: Callable[[], T]) -> T:
        """Rank 0 calls ``fn()`` and every other rank receives its result (pickled) without
        calling it. The value belongs to this generation: after a restart every rank waits for
        the new rank 0's value, never a stale one."""
        return self._share(fn, _call_site(1), node=False, publisher=self.is_main_process)

    def local_main_process_first_share(self, fn: Callable[[], T]) -> T:
        """Like :meth:`main_process_first_share` per node: each node's local main process
        computes, the processes of its node receive."""
        return self._share(fn, _call_site(1), node=True, publisher=self.is_local_main_process)

    def _share(self, fn: Callable[[], T], site: str, node: bool, publisher: bool) -> T:
        if publisher:
            value = fn()
            if self.num_processes > 1:
                self._native.share_publish(site, pickle.dumps(value), node)
            return value
        return pickle.loads(self._native.share_fetch(site, node))

    # -- running on some processes only --------------------------------------------------
    def on_main_process(self, fn: Callable[..., T]) -> Callable[..., T | None]:
        """Decorator: ``fn`` runs on the main process only (None elsewhere)."""
        return self._on(fn, lambda: self.is_main_process)

    def on_local_main_process(self, fn: Callable[..., T]) -> Callable[..., T | None]:
        """Decorator: ``fn`` runs on each node's local main process only."""
        return self._on(fn, lambda: self.is_local_main_process)

    def on_last_process(self, fn: Callable[..., T]) -> Callable[..., T | None]:
        """Decorator: ``fn`` runs on the last process only."""
        return self._on(fn, lambda: self.is_last_process)

    def on_process(self, process_index: int) -> Callable[[Callable[..., T]], Callable[..., T | None]]:
        """Decorator factory: the function runs on global rank ``process_index`` only."""
        return lambda fn: self._on(fn, lambda: self.process_index == process_index)

    @staticmethod
    def _on(fn: Callable[..., T], when: Callable[[], bool]) -> Callable[..., T | None]:
        @functools.wraps(fn)
        def wrapper(*args: Any, **kwargs: Any) -> T | None:
            return fn(*args, **kwargs) if when() else None

        return wrapper

    def print(self, *args: Any, **kwargs: Any) -> None:
        """``print`` once per machine (on the local main process), as Accelerate's does."""
        if self.is_local_main_process:
            builtins.print(*args, **kwargs)

    # -- the job's store and NCCL ids -----------------------------------------------------
    @property
    def store(self) -> KeyValueStore:
        """The job's key-value store."""
        return KeyValueStore(self._native)

    def publish_nccl_unique_id(self, communicator: str, unique_id: bytes) -> None:
        """Publishes the NCCL unique id (``NCCL_UNIQUE_ID_BYTES`` bytes) of ``communicator``
        for this generation, from its root rank."""
        self._native.publish_unique_id(communicator, bytes(unique_id))

    def fetch_nccl_unique_id(self, communicator: str) -> bytes:
        """Waits for the NCCL unique id of ``communicator`` from its root rank."""
        return self._native.fetch_unique_id(communicator)

    def end_training(self) -> None:
        """Leaves the job cleanly: ranks still waiting on this one raise
        :class:`muster.errors.RankLeftError` instead of waiting. Done at exit anyway."""
        self._native.close()


_PROCESS_NATIVE: tuple[int, _native.Native] | None = None
#: The connection :func:`connect_early` is making: (pid, thread, its outcome).
_CONNECTING: tuple[int, threading.Thread, dict[str, Any]] | None = None
_NATIVE_LOCK = threading.Lock()


def _spawned_by_agent() -> bool:
    """Whether this process is a worker that a muster agent started itself: its parent is the
    agent (``MUSTER_AGENT_PID``), not a wrapper script, a tool that script runs first, or the
    worker's own children (``multiprocessing`` with spawn re-imports muster there)."""
    if os.environ.get("MUSTER_EARLY_CONNECT", "1") == "0":
        return False
    agent = os.environ.get("MUSTER_AGENT_PID", "")
    return bool(os.environ.get("MUSTER_AGENT_SOCKET")) and agent == str(os.getppid())


def connect_early() -> None:
    """In a worker its agent started, begins this process's connection (the registration with
    the agent and the coordinator) on a thread, so that it is made while the script goes on
    importing and building its model; the first :class:`Accelerator` (or
    ``muster.torch.init_process_group``) then finds it made. Run once, by ``import muster``.
    Elsewhere, or with ``MUSTER_EARLY_CONNECT=0``, the connection is made on first use.
    A failure is raised by that first use, as it would have been; a connection made and never
    used leaves the job cleanly at exit."""
    global _CONNECTING
    if not _spawned_by_agent():
        return
    outcome: dict[str, Any] = {}

    def connect() -> None:
        # The thread holds no lock: _process_native joins it under _NATIVE_LOCK.
        try:
            outcome["native"] = _native.Native()
        except BaseException as e:  # noqa: BLE001 (raised again by the first use)
            outcome["error"] = e

    # Not a daemon: the interpreter waits for the connection at exit instead of killing the
    # thread inside it (a connection made and unused still leaves the job cleanly, below).
    thread = threading.Thread(target=connect, name="muster-connect")
    with _NATIVE_LOCK:
        if _PROCESS_NATIVE is not None or _CONNECTING is not None:
            return
        _CONNECTING = (os.getpid(), thread, outcome)
    thread.start()
    atexit.register(_close_early, outcome)


def _close_early(outcome: dict[str, Any]) -> None:
    """At exit (after the interpreter has joined the connecting thread): the rank leaves the
    job cleanly, so ranks still waiting hear "left", not "lost"."""
    native = outcome.get("native")
    if native is not None:
        native.close()


def _process_native() -> _native.Native:
    """This process's connection: the one :func:`connect_early` began, or made now (a forked
    child makes its own only if it asks for a new one: the parent's refuses it with a clear
    error)."""
    global _PROCESS_NATIVE, _CONNECTING
    if _PROCESS_NATIVE is not None:
        return _PROCESS_NATIVE[1]
    with _NATIVE_LOCK:
        if _PROCESS_NATIVE is not None:
            return _PROCESS_NATIVE[1]
        if _CONNECTING is not None and _CONNECTING[0] != os.getpid():
            # Forked while the parent was connecting: the thread did not come along, and the
            # rank's connection is the parent's.
            raise MusterError(
                f"this process was forked from muster worker {_CONNECTING[0]}, whose connection "
                f"to the agent cannot be used here (a DataLoader worker, multiprocessing with "
                f"fork): use muster from the training process only"
            )
        pending, _CONNECTING = _CONNECTING, None
        if pending is not None:
            pending[1].join()
            if "error" in pending[2]:
                raise pending[2]["error"]
            native = pending[2]["native"]
        else:
            native = _native.Native()
            # Leave the job cleanly at exit, so ranks still waiting hear "left", not "lost".
            atexit.register(native.close)
        _PROCESS_NATIVE = (os.getpid(), native)
        return native


__all__ = ["NCCL_UNIQUE_ID_BYTES", "Accelerator", "KeyValueStore", "Quorum"]
