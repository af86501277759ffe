# An unmodified Hugging Face Accelerate script (no muster imports), as `accelerate launch`
# would run it: Accelerator() from the launcher's environment, wait_for_everyone,
# main_process_first, a gather, and the mixed precision the launcher asked for. Each rank
# prints lines that tests/tests/interop.rs checks.
import time

import torch
from accelerate import Accelerator

accelerator = Accelerator()
rank = accelerator.process_index
accelerator.wait_for_everyone()

# CLOCK_MONOTONIC is one clock for every process of the machine: the test orders the blocks by
# it, not by where the lines land in the agent's merged output (each rank has its own pipe).
with accelerator.main_process_first():
    print(f"accelerate rank={rank} main_process_first start t={time.monotonic_ns()}", flush=True)
    print(f"accelerate rank={rank} main_process_first done t={time.monotonic_ns()}", flush=True)

gathered = accelerator.gather(torch.tensor([rank * 10 + 1], device=accelerator.device))
accelerator.wait_for_everyone()
print(
    f"accelerate rank={rank} world={accelerator.num_processes}"
    f" local={accelerator.local_process_index} main={accelerator.is_main_process}"
    f" distributed_type={accelerator.distributed_type.value}"
    f" gathered={gathered.tolist()} mixed_precision={accelerator.mixed_precision}",
    flush=True,
)
accelerator.end_training()
