"""PyTorch on muster: :class:`Store`, a ``torch.distributed.Store`` backed by the job's
key-value store at the coordinator (authenticated with the worker's job token, scoped to the
generation, surviving a coordinator failover with etcd); :func:`init_process_group`, which takes
rank and world size from muster and uses that store, so no TCPStore opens on rank 0 and no
``MASTER_PORT`` is needed; and the ``muster://`` rendezvous handler, registered when this module
is imported, so ``torch.distributed.init_process_group("gloo", init_method="muster://")`` works.

Importing this module imports torch; ``import muster`` alone does not.
"""

from __future__ import annotations

import datetime
import time
from collections.abc import Iterator
from typing import Any

import torch.distributed as dist

from muster.accelerator import Accelerator
from muster.errors import NotFoundError, WaitTimeoutError

#: Every Store made in this process (see Store.__init__).
_LIVE_STORES: list[Store] = []

#: torch's default store timeout.
DEFAULT_TIMEOUT = datetime.timedelta(seconds=300)


class Store(dist.Store):
    """A ``torch.distributed.Store`` over the job's key-value store. Keys live under
    ``torch/g<generation>/`` (plus ``prefix``), so a restarted generation never reads the keys of
    the one before it. Blocking reads wait at the coordinator and raise torch's timeout error
    (``torch.distributed.DistStoreError``) naming the key when the store's timeout runs out."""

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
        # torch holds a Python store by its C++ half only: once the Python object is collected,
        # torch's calls into it fail ("Not implemented"). Stores live as long as the process.
        _LIVE_STORES.append(self)

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _wait_one(self, key: str, timeout: datetime.timedelta | None) -> bytes:
        seconds = (timeout or self.timeout).total_seconds()
        try:
            return self._kv.get(self._key(key), timeout=seconds)
        except (WaitTimeoutError, NotFoundError) as e:
            raise dist.DistStoreError(
                f"muster store: key '{key}' was not set within {seconds:g} s "
                f"(job {self._accelerator.job_id}, generation {self._accelerator.generation}): {e}"
            ) from e

    def set(self, key: str, value: Any) -> None:
        self._kv.set(self._key(key), _bytes(value))

    def get(self, key: str) -> bytes:
        return self._wait_one(key, None)

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
        deadline = time.monotonic() + (timeout or self.timeout).total_seconds()
        for key in keys:
            left = max(deadline - time.monotonic(), 0.0)
            self._wait_one(key, datetime.timedelta(seconds=left))


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
    store = Store(accelerator, timeout=timeout or DEFAULT_TIMEOUT)
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


def _rendezvous(url: str, timeout: datetime.timedelta = DEFAULT_TIMEOUT, **_: Any) -> Iterator:
    """``init_method="muster://"``: muster's store, rank and world size (the URL's rank and
    world size, if any, are ignored: the launcher's are the truth)."""
    accelerator = Accelerator()
    yield (Store(accelerator, timeout=timeout), accelerator.process_index, accelerator.num_processes)
    raise RuntimeError("muster:// rendezvous does not restart within a process; muster-agent restarts the workers")


dist.register_rendezvous_handler("muster", _rendezvous)

__all__ = ["DEFAULT_TIMEOUT", "Store", "init_process_group"]
