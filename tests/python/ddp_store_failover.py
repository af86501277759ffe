"""An unmodified PyTorch DDP training script (no muster imports) that keeps torch's default
store busy while it trains, for tests/tests/agent_store_ha.rs (coordinator failover and
several hosts under the agent store).

Usage: ddp_store_failover.py DIR

The test steers it with files in DIR:
- DIR/init: while it is absent, the last rank waits before init_process_group, so the other
  ranks sit inside init_process_group waiting in the store for its keys (the test kills the
  coordinator leader then, and creates the file).
- DIR/stop: training goes on until rank 0 sees this file (the ranks agree on it through an
  all_reduce), so the test can kill the leader mid-training and let the job run on after.

Each rank adds 1 to a counter once the process group is up. Every step is then a DDP step plus
store traffic through torch's default store: a key set by each rank and read (blocking) by the
next one, possibly on another node; the counter read with add(key, 0), as torch's store-based
barrier polls one; an add of 1 to a second counter, of steps; and a delete of an old key. At
the end each rank checks that both counters counted every add exactly once (an add applied
twice by a retry after a coordinator failover would show here) and that the parameters agree on
every rank, and prints one line that the test checks.

Lines printed: "initialising rank=R" before init_process_group; "ready rank=R pid=P
master=ADDR:PORT agent_store=V" once the process group is up; "step rank=R n=N" after each
step; "ddp_store_failover rank=R world=W steps=S started=N stepped=T restart_count=C
params_in_sync=B" at the end.
"""

import os
import sys
import time

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

folder = sys.argv[1]
rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])


def wait_for(name: str) -> None:
    path = os.path.join(folder, name)
    deadline = time.monotonic() + 300
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            sys.exit(f"ddp_store_failover.py: {path} never appeared")
        time.sleep(0.05)


print(f"initialising rank={rank}", flush=True)
if rank == world - 1:
    wait_for("init")
dist.init_process_group("gloo", init_method="env://")
print(
    f"ready rank={rank} pid={os.getpid()}"
    f" master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    f" agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}",
    flush=True,
)
store = dist.distributed_c10d._get_default_store()
store.add("started", 1)

# DDP's constructor broadcasts the parameters: every rank has added to the counter after it.
torch.manual_seed(0)
model = DistributedDataParallel(torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
stop_file = os.path.join(folder, "stop")
steps = 0
while True:
    inputs = torch.full((16, 8), float(rank + 1) / (steps + 1))
    loss = torch.nn.functional.mse_loss(model(inputs), torch.zeros(16, 1))
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()

    store.set(f"step/{steps}/{rank}", f"{loss.item():.6f}")
    started = store.add("started", 0)
    if started != world:
        sys.exit(f"ddp_store_failover.py: the counter says {started} at step {steps}, not {world}")
    peer = (rank + 1) % world
    # Blocks until the next rank (on this node or another) has set its key.
    if not store.get(f"step/{steps}/{peer}"):
        sys.exit(f"ddp_store_failover.py: rank {peer}'s key of step {steps} is empty")
    if steps >= 2:
        # Read by the previous rank before it joined the all_reduce of step steps - 1.
        store.delete_key(f"step/{steps - 2}/{rank}")
    store.add("stepped", 1)
    steps += 1
    print(f"step rank={rank} n={steps}", flush=True)

    stop = torch.tensor([1.0 if rank == 0 and os.path.exists(stop_file) else 0.0])
    dist.all_reduce(stop)
    if stop.item() > 0:
        break

dist.barrier()
started = store.add("started", 0)
# Every rank took as many steps (they agree to stop in an all_reduce), each adding 1.
stepped = store.add("stepped", 0)
params = torch.cat([p.detach().flatten() for p in model.parameters()])
gathered = [torch.zeros_like(params) for _ in range(world)]
dist.all_gather(gathered, params)
in_sync = all(torch.equal(gathered[0], p) for p in gathered)
print(
    f"ddp_store_failover rank={rank} world={world} steps={steps} started={started}"
    f" stepped={stepped} restart_count={os.environ['TORCHELASTIC_RESTART_COUNT']} params_in_sync={in_sync}",
    flush=True,
)
dist.barrier()
dist.destroy_process_group()
if started != world:
    sys.exit(f"ddp_store_failover.py: the counter says {started}, not {world}")
if stepped != world * steps:
    sys.exit(f"ddp_store_failover.py: the step counter says {stepped}, not {world * steps}")
