"""torch's worker server for the rank, started by muster-agent's start-up hook
(``sitecustomize.py`` beside this file) once the script imports ``torch.distributed``.

The server is torch's own (``torch._C._distributed_c10d._WorkerServer``, what
``torch.distributed.elastic.control_plane.worker_main`` starts), on the Unix socket the agent
named for the rank, so that the agent can read the rank's Flight Recorder
(``/handler/fr_trace_json``, ``/handler/dump_nccl_trace_json``) without a change to the script.
Its start and stop lines (c10d warnings, written from C++) are kept off the worker's stderr.
This module is imported only by processes that import torch.distributed: the hook itself stays
small, since every Python process the agent starts runs it.
"""

import os
import sys

_servers = []


def _quiet(call):
    """Runs ``call`` with file descriptor 2 on /dev/null (c10d logs from C++)."""
    sys.stderr.flush()
    saved = os.dup(2)
    null = os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        return call()
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def start(socket):
    """Starts the worker server once; a torch without one leaves the rank without it."""
    if _servers:
        return
    try:
        from torch._C._distributed_c10d import _WorkerServer

        # The socket of this rank's previous worker (a respawn, a restart): the server
        # refuses a path that exists, and nothing serves it any more.
        try:
            os.unlink(socket)
        except FileNotFoundError:
            pass
        server = _quiet(lambda: _WorkerServer(socket))
    except Exception:  # noqa: BLE001 - an older torch, a socket that cannot be bound
        return
    _servers.append(server)
    import atexit

    atexit.register(lambda: _quiet(server.shutdown))
