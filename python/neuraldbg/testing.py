"""Test hooks for NeuralDBG's own guarantees (not needed to use NeuralDBG).

NeuralDBG runs code inside the user's training loop at a fixed set of entry points (hooks, the
backward tap, the optimizer and GradScaler taps, the framework callbacks). Each is guarded: an
internal error there switches monitoring off with one :class:`~neuraldbg.NeuralDbgWarning`, and
training goes on. :func:`fault_at` makes one entry point raise, to check that::

    from neuraldbg.testing import ENTRY_POINTS, fault_at

    with NeuralDbg(model) as dbg:
        for step, (x, y) in enumerate(loader):
            if step == 5:
                stack.enter_context(fault_at("optimizer_step"))
            ...  # training finishes; steps 0-4 are diagnosed

The other hooks say which way a run's steps are read (:func:`read_path`), how many are still on
their way to the engine (:func:`steps_in_flight`), and let a test see every call the engine
gets (:func:`spy_engine`), or make a CPU model take the device path (:func:`device_path`).
"""

from __future__ import annotations

from typing import Any

from ._guard import ENTRY_POINTS, InjectedFault, fault_at

__all__ = ["ENTRY_POINTS", "InjectedFault", "device_path", "fault_at", "read_path", "spy_engine", "steps_in_flight"]


def _collector(dbg: Any) -> Any:
    c = getattr(dbg, "_collector", None)
    if c is None:
        raise ValueError("the NeuralDbg is not watching a model (enter its `with` block first)")
    return c


def read_path(dbg: Any) -> str:
    """How the watched model's steps are read: ``"host"`` (a CPU model: the extension reads
    the tensors' memory), ``"direct"`` (one vector of device reductions a step, read at once),
    ``"deferred"`` (that vector copied asynchronously and handed over a step later, as on CUDA),
    or ``"device"`` (the device path, not decided until its first step)."""
    reader = _collector(dbg).reader
    if reader.host:
        return "host"
    return {None: "device", True: "deferred", False: "direct"}[reader.defer]


def steps_in_flight(dbg: Any) -> int:
    """Observed steps not yet handed to the engine (the deferred path's copies, a distributed
    job's exchanges in flight)."""
    reader = _collector(dbg).reader
    if reader.host:
        return 0
    return int(reader.pending is not None) + int(reader.later is not None)


def spy_engine(dbg: Any, spy: Any) -> None:
    """Hands ``spy`` every call the engine gets from now on (``spy`` passes them through to the
    engine it wraps). The extension's fast path calls the engine itself, so it is off while a
    spy is in place: every step goes through the collector."""
    c = _collector(dbg)
    c.engine = spy
    c.fast_path = False


def device_path(dbg: Any, deferred: bool) -> None:
    """Makes a CPU model, before its first step, take the device path as a CPU job under
    torch.distributed takes it: one float32 vector of torch reductions a step, module calls
    kept (not summarized), read at once (``deferred=False``) or copied and handed over a step
    later as on CUDA (``deferred=True``)."""
    from ._read_device import DeviceReader

    c = _collector(dbg)
    if c.registered:
        raise ValueError("device_path must be chosen before the model's first step")
    c.forced_reader = DeviceReader(c, deferred)
    c.decide_reader()
