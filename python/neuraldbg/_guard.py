"""The one guard around everything NeuralDBG runs inside the user's code.

Hooks, the backward tap, the optimizer and GradScaler taps, the end-of-backward callback, the
loop facts' probe, the framework callbacks' ``on_*`` methods and the logging of metrics all run
in the user's training loop. Each is registered through :func:`guarded`: an error of ours
there (any exception, also a Rust panic, which Python sees as a ``BaseException``) is caught,
monitoring is switched off with one :class:`~neuraldbg.NeuralDbgWarning` that names the entry
point, and training goes on. Only what is meant for the loop gets through: a Ctrl-C, a
``SystemExit``, and the halt (``halt_on``'s :class:`~neuraldbg.TrainingFailure`, or the user's
own ``on_failure`` error), which the owner marks as ``raising`` before it raises it.

:data:`ENTRY_POINTS` names every guarded place; :func:`fault_at` (a test hook, public through
:mod:`neuraldbg.testing`) makes one of them raise, to prove that the guard holds.
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any, Callable, FrozenSet, Iterator, Optional, Protocol

from .errors import NeuralDbgError

# Every place where NeuralDBG code runs inside the user's training.
ENTRY_POINTS: FrozenSet[str] = frozenset(
    {
        "forward_pre",  # the model's forward pre-hook: a forward pass starts
        "forward_post",  # the model's forward hook: it ended
        "criterion",  # the loss module's forward hook
        "grad_ready",  # a sentinel parameter's post-accumulate-grad hook
        "backward_end",  # the end-of-backward callback: where gradients are read
        "backward_start",  # the backward tap, before torch.autograd.backward runs
        "backward_done",  # the backward tap, after it returned
        "optimizer_step",  # the global optimizer step post hook: the step boundary
        "scaler_step",  # GradScaler.step starts
        "scaler_step_done",  # GradScaler.step returned
        "loop_probe",  # the loop facts' gradient hook (gradient accumulation)
        "record_loss",  # dbg.record_loss()
        "exit",  # the end of the `with` block: the last step handed over
        "callback",  # a framework callback's on_* method
        "log_metrics",  # the verdict handed to the framework's loggers
    }
)

REPORT = "please report it with this message at https://github.com/neuraldbg/neuraldbg/issues"

_lock = threading.Lock()
_faults: set[str] = set()


class InjectedFault(NeuralDbgError):
    """Raised at an entry point named by :func:`fault_at` (tests only)."""


class Owner(Protocol):
    """What the guard needs of whoever owns a guarded entry point."""

    raising: Optional[BaseException]

    def fail(self, entry: str, error: BaseException) -> None: ...


@contextlib.contextmanager
def fault_at(entry: str) -> Iterator[None]:
    """While the block runs, the entry point ``entry`` (one of :data:`ENTRY_POINTS`) raises
    :class:`InjectedFault` each time it is reached, as an internal error would."""
    if entry not in ENTRY_POINTS:
        raise ValueError(f"unknown entry point {entry!r}; entry points are: {', '.join(sorted(ENTRY_POINTS))}")
    with _lock:
        _faults.add(entry)
    try:
        yield
    finally:
        with _lock:
            _faults.discard(entry)


def check(entry: str) -> None:
    """Raises the injected fault of ``entry``, if any (the guard calls it; so do entry points
    that guard themselves)."""
    if _faults and entry in _faults:
        raise InjectedFault(f"fault injected at {entry}")


def guarded(owner: Owner, entry: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    """``fn`` (called with positional arguments) under the guard: an error is handed to
    ``owner.fail(entry, error)`` and the call returns None."""

    def call(*args: Any) -> Any:
        try:
            if _faults and entry in _faults:
                raise InjectedFault(f"fault injected at {entry}")
            return fn(*args)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            if e is owner.raising:
                raise
            owner.fail(entry, e)
            return None

    call.__wrapped__ = fn  # type: ignore[attr-defined]
    call.__qualname__ = f"guarded({getattr(fn, '__qualname__', entry)})"
    return call
