"""A worker that makes itself non-dumpable (prctl(PR_SET_DUMPABLE, 0)) and then waits: an agent
without CAP_SYS_PTRACE cannot read its memory, and must say so in one line."""

import ctypes
import time

PR_SET_DUMPABLE = 4
libc = ctypes.CDLL(None, use_errno=True)
if libc.prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) != 0:
    raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE, 0)")
print("not dumpable", flush=True)
time.sleep(600)
