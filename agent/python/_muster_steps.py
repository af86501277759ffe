"""Step markers for a training script that never imports muster, imported by muster-agent's
start-up hook (``sitecustomize.py`` beside this file) once the script imports ``torch.optim``.

Global rank 0's worker gets ``MUSTER_STEP_SOCKET``, a Unix datagram socket of its agent. After
every optimizer step (torch's global ``register_optimizer_step_post_hook``: Accelerate's
wrapped optimizer steps the real one only when gradients are synchronised) the hook sends the
step as decimal text, without waiting; the agent passes it to the coordinator as rank 0's step
marker, which the job's effective training time (ETTR) counts. The step is the optimizer's own
count where it keeps one on the CPU (Adam's and AdamW's ``step``, restored with a checkpoint),
else the steps this process has taken. A script that marks its steps itself
(``muster.torch.begin_step``, ``Accelerator.begin_step``) turns this off: the muster package
then says so (``muster.accelerator.STEPS_MARKED``).
"""

import socket
import sys

_state = {"sock": None, "path": None, "count": 0}


def _marked_by_the_script():
    """Whether the script marks its steps itself (through the muster package)."""
    accelerator = sys.modules.get("muster.accelerator")
    return accelerator is not None and getattr(accelerator, "STEPS_MARKED", False)


def _step_of(optimizer):
    """The optimizer's step count, or this process's count of steps."""
    _state["count"] += 1
    for group in optimizer.param_groups:
        for param in group["params"]:
            step = optimizer.state.get(param, {}).get("step")
            if step is None:
                return _state["count"]
            device = getattr(step, "device", None)
            if device is not None and device.type != "cpu":
                # Reading a device tensor would wait for the device.
                return _state["count"]
            try:
                return int(step)
            except (TypeError, ValueError):
                return _state["count"]
    return _state["count"]


def _after_step(optimizer, args, kwargs):
    if _marked_by_the_script():
        return
    try:
        _state["sock"].sendto(b"%d" % _step_of(optimizer), _state["path"])
    except OSError:
        pass


def start(path):
    """Registers the hook once ``torch.optim`` has run; a torch without global optimizer
    hooks marks nothing."""
    if _state["sock"] is not None:
        return
    try:
        from torch.optim.optimizer import register_optimizer_step_post_hook

        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        sock.setblocking(False)
    except (ImportError, OSError):
        return
    _state["sock"] = sock
    _state["path"] = path
    register_optimizer_step_post_hook(_after_step)
