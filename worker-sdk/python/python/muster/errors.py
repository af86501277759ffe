"""The exceptions muster raises: every one is a :class:`MusterError`, and the message names the
rank, node, host, barrier or coordinator involved, so printing it is enough to know where to
look."""

from __future__ import annotations


class MusterError(Exception):
    """Base class of every error muster raises.

    ``recoverable`` says whether, in a job launched with ``--recovery in-place``, the training
    loop can discard the step it was in and recover without restarting the process (ask
    :meth:`muster.Accelerator.quorum`, rebuild, heal): True for every
    :class:`MembershipChangedError`, False otherwise."""

    recoverable: bool = False


class RankFailedError(MusterError):
    """A rank of this generation failed (crashed, was killed, lost its connection or stopped
    heartbeating) while this process waited on it, so the wait can never complete.

    Attributes: ``rank`` (global rank), ``node`` (its node rank), ``host`` (its host) and
    ``cause`` (why, as the coordinator or the agent saw it).
    """

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        node: int | None = None,
        host: str | None = None,
        cause: str | None = None,
    ) -> None:
        super().__init__(message)
        self.rank = rank
        self.node = node
        self.host = host
        self.cause = cause


class RecoverableError(MusterError):
    """Base class of the errors a training loop recovers from in place (``recoverable`` is
    True): the step is discarded, every rank asks :meth:`muster.Accelerator.quorum`, rebuilds
    its communicator or process group and heals. Only raised in jobs launched with
    ``--recovery in-place``."""

    recoverable = True


class MembershipChangedError(RecoverableError, RankFailedError):
    """A rank died and the job recovers in place: the collective or wait in progress was
    abandoned (the coordinator's push or the broken connection to the dead peer ended it), and
    the step must be discarded. Same attributes as :class:`RankFailedError`, plus ``epoch``:
    the membership epoch the death opened (None when the broken connection was seen before the
    coordinator's push)."""

    def __init__(
        self,
        message: str,
        rank: int | None = None,
        node: int | None = None,
        host: str | None = None,
        cause: str | None = None,
        epoch: int | None = None,
    ) -> None:
        super().__init__(message, rank, node, host, cause)
        self.epoch = epoch


class RankLeftError(RankFailedError):
    """A rank this wait needs already left the job cleanly (it finished), so the wait can never
    complete. Same attributes as :class:`RankFailedError`."""


class DivergedError(MusterError):
    """Ranks met at the same barrier under different names: they run different code paths. The
    message names both call sites."""


class WaitTimeoutError(MusterError, TimeoutError):
    """A wait with a deadline ran out. ``missing`` lists ``(rank, node, host)`` of the ranks
    that had not arrived, when the coordinator says."""

    def __init__(self, message: str, missing: list[tuple[int, int, str]] | None = None) -> None:
        super().__init__(message)
        self.missing = missing or []


class StaleGenerationError(MusterError):
    """This process belongs to a generation a newer rendezvous round replaced; it should exit so
    that its agent starts the new generation's workers."""


class JobCancelledError(MusterError):
    """An operator cancelled the job; the message says who and why."""


class CoordinatorConnectionError(MusterError, ConnectionError):
    """The coordinator (or the agent's relay) could not be reached, or the connection broke."""


class UnauthorizedError(MusterError, PermissionError):
    """The coordinator refused this process's credentials (``MUSTER_TOKEN``)."""


class ConfigError(MusterError, ValueError):
    """The ``MUSTER_*`` environment is malformed; the message names the variable."""


class NotFoundError(MusterError, LookupError):
    """Something a call needs does not exist and never will (so failing beats hanging)."""


__all__ = [
    "ConfigError",
    "CoordinatorConnectionError",
    "DivergedError",
    "JobCancelledError",
    "MembershipChangedError",
    "MusterError",
    "NotFoundError",
    "RankFailedError",
    "RankLeftError",
    "RecoverableError",
    "StaleGenerationError",
    "UnauthorizedError",
    "WaitTimeoutError",
]
