"""``python -m muster.launch ARGS`` is ``muster-agent launch ARGS`` (as ``python -m
torch.distributed.run`` is ``torchrun``)."""

from __future__ import annotations

import sys

from muster._cli import agent

if __name__ == "__main__":
    agent(["launch", *sys.argv[1:]])
