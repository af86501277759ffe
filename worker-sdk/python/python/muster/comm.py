"""Collectives on CPU buffers: the Rust SDK's CPU communicator (shared memory between the
processes of a machine, sockets between machines) over numpy arrays, CPU torch tensors and
anything with the buffer protocol, in place and without copies.

    comm = muster.Communicator()          # every rank makes one
    comm.all_reduce(tensor)               # sum, in place
    comm.broadcast(array, root=0)
    comm.all_gather(out, inp)             # out holds world_size * len(inp)
    comm.reduce_scatter(out, inp, "avg")  # inp holds world_size * len(out)

A dead peer makes every rank in the collective raise :class:`muster.errors.RankFailedError`
naming it (in a job launched with ``--recovery in-place``, its subclass
:class:`muster.errors.MembershipChangedError`: discard the step, ask
:meth:`muster.Accelerator.quorum`, then :meth:`Communicator.reconfigure` and
:meth:`Communicator.heal_bytes`). Neither numpy nor torch is imported by this module.
"""

from __future__ import annotations

import ctypes
from typing import Any

from muster import _native
from muster.accelerator import Accelerator, Quorum

# numpy's type strings and torch's dtype names, to the SDK's element types.
_NUMPY = {"f4": "f32", "f8": "f64", "f2": "f16", "i4": "i32", "i8": "i64", "u1": "u8"}
_TORCH = {
    "torch.float32": "f32",
    "torch.float64": "f64",
    "torch.float16": "f16",
    "torch.bfloat16": "bf16",
    "torch.int32": "i32",
    "torch.int64": "i64",
    "torch.uint8": "u8",
}
# The buffer protocol's struct formats (native byte order), with their item sizes.
_FORMATS = {("f", 4): "f32", ("d", 8): "f64", ("e", 2): "f16", ("B", 1): "u8"}
_FORMATS.update({(c, 4): "i32" for c in "il"})
_FORMATS.update({(c, 8): "i64" for c in "lq"})


def _buffer(obj: Any, what: str) -> tuple[int, int, str]:
    """``(address, bytes, element type)`` of a writable, C-contiguous CPU buffer, or a
    ``ValueError``/``TypeError`` saying what is wrong with it."""
    if type(obj).__module__.startswith("torch"):
        if obj.device.type != "cpu":
            raise ValueError(
                f"{what}: a {obj.device.type} tensor; muster.Communicator moves CPU buffers "
                "(use torch.distributed with nccl for GPU tensors)"
            )
        if not obj.is_contiguous():
            raise ValueError(f"{what}: the tensor is not contiguous (call .contiguous() first)")
        kind = _TORCH.get(str(obj.dtype))
        if kind is None:
            raise TypeError(f"{what}: {obj.dtype} cannot be moved by muster")
        return obj.data_ptr(), obj.numel() * obj.element_size(), kind
    interface = getattr(obj, "__array_interface__", None)
    if interface is not None:
        address, readonly = interface["data"]
        if readonly:
            raise ValueError(f"{what}: the array is read-only")
        if interface.get("strides") is not None and not obj.flags["C_CONTIGUOUS"]:
            raise ValueError(f"{what}: the array is not C-contiguous (np.ascontiguousarray)")
        typestr = interface["typestr"]
        if typestr[0] == ">":
            raise TypeError(f"{what}: big-endian {typestr} cannot be moved by muster")
        kind = _NUMPY.get(typestr[1:])
        if kind is None:
            raise TypeError(f"{what}: element type {typestr} cannot be moved by muster")
        return address, obj.nbytes, kind
    view = memoryview(obj)
    if view.readonly:
        raise ValueError(f"{what}: the buffer is read-only")
    if not view.c_contiguous:
        raise ValueError(f"{what}: the buffer is not C-contiguous")
    kind = _FORMATS.get((view.format.lstrip("@="), view.itemsize))
    if kind is None:
        raise TypeError(f"{what}: buffer format '{view.format}' cannot be moved by muster")
    if view.nbytes == 0:
        return 0, 0, kind
    return ctypes.addressof(ctypes.c_char.from_buffer(view)), view.nbytes, kind


class Communicator:
    """The SDK's CPU communicator for every rank of the job. Making one is a collective call:
    every rank makes one, in the same order. Reductions: ``"sum"``, ``"avg"``, ``"min"``,
    ``"max"``, ``"product"``."""

    def __init__(self, accelerator: Accelerator | None = None) -> None:
        accelerator = accelerator or Accelerator()
        self._accelerator = accelerator
        self._comm = _native.Comm(accelerator._native)
        self.rank, self.world_size = self._comm.rank()

    def all_reduce(self, buffer: Any, op: str = "sum") -> Any:
        """In place: every rank ends with the reduction of every rank's ``buffer``. Returns it."""
        address, size, kind = _buffer(buffer, "all_reduce")
        self._comm.all_reduce(address, size, kind, op)
        return buffer

    def broadcast(self, buffer: Any, root: int = 0) -> Any:
        """In place: every rank ends with rank ``root``'s ``buffer``. Returns it."""
        address, size, kind = _buffer(buffer, "broadcast")
        self._comm.broadcast(address, size, kind, int(root))
        return buffer

    def all_gather(self, output: Any, input: Any) -> Any:
        """``output`` (``world_size`` times ``input``'s length) gets every rank's ``input`` in
        rank order. Returns ``output``."""
        out = _buffer(output, "all_gather output")
        inp = _buffer(input, "all_gather input")
        if out[2] != inp[2]:
            raise TypeError(f"all_gather: output holds {out[2]}, input {inp[2]}")
        self._comm.all_gather(inp[:2], out[:2], out[2])
        return output

    def reduce_scatter(self, output: Any, input: Any, op: str = "sum") -> Any:
        """Rank r's ``output`` gets the reduction of every rank's block r of ``input``
        (``world_size`` blocks of ``output``'s length). Returns ``output``."""
        out = _buffer(output, "reduce_scatter output")
        inp = _buffer(input, "reduce_scatter input")
        if out[2] != inp[2]:
            raise TypeError(f"reduce_scatter: output holds {out[2]}, input {inp[2]}")
        self._comm.reduce_scatter(inp[:2], out[:2], out[2], op)
        return output

    def barrier(self) -> None:
        """Every rank reaches this call before any leaves it."""
        self._comm.barrier()

    @property
    def epoch(self) -> int:
        """The membership epoch the communicator is built for (0 until an in-place recovery)."""
        return self._comm.epoch()

    def reconfigure(self, quorum: Quorum) -> None:
        """Rebuilds the communicator for ``quorum``'s membership (in-place recovery): every rank
        calls it with the quorum :meth:`muster.Accelerator.quorum` returned. The old
        connections are closed first; a quorum of the epoch it already has changes nothing."""
        self._comm.reconfigure(self._accelerator._native, quorum)

    def heal_bytes(self, quorum: Quorum, payload: bytes | None = None) -> bytes | None:
        """Moves state from healthy ranks to the ranks ``quorum`` heals, after
        :meth:`reconfigure`: a source rank sends ``payload`` (its state, serialised: pickle,
        ``torch.save``, anything) to every rank it heals and gets None; a healed rank gets its
        source's bytes; every other rank gets None at once. Every rank may pass its payload
        (only the sources' are sent), or pass it only where ``quorum.healed_by(rank)`` is
        non-empty."""
        data = None if payload is None else bytes(payload)
        return self._comm.heal_bytes(quorum, data)


__all__ = ["Communicator"]
