"""The GPU check of ``muster.torch`` with NCCL, run under ``muster-agent launch`` (one process
per GPU) by ``scripts/gpu-check.sh``: ``init_process_group("nccl")`` through ``muster.torch``
(``--how muster``), through ``init_method="muster://"`` (``--how url``) or through ``env://``
(``--how env``, the peer, under torchrun); then known-value collectives on CUDA tensors, three
DDP steps on the GPU, and the median time of a 64 MiB float32 all_reduce, both of a tensor on
the GPU and of a pageable CPU tensor copied into a GPU buffer and back (what muster's own NCCL
backend does with host buffers). Rank 0 prints ``key=value`` lines; a failed check raises."""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.distributed as dist


def timed(fn, iters: int) -> float:
    """Median milliseconds of ``fn`` over ``iters`` calls, each synchronised."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--how", choices=["muster", "url", "env"], required=True)
    parser.add_argument("--mib", type=int, default=64)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    start = time.perf_counter()
    if args.how == "muster":
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        import muster.torch

        muster.torch.init_process_group("nccl", device_id=device)
    elif args.how == "url":
        for key in ("MASTER_ADDR", "MASTER_PORT"):
            os.environ.pop(key, None)
        import muster.torch  # registers muster://

        dist.init_process_group("nccl", init_method="muster://", device_id=device)
    else:
        dist.init_process_group("nccl", init_method="env://", device_id=device)
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.full((1000,), float(rank + 1), device=device)
    dist.all_reduce(x)
    torch.cuda.synchronize()
    init_ms = (time.perf_counter() - start) * 1e3
    assert torch.all(x == world * (world + 1) / 2), x[:4]
    y = torch.full((7,), float(rank), device=device)
    dist.broadcast(y, 0)
    assert torch.all(y == 0), y
    gathered = torch.empty(world * 3, device=device)
    dist.all_gather_into_tensor(gathered, torch.full((3,), float(rank), device=device))
    assert gathered.tolist() == [float(r) for r in range(world) for _ in range(3)], gathered

    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(64, 8).to(device), device_ids=[local])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    torch.manual_seed(rank)
    for _ in range(3):
        opt.zero_grad()
        model(torch.randn(32, 64, device=device)).sum().backward()
        opt.step()
    w = model.module.weight.detach().clone()
    dist.all_reduce(w)
    assert torch.allclose(w / world, model.module.weight), "DDP replicas differ"

    n = args.mib * 1024 * 1024 // 4
    on_gpu = torch.ones(n, device=device)
    gpu_ms = timed(lambda: dist.all_reduce(on_gpu), args.iters)
    # Pageable memory, as muster's NCCL backend gets it from a Vec.
    host = torch.ones(n)
    staged = torch.empty(n, device=device)

    def host_round_trip() -> None:
        staged.copy_(host)
        dist.all_reduce(staged)
        host.copy_(staged)

    host_ms = timed(host_round_trip, args.iters)
    if rank == 0:
        print(
            f"how={args.how} world={world} init_ms={init_ms:.1f} checks=passed "
            f"allreduce_gpu_ms={gpu_ms:.3f} allreduce_host_ms={host_ms:.3f} mib={args.mib} "
            f"torch={torch.__version__} nccl={'.'.join(map(str, torch.cuda.nccl.version()))} "
            f"gpu={torch.cuda.get_device_name(device)}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
