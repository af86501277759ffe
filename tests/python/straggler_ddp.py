"""A torch gloo DDP loop in which one rank (STRAGGLER_RANK, if set) spends 30 ms more per step
in its own data loading than the others: they wait for it in backward, where DDP all-reduces.
Runs until stopped. tests/tests/stragglers.rs reads it from outside (no muster import)."""

import os
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

torch.set_num_threads(1)
dist.init_process_group("gloo")
rank = dist.get_rank()
extra = 0.03 if str(rank) == os.environ.get("STRAGGLER_RANK") else 0.0
model = DDP(torch.nn.Linear(64, 64))
opt = torch.optim.SGD(model.parameters(), lr=0.01)


def load_batch():
    time.sleep(0.005 + extra)
    return torch.randn(16, 64)


print("training", flush=True)
while True:
    x = load_batch()
    opt.zero_grad()
    model(x).square().mean().backward()
    opt.step()
