"""Worker for tests/tests/launch_compat.rs: records what a launcher gave this process.

Writes one JSON file per rank into the directory named by MUSTER_COMPAT_OUT: sys.argv, the
interpreter's environment (sys.prefix), the working directory, how it was started (as a
script, which includes runpy.run_path, or as a module), and the launcher's environment
variables (the torchrun contract, OMP_NUM_THREADS, Accelerate's ACCELERATE_*/FSDP_*, and
anything named by MUSTER_COMPAT_KEYS). The test runs the same command line under the peer
(torchrun, `accelerate launch`) and under `muster-agent launch` and compares the files.

When RANK equals MUSTER_COMPAT_FAIL_RANK, this rank waits until every other rank of the node
has written its file, then exits with status 3, so the launchers' exit statuses can be compared
without a race against the other ranks being stopped.
"""

import json
import os
import sys
import time

# Variables whose exact value is compared.
EXACT = [
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "GROUP_WORLD_SIZE",
    "ROLE_NAME",
    "ROLE_RANK",
    "ROLE_WORLD_SIZE",
    "OMP_NUM_THREADS",
    "CUDA_VISIBLE_DEVICES",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_MAX_RESTARTS",
]
# Variables whose presence only is compared: their values are the launcher's own (a free port,
# a generated run id, a host name the launcher resolved).
PRESENT = ["MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID"]
# Prefixes of variables compared exactly: what `accelerate launch` hands the workers.
PREFIXES = ["ACCELERATE_", "FSDP_"]


def dump(entry):
    """Writes this rank's record; `entry` says how the interpreter started the worker."""
    out = os.environ["MUSTER_COMPAT_OUT"]
    rank = os.environ.get("RANK", "unset")
    env = {}
    extra = [k for k in os.environ.get("MUSTER_COMPAT_KEYS", "").split(",") if k]
    for key in EXACT + extra:
        env[key] = os.environ.get(key)
    for key in PRESENT:
        env[key + " (set)"] = key in os.environ
    for key, value in os.environ.items():
        if any(key.startswith(p) for p in PREFIXES):
            env[key] = value
    record = {
        "entry": entry,
        "argv": sys.argv,
        "prefix": sys.prefix,
        "cwd": os.getcwd(),
        "env": env,
    }
    path = os.path.join(out, f"rank{rank}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(record, f, indent=1, sort_keys=True)
    os.rename(path + ".tmp", path)
    if rank == os.environ.get("MUSTER_COMPAT_FAIL_RANK"):
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        base = int(rank) - int(os.environ.get("LOCAL_RANK", "0"))
        others = [os.path.join(out, f"rank{r}.json") for r in range(base, base + local)]
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not all(map(os.path.exists, others)):
            time.sleep(0.01)
        sys.exit(3)


if __name__ == "__main__":
    dump("script" if globals().get("__spec__") is None else "module " + __spec__.name)
