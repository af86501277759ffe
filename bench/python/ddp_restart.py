"""The torchrun side of ``target/release/recovery``: the model ``ddp_train`` trains (8 inputs, a
tanh hidden layer, one output; SGD with momentum) under ``torch.nn.parallel.DDP`` on gloo, with
a checkpoint (model, optimizer, step) written by rank 0 every ``--checkpoint-every`` steps and
loaded when the job (re)starts: torchrun's recovery model, a restart of every process plus a
checkpoint reload. Every step is written to the checkpoint by default, so no work is lost and
the figure is the restart's own cost.

Every rank prints ``started rank=R pid=P`` when it starts; rank 0 prints ``resumed step=S`` after
loading a checkpoint and ``step=S`` after each step. ``--step-sleep-ms`` paces the steps."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=100_000)
    parser.add_argument("--checkpoint", type=Path, required=True)
    parser.add_argument("--checkpoint-every", type=int, default=1)
    parser.add_argument("--step-sleep-ms", type=float, default=0.0)
    args = parser.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    print(f"started rank={rank} pid={os.getpid()}", flush=True)
    # torchrun keeps one agent store across restart attempts, and the keys gloo's group
    # writes there (its peers' addresses) outlive the attempt: a restarted rank can read a
    # dead peer's address and be refused. A prefix per attempt is the peer's best case.
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    store = dist.TCPStore(
        os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False
    )
    dist.init_process_group(
        "gloo", store=dist.PrefixStore(f"attempt{attempt}/", store), rank=rank, world_size=world
    )
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, args.hidden), nn.Tanh(), nn.Linear(args.hidden, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    step = 0
    if args.checkpoint.exists():
        state = torch.load(args.checkpoint, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        step = int(state["step"])
        if rank == 0:
            print(f"resumed step={step}", flush=True)
    ddp = nn.parallel.DistributedDataParallel(model)
    per_rank = max(1, args.batch_size // world)
    while step < args.steps:
        generator = torch.Generator().manual_seed(step * world + rank)
        x = torch.randn(per_rank, 8, generator=generator)
        y = x.sum(dim=1, keepdim=True).sin()
        optimizer.zero_grad()
        loss = ((ddp(x) - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        step += 1
        if rank == 0 and step % args.checkpoint_every == 0:
            partial = args.checkpoint.with_suffix(".partial")
            torch.save(
                {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step},
                partial,
            )
            partial.replace(args.checkpoint)
        if rank == 0:
            print(f"step={step}", flush=True)
        if args.step_sleep_ms > 0:
            time.sleep(args.step_sleep_ms / 1000)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
