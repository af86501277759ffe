"""A torch DDP loop that never imports muster: 20 Adam steps on gloo, 20 ms apart, for the
agent's step markers (tests/tests/steps.rs). Its effective training time must still reach the
coordinator, from the agent's start-up hook (agent/python/_muster_steps.py)."""

import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

STEPS = 20


def main():
    dist.init_process_group("gloo")
    torch.manual_seed(0)
    model = DistributedDataParallel(torch.nn.Linear(8, 1))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(STEPS):
        optimizer.zero_grad()
        loss = model(torch.randn(16, 8)).pow(2).mean()
        loss.backward()
        optimizer.step()
        time.sleep(0.02)
    dist.barrier()
    dist.destroy_process_group()
    print(f"done steps={STEPS}")


if __name__ == "__main__":
    main()
