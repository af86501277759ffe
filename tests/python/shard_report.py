# The Accelerate side of worker-sdk/examples/shard_report.rs: which items of the dataset
# range(L) each process sees at each step, and what gather_for_metrics returns, from
# Accelerate's own classes. Prints exactly the example's lines:
#
#   rank=<r> step=<s> batch=<items>      for each batch of each process
#   step=<s> gathered=<items>            after each step (process 0's gather_for_metrics)
#
# Modes:
#   --simulate P   P processes in this one process: prepare_data_loader(num_processes=P,
#                  process_index=r) for every r (BatchSamplerShard / IterableDatasetShard /
#                  DataLoaderShard, Accelerate's P = 1 bypass included), and process 0's
#                  Accelerator.gather_for_metrics with its gather replaced by the concatenation
#                  of every process's batch of the step (so the truncation is Accelerate's own
#                  code, driven by process 0's live GradientState).
#   (no --simulate) the real thing under a launcher (accelerate launch, torchrun or
#                  muster-agent launch --cpu): Accelerator().prepare(DataLoader) and a real
#                  gather_for_metrics. Only meaningful with even batches (Accelerate's gather
#                  needs equal shapes).
#   --cases        reads one case per stdin line (the flags above, with --simulate), prints
#                  `case <line>` and then its report for each; one torch import for a whole grid.
#
# Other flags: --len L --batch-size B [--split-batches] [--no-even-batches] [--drop-last]
# [--iterable] [--order i,j,...] (the epoch's order: a sampler yielding that permutation, in
# place of muster's shuffle, whose permutation is not torch's). A configuration Accelerate
# refuses prints `error: <message>`.
import argparse
import shlex
import sys


def parser():
    p = argparse.ArgumentParser()
    p.add_argument("--len", type=int, required=True)
    p.add_argument("--batch-size", type=int, required=True)
    p.add_argument("--split-batches", action="store_true")
    p.add_argument("--no-even-batches", action="store_true")
    p.add_argument("--drop-last", action="store_true")
    p.add_argument("--iterable", action="store_true")
    p.add_argument("--order", type=str, default=None)
    p.add_argument("--simulate", type=int, default=None)
    return p


def join(items):
    return ",".join(str(int(i)) for i in items)


def make_loader(args):
    from torch.utils.data import DataLoader, IterableDataset

    class Stream(IterableDataset):
        def __init__(self, n):
            self.n = n

        def __iter__(self):
            return iter(range(self.n))

    if args.iterable:
        return DataLoader(Stream(args.len), batch_size=args.batch_size, drop_last=args.drop_last)
    sampler = None
    if args.order is not None:
        sampler = [int(i) for i in args.order.split(",")] if args.order else []
    return DataLoader(
        list(range(args.len)),
        batch_size=args.batch_size,
        drop_last=args.drop_last,
        sampler=sampler,
    )


def simulate(args, accelerator, out):
    import torch
    from accelerate.data_loader import prepare_data_loader

    world = args.simulate
    loaders = []
    for rank in range(world):
        loaders.append(
            prepare_data_loader(
                make_loader(args),
                num_processes=world,
                process_index=rank,
                split_batches=args.split_batches,
                even_batches=not args.no_even_batches,
                put_on_device=False,
                dispatch_batches=False,
            )
        )
    # Processes 1.. first (each loader registers with the GradientState singleton while it
    # runs and leaves it at its end), then process 0 live, so that its state drives
    # gather_for_metrics.
    others = [[b.tolist() for b in loader] for loader in loaders[1:]]
    steps = 0
    for step, batch in enumerate(loaders[0]):
        steps = step + 1
        per_rank = [batch.tolist()] + [o[step] if step < len(o) else [] for o in others]
        for rank, items in enumerate(per_rank):
            if rank == 0 or step < len(others[rank - 1]):
                out.append(f"rank={rank} step={step} batch={join(items)}")
        cat = torch.tensor([i for items in per_rank for i in items], dtype=torch.int64)
        accelerator.gather = lambda _data, cat=cat: cat
        gathered = accelerator.gather_for_metrics(batch)
        out.append(f"step={step} gathered={join(gathered.tolist())}")
    for rank, o in enumerate(others, start=1):
        for step in range(steps, len(o)):
            out.append(f"rank={rank} step={step} batch={join(o[step])} (after process 0's end)")


def launched(args):
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    accelerator = Accelerator(
        dataloader_config=DataLoaderConfiguration(
            split_batches=args.split_batches,
            even_batches=not args.no_even_batches,
            dispatch_batches=False,
        )
    )
    rank = accelerator.process_index
    loader = accelerator.prepare(make_loader(args))
    for step, batch in enumerate(loader):
        print(f"rank={rank} step={step} batch={join(batch.tolist())}", flush=True)
        gathered = accelerator.gather_for_metrics(batch)
        if accelerator.is_main_process:
            print(f"step={step} gathered={join(gathered.tolist())}", flush=True)
    accelerator.end_training()


def main():
    argv = sys.argv[1:]
    if argv == ["--cases"]:
        from accelerate import Accelerator

        accelerator = Accelerator(cpu=True)
        for line in sys.stdin:
            line = line.strip()
            if not line:
                continue
            out = [f"case {line}"]
            try:
                simulate(parser().parse_args(shlex.split(line)), accelerator, out)
            except ValueError as e:
                out = [f"case {line}", f"error: {e}"]
            print("\n".join(out), flush=True)
        return
    args = parser().parse_args(argv)
    if args.simulate is None:
        launched(args)
        return
    from accelerate import Accelerator

    out = []
    try:
        simulate(args, Accelerator(cpu=True), out)
    except ValueError as e:
        out = [f"error: {e}"]
    print("\n".join(out), flush=True)


if __name__ == "__main__":
    main()
