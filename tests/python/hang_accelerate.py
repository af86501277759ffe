"""An unmodified Accelerate script that hangs: one rank (STUCK_RANK, default 1) is stuck in its
own slow data step while the others wait in `accelerator.wait_for_everyone()`, a torch
collective. tests/tests/stacks.rs reads its stacks from outside (no muster import here)."""

import os
import time

from accelerate import Accelerator


def slow_data_step():
    time.sleep(600)


accelerator = Accelerator()
print(f"ready rank={accelerator.process_index}", flush=True)
if accelerator.process_index == int(os.environ.get("STUCK_RANK", "1")):
    slow_data_step()
accelerator.wait_for_everyone()
