"""Times ``init_process_group("gloo")`` (each rank's wall time of the call, then a barrier) for
``target/release/python`` and ``target/release/store``: ``--how muster`` through
``muster.torch`` (the job's store at the coordinator), ``--how env`` through ``env://`` (rank
0's TCPStore at MASTER_PORT, or the agent's store when the launcher sets
``TORCHELASTIC_USE_AGENT_STORE=True``).

Rank 0 prints ``init_ms=`` (its own call) and ``slowest_ms=`` (the longest call of any rank).
With ``--start-dir``, every rank waits on a file barrier before the call, so that the figures
time the store and not the seconds by which the interpreters' ``import torch`` finish apart.
Modules are imported before the clock starts (``muster.torch`` as ``torch.distributed``): the
call is timed, from loaded modules to a ready process group. ``import muster`` begins the
worker's connection to its agent (the Accelerator's registration) on a thread, so the call
finds it made, as a training script's would after building its model; with
``MUSTER_EARLY_CONNECT=0`` the call makes it, as ``env://`` makes its TCPStore client."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist


def start_together(start_dir: Path, rank: int, world: int) -> None:
    """Returns once every rank has arrived, without the store under test."""
    start_dir.mkdir(parents=True, exist_ok=True)
    (start_dir / f"ready.{rank}").touch()
    while sum(1 for _ in start_dir.glob("ready.*")) < world:
        time.sleep(0.002)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=["muster", "env"], required=True)
    parser.add_argument("--start-dir", type=Path)
    args = parser.parse_args()
    if args.how == "muster":
        # Loaded before the clock starts, as torch.distributed is for env://: the figure is the
        # call's, from loaded modules to a ready process group.
        import muster.torch
    if args.start_dir is not None:
        start_together(args.start_dir, int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]))
    start = time.perf_counter()
    if args.how == "muster":
        muster.torch.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method="env://")
    took = time.perf_counter() - start
    dist.barrier()
    took_all = [torch.zeros(1, dtype=torch.float64) for _ in range(dist.get_world_size())]
    dist.all_gather(took_all, torch.tensor([took], dtype=torch.float64))
    if dist.get_rank() == 0:
        slowest = max(t.item() for t in took_all)
        print(
            f"init_ms={took * 1e3:.1f} slowest_ms={slowest * 1e3:.1f} "
            f"world={dist.get_world_size()} pid={os.getpid()}",
            flush=True,
        )
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
