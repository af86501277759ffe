"""The Python SDK's benchmark worker, run under ``muster-agent launch`` by
````target/release/python````: ``wait_for_everyone`` latency (p50/p99 over ``--iters`` after
``--warmup``) and, with ``--allreduce-mib``, the median time of an in-place all_reduce of a
float32 CPU torch tensor of that size. Rank 0 prints one ``key=value`` line per figure."""

from __future__ import annotations

import argparse
import statistics
import time

import muster


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--warmup", type=int, default=50)
    parser.add_argument("--allreduce-mib", type=int, default=0)
    parser.add_argument("--allreduce-iters", type=int, default=8)
    args = parser.parse_args()
    accelerator = muster.Accelerator()
    for _ in range(args.warmup):
        accelerator.wait_for_everyone("warmup")
    times = []
    for _ in range(args.iters):
        start = time.perf_counter_ns()
        accelerator.wait_for_everyone("timed")
        times.append((time.perf_counter_ns() - start) / 1e3)
    times.sort()
    if accelerator.is_main_process:
        p99 = times[min(len(times) - 1, int(len(times) * 0.99))]
        print(f"barrier_p50_us={statistics.median(times):.1f}", flush=True)
        print(f"barrier_p99_us={p99:.1f}", flush=True)
    if args.allreduce_mib:
        import torch

        comm = muster.Communicator(accelerator)
        # A float32 CPU tensor, as the goal says (and as gloo's side uses).
        data = torch.ones(args.allreduce_mib << 18, dtype=torch.float32)
        for _ in range(3):  # untimed, as allreduce_bench warms up
            comm.all_reduce(data)
        runs = []
        for _ in range(args.allreduce_iters):
            start = time.perf_counter_ns()
            comm.all_reduce(data)
            runs.append((time.perf_counter_ns() - start) / 1e6)
        if accelerator.is_main_process:
            # The line format of allreduce_bench and allreduce_gloo.py.
            us = statistics.median(runs) * 1e3
            print(f"size_bytes={data.numel() * 4} time_us_p50={us:.1f}", flush=True)


if __name__ == "__main__":
    main()
