"""A torch gloo DDP loop that prints its step times: the stacks benchmark runs it under
`muster-agent launch` with stack sampling on and off, side by side.

    muster-agent launch --nproc-per-node N -- python ddp_steps.py --steps 300 --warmup 30

Rank 0 prints `step_ms_p50=<median> step_ms_mean=<mean> steps=<n>` for the timed steps.
"""

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

p = argparse.ArgumentParser()
p.add_argument("--steps", type=int, default=300)
p.add_argument("--warmup", type=int, default=30)
a = p.parse_args()
torch.set_num_threads(1)
dist.init_process_group("gloo")
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(512, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x = torch.randn(64, 512)
times = []
for step in range(a.warmup + a.steps):
    t = time.perf_counter()
    opt.zero_grad()
    loss = model(x).square().mean()
    loss.backward()
    opt.step()
    if step >= a.warmup:
        times.append((time.perf_counter() - t) * 1000)
if dist.get_rank() == 0:
    print(
        f"step_ms_p50={statistics.median(times):.3f} step_ms_mean={statistics.fmean(times):.3f} steps={len(times)}",
        flush=True,
    )
# Both ranks past their last collective before either tears gloo down (a rank destroying its
# group while the other is still in the last all_reduce can abort the other one).
dist.barrier()
dist.destroy_process_group()
