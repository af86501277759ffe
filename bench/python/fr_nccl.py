"""The GPU check of the agent's Flight Recorder route over NCCL, run under ``muster-agent
launch`` by ``scripts/gpu-check.sh``: three NCCL ``all_reduce`` calls of 1024 floats on the
GPU, then ``ready rank=N`` and a sleep, while the check runs ``describe --stacks`` and expects
the rank's last collective to read ``nccl:all_reduce``. The script itself knows nothing of
muster."""

import os
import time

import torch
import torch.distributed as dist

torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
dist.init_process_group("nccl")
t = torch.ones(1024, device="cuda")
for _ in range(3):
    dist.all_reduce(t)
torch.cuda.synchronize()
print(f"ready rank={dist.get_rank()}", flush=True)
time.sleep(float(os.environ.get("FR_SLEEP", "60")))
dist.destroy_process_group()
