"""muster-agent's start-up hook for the Python workers it launches (on PYTHONPATH).

Once the script imports ``torch.distributed``, it starts torch's own worker server
(``torch._C._distributed_c10d._WorkerServer``, what
``torch.distributed.elastic.control_plane.worker_main`` starts) on the Unix socket named by
``TORCH_WORKER_SERVER_SOCKET``, so that the agent can read the rank's Flight Recorder
(``/handler/fr_trace_json``) without a change to the script. Processes that never import
torch.distributed pay one environment lookup. The variable is taken out of the environment so
that the worker's own children (data loader workers) do not bind the rank's socket, and the
server's start and stop lines (c10d warnings) are kept off the worker's stderr. A
``sitecustomize`` this one shadows is run after it.

It runs in every Python process the agent starts, so it imports nothing beyond ``os`` and
``sys`` (which the interpreter has already loaded): ``importlib.abc`` alone costs 27 ms.
"""

import os
import sys

_SOCKET = os.environ.pop("TORCH_WORKER_SERVER_SOCKET", None)
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


def _start():
    """Starts the worker server once; a torch without one leaves the rank without it."""
    if _servers:
        return
    try:
        from torch._C._distributed_c10d import _WorkerServer

        # The socket of this rank's previous worker (a respawn, a restart): the server
        # refuses a path that exists, and nothing serves it any more.
        try:
            os.unlink(_SOCKET)
        except FileNotFoundError:
            pass
        server = _quiet(lambda: _WorkerServer(_SOCKET))
    except Exception:  # noqa: BLE001 - an older torch, a socket that cannot be bound
        return
    _servers.append(server)
    import atexit

    atexit.register(lambda: _quiet(server.shutdown))


class _AfterTorchDistributed:
    """A meta path finder (the protocol of ``importlib.abc.MetaPathFinder``): finds
    ``torch.distributed`` through the other finders and starts the server once its module has
    run."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        spec = None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _start()

        spec.loader.exec_module = exec_module
        return spec


def _run_shadowed():
    """Runs the next ``sitecustomize`` on sys.path, the one this file hides (importlib is
    loaded only when there is one)."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    names = ("sitecustomize.py", "sitecustomize")
    if not any(os.path.exists(os.path.join(p or ".", n)) for p in path for n in names):
        return
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is None or spec.loader is None:
        return
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)


if _SOCKET:
    sys.meta_path.insert(0, _AfterTorchDistributed())
_run_shadowed()
