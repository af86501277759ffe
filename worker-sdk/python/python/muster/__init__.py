"""muster for Python: Accelerate's process model (``Accelerator``, ``wait_for_everyone``,
``main_process_first``, ``main_process_first_share``) on muster's agent and coordinator, where a
dead rank is an exception naming its rank, node, host and cause in every waiting process, never
a hang.

    import muster

    accelerator = muster.Accelerator()
    with accelerator.main_process_first():
        dataset = load_or_build_cache()
    accelerator.wait_for_everyone()
"""

from muster.accelerator import NCCL_UNIQUE_ID_BYTES, Accelerator, KeyValueStore, Quorum
from muster.accelerator import connect_early as _connect_early
from muster.comm import Communicator
from muster.errors import (
    ConfigError,
    CoordinatorConnectionError,
    DivergedError,
    JobCancelledError,
    MembershipChangedError,
    MusterError,
    NotFoundError,
    RankFailedError,
    RankLeftError,
    RecoverableError,
    StaleGenerationError,
    UnauthorizedError,
    WaitTimeoutError,
)

__all__ = [
    "NCCL_UNIQUE_ID_BYTES",
    "Accelerator",
    "Communicator",
    "ConfigError",
    "CoordinatorConnectionError",
    "DivergedError",
    "JobCancelledError",
    "KeyValueStore",
    "MembershipChangedError",
    "MusterError",
    "NotFoundError",
    "Quorum",
    "RankFailedError",
    "RankLeftError",
    "RecoverableError",
    "StaleGenerationError",
    "UnauthorizedError",
    "WaitTimeoutError",
]

# Under an agent, the worker's connection is made while the script goes on importing.
_connect_early()
