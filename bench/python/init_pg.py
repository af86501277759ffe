"""Times ``init_process_group("gloo")`` (rank 0's wall time of the call, then a barrier) for
``target/release/python``: ``--how muster`` through ``muster.torch`` (the job's store at the
coordinator), ``--how env`` through ``env://`` (a TCPStore opened by rank 0 at MASTER_PORT)."""

from __future__ import annotations

import argparse
import os
import time

import torch.distributed as dist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=["muster", "env"], required=True)
    args = parser.parse_args()
    start = time.perf_counter()
    if args.how == "muster":
        import muster.torch

        muster.torch.init_process_group("gloo")
    else:
        dist.init_process_group("gloo", init_method="env://")
    took = time.perf_counter() - start
    dist.barrier()
    if dist.get_rank() == 0:
        print(f"init_ms={took * 1e3:.1f} world={dist.get_world_size()} pid={os.getpid()}", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
