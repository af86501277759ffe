# An unmodified PyTorch script (no muster imports) for tests/tests/agent_store_launch.rs: a gloo
# process group from env://, then torch's own default store (whatever env:// connected to) used
# directly after rank 0 has exited.
#
# 1. init_process_group("gloo"), one all_reduce; each rank prints
#    "ready rank=R pid=P master=ADDR:PORT agent_store=V" and waits for the file named by argv[1]
#    (the test looks at the listening sockets meanwhile).
# 2. With argv[2] == "rank0-first": rank 0 publishes its pid and a value in the store and exits
#    at once, without destroy_process_group; the other ranks wait until that process is gone,
#    then set, add, wait for and get keys through the same store, and print
#    "after-rank0 rank=R ...". With "together": every rank sets and reads a key, and all end
#    together (as any script does under rank 0's own TCPStore, which dies with rank 0).
import os
import sys
import time

import torch
import torch.distributed as dist

go_file, mode = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo", init_method="env://")
rank, world = dist.get_rank(), dist.get_world_size()
total = torch.tensor([float(rank + 1)])
dist.all_reduce(total)
if total.item() != world * (world + 1) / 2:
    sys.exit(f"agent_store_job.py: all_reduce gave {total.item()}")
print(
    f"ready rank={rank} pid={os.getpid()}"
    f" master={os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
    f" agent_store={os.environ.get('TORCHELASTIC_USE_AGENT_STORE')}",
    flush=True,
)
deadline = time.monotonic() + 120
while not os.path.exists(go_file):
    if time.monotonic() > deadline:
        sys.exit(f"agent_store_job.py: {go_file} never appeared")
    time.sleep(0.05)

store = dist.distributed_c10d._get_default_store()
dist.barrier()
if mode == "together":
    store.set(f"together/{rank}", str(rank))
    store.wait([f"together/{r}" for r in range(world)])
    got = sum(int(store.get(f"together/{r}")) for r in range(world))
    dist.barrier()
    print(f"together rank={rank} sum={got}", flush=True)
    dist.destroy_process_group()
    sys.exit(0)
if rank == 0:
    store.set("rank0/pid", str(os.getpid()))
    store.set("rank0/said", "goodbye")
    print("rank 0 leaves first", flush=True)
    # No destroy_process_group, no atexit work: rank 0 is simply gone.
    os._exit(0)


def gone(pid):
    """Whether the process has exited (a zombie waiting for the agent to reap it counts)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X")
    except FileNotFoundError:
        return True


pid = int(store.get("rank0/pid"))
deadline = time.monotonic() + 30
while not gone(pid):
    if time.monotonic() > deadline:
        sys.exit(f"agent_store_job.py: rank 0 (pid {pid}) did not exit")
    time.sleep(0.05)

# Every operation below reaches the store after rank 0 is gone.
store.set(f"after/{rank}", f"rank{rank}")
count = store.add("after/count", 1)
others = [f"after/{r}" for r in range(1, world)]
store.wait(others)
seen = ",".join(store.get(k).decode() for k in others)
said = store.get("rank0/said").decode()
# Everyone has added once before anyone reads the final count.
store.add("after/done", 1)
while store.add("after/done", 0) < world - 1:
    time.sleep(0.01)
final = store.add("after/count", 0)
print(f"after-rank0 rank={rank} rank0_said={said} seen={seen} count={final}", flush=True)
if count < 1 or final != world - 1:
    sys.exit(f"agent_store_job.py: counter {count}/{final}")
