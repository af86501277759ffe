"""muster-agent's start-up hook for the Python workers it launches (first on PYTHONPATH).

With ``TORCH_WORKER_SERVER_SOCKET`` set, it takes the variable out of the environment (the
worker's own children, data loader workers, must not bind the rank's socket) and waits for the
script to import ``torch.distributed``; then ``_muster_flight`` starts torch's worker server
there, for the agent to read the rank's Flight Recorder. A ``sitecustomize`` this one shadows
is run after it. It runs in every Python process the agent starts, often compiled afresh
(PYTHONDONTWRITEBYTECODE), so it is short and imports only ``os`` and ``sys``.
"""

import os
import sys


class _AfterTorchDistributed:
    """A meta path finder that hands ``torch.distributed`` to ``_muster_flight``."""

    def __init__(self, socket):
        self.socket = socket

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "torch.distributed":
            return None
        sys.meta_path.remove(self)
        import _muster_flight

        return _muster_flight.find_spec(self, fullname, path, target, self.socket)


def _run_shadowed():
    """Runs the next ``sitecustomize`` on sys.path, the one this file hides."""
    here = os.path.dirname(os.path.abspath(__file__))
    path = [p for p in sys.path if os.path.abspath(p or ".") != here]
    names = ("sitecustomize.py", "sitecustomize")
    if not any(os.path.exists(os.path.join(p or ".", n)) for p in path for n in names):
        return
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", path)
    if spec is not None and spec.loader is not None:
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


_socket = os.environ.pop("TORCH_WORKER_SERVER_SOCKET", None)
if _socket:
    sys.meta_path.insert(0, _AfterTorchDistributed(_socket))
_run_shadowed()
