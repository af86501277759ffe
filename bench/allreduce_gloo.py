"""torch's gloo all_reduce, measured exactly as muster's `allreduce_bench` example measures its own.

Run under torchrun (the `allreduce` benchmark embeds this file and does):
    torchrun --nproc-per-node N allreduce_gloo.py --sizes 4,4096 [--iters K] [--bytes-per-size B]

For each size (bytes of f32): one checked all_reduce (rank r contributes r + 1 everywhere), W
untimed warm-up all_reduces of zeros, a barrier, then `iters` back-to-back all_reduce(SUM) calls
each timed on its own, then a barrier. iters = clamp(B // size, 3, K), W = clamp(iters // 10, 1,
10): the same rule as the muster worker. Rank 0 prints one line per size:
    size_bytes=<n> iters=<k> time_us_p50=<median> time_us_mean=<total/iters> algbw_gbs=<n/p50> busbw_gbs=<algbw*2(N-1)/N>
"""
import argparse
import statistics
import time

import torch
import torch.distributed as dist

p = argparse.ArgumentParser()
p.add_argument("--sizes", required=True, help="bytes, comma-separated")
p.add_argument("--iters", type=int, default=200)
p.add_argument("--bytes-per-size", type=int, default=1 << 30)
a = p.parse_args()
dist.init_process_group("gloo")
rank, n = dist.get_rank(), dist.get_world_size()

for size in [int(s) for s in a.sizes.split(",")]:
    numel = max(1, size // 4)
    size = numel * 4
    iters = max(3, min(a.iters, a.bytes_per_size // size))
    warmup = max(1, min(10, iters // 10))
    x = torch.full((numel,), float(rank + 1), dtype=torch.float32)
    dist.all_reduce(x)
    want = n * (n + 1) / 2
    if not bool((x == want).all()):
        raise SystemExit(f"gloo all_reduce of {size} bytes is wrong: {x[:4]} != {want}")
    x.zero_()
    for _ in range(warmup):
        dist.all_reduce(x)
    ts = []
    dist.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        t = time.perf_counter()
        dist.all_reduce(x)
        ts.append(time.perf_counter() - t)
    total = time.perf_counter() - start
    dist.barrier()
    if rank == 0:
        p50 = statistics.median(ts)
        algbw = size / p50 / 1e9
        print(
            f"size_bytes={size} iters={iters} time_us_p50={p50 * 1e6:.1f} "
            f"time_us_mean={total / iters * 1e6:.1f} algbw_gbs={algbw:.3f} "
            f"busbw_gbs={algbw * 2 * (n - 1) / n:.3f}",
            flush=True,
        )
    del x
dist.destroy_process_group()
