"""A torch gloo script where rank 1 calls one all_reduce fewer than the others: after the
first all_reduce, ranks 0 and 2 wait in a second one that rank 1 never joins, and rank 1 waits
in the barrier after it. The two collective call sites, with their ranks, are what
tests/tests/stacks.rs expects `describe --stacks` to name."""

import torch
import torch.distributed as dist

dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
dist.all_reduce(t)
print(f"ready rank={rank}", flush=True)
if rank != 1:
    dist.all_reduce(t)
dist.barrier()
