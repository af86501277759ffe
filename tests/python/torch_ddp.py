# An unmodified PyTorch DDP script (no muster imports), as torchrun would run it: the launcher's
# environment, a gloo process group from env://, one all_reduce, one DDP step on CPU, a barrier.
# Each rank prints one deterministic line that tests/tests/interop.rs checks.
import os
import sys

REQUIRED = [
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_RUN_ID",
]
missing = [name for name in REQUIRED if name not in os.environ]
if missing:
    sys.exit(f"torch_ddp.py: the launcher did not set {', '.join(missing)}")

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
if rank != int(os.environ["RANK"]) or world != int(os.environ["WORLD_SIZE"]):
    sys.exit(f"torch_ddp.py: process group rank {rank}/{world} does not match the environment")

# Sum of 1..world on every rank.
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)

# One DDP step: every rank sees different data, and DDP averages the gradients, so the
# parameters must be identical on every rank afterwards.
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(4, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
inputs = torch.full((8, 4), float(rank + 1))
loss = torch.nn.functional.mse_loss(model(inputs), torch.zeros(8, 1))
loss.backward()
optimizer.step()
params = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(params) for _ in range(world)]
dist.all_gather(gathered, params)
in_sync = all(torch.equal(gathered[0], p) for p in gathered)

dist.barrier()
print(
    f"torch_ddp rank={rank} world={world} local_rank={os.environ['LOCAL_RANK']}"
    f" restart_count={os.environ['TORCHELASTIC_RESTART_COUNT']}"
    f" run_id={os.environ['TORCHELASTIC_RUN_ID']} all_reduce={total.item():g}"
    f" params_in_sync={in_sync}",
    flush=True,
)
dist.destroy_process_group()
