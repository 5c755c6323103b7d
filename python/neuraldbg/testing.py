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
"""

from ._guard import ENTRY_POINTS, InjectedFault, fault_at

__all__ = ["ENTRY_POINTS", "InjectedFault", "fault_at"]
