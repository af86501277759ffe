"""muster-agent's start-up hook for the Python workers it launches (first on PYTHONPATH).

With ``TORCH_WORKER_SERVER_SOCKET`` set, it takes the variable out of the environment (the
worker's own children, data loader workers, must not bind the rank's socket) and waits for the
script to import ``torch.distributed``; then ``_muster_flight`` starts torch's worker server
there, for the agent to read the rank's Flight Recorder. With ``MUSTER_STEP_SOCKET`` set
(global rank 0 only), it takes that out too and waits for ``torch.optim``; then
``_muster_steps`` sends each optimizer step to the agent, the job's step markers. A
``sitecustomize`` this one shadows is run after it. It runs in every Python process the agent
starts, so it is short and imports only ``os`` and ``sys`` (and, once per launch under
PYTHONDONTWRITEBYTECODE, what writes its bytecode into the agent's folder).
"""

import os
import sys


class _After:
    """A meta path finder that, once module ``module`` has run, calls ``handler``'s
    ``start(arg)`` (``torch.distributed``: ``_muster_flight``; ``torch.optim``:
    ``_muster_steps``): it takes the module's spec from the finders after it and wraps its
    loader."""

    def __init__(self, module, handler, arg):
        self.module = module
        self.handler = handler
        self.arg = arg

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.module:
            return None
        sys.meta_path.remove(self)
        spec = None
        for other in sys.meta_path:
            find = getattr(other, "find_spec", None)
            spec = find(fullname, path, target) if find else None
            if spec is not None:
                break
        if spec is None or spec.loader is None:
            return spec
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            __import__(self.handler).start(self.arg)

        spec.loader.exec_module = exec_module
        return spec


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


def _cache_bytecode():
    """Writes the bytecode of this hook and of the two modules it may import into the agent's
    folder, once, when the interpreter runs with PYTHONDONTWRITEBYTECODE (or ``-B``): that
    keeps caches out of the user's tree, and this folder is the agent's. Compiling the hook
    afresh costs each worker about 0.8 ms at start; a restarted generation, and most of the
    first, load the bytecode instead. Without the flag Python writes the caches itself."""
    spec = globals().get("__spec__")
    cached = getattr(spec, "cached", None)
    if not sys.dont_write_bytecode or not cached or os.path.exists(cached):
        return
    import importlib.machinery

    here = os.path.dirname(spec.origin)
    # Only this process's start-up runs here (one thread), so the flag's flip reaches no
    # other import.
    sys.dont_write_bytecode = False
    try:
        for name in ("sitecustomize", "_muster_flight", "_muster_steps"):
            path = os.path.join(here, name + ".py")
            try:
                importlib.machinery.SourceFileLoader(name, path).get_code(name)
            except (ImportError, OSError):
                pass
    finally:
        sys.dont_write_bytecode = True


_cache_bytecode()
_socket = os.environ.pop("TORCH_WORKER_SERVER_SOCKET", None)
if _socket:
    sys.meta_path.insert(0, _After("torch.distributed", "_muster_flight", _socket))
_steps = os.environ.pop("MUSTER_STEP_SOCKET", None)
if _steps:
    sys.meta_path.insert(0, _After("torch.optim", "_muster_steps", _steps))
_run_shadowed()
