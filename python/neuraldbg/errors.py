"""Exceptions raised by NeuralDBG.

Every error the package raises derives from :class:`NeuralDbgError`, and also from the builtin
exception a caller would naturally catch (``ValueError`` for bad values, ``TypeError`` for a
wrong kind of object), so both ``except NeuralDbgError`` and ``except ValueError`` work.
"""

from __future__ import annotations

from typing import Any, List

__all__ = [
    "ConfigError",
    "EngineError",
    "ModelError",
    "NeuralDbgError",
    "NeuralDbgWarning",
    "TraceError",
    "TrainingFailure",
    "UnknownNameError",
]


class NeuralDbgError(Exception):
    """Base class of every NeuralDBG error."""


class ConfigError(NeuralDbgError, ValueError):
    """An option of :class:`neuraldbg.NeuralDbg` is out of range or inconsistent."""


class ModelError(NeuralDbgError, TypeError):
    """The object to watch is not a ``torch.nn.Module``, or has nothing to watch."""


class EngineError(NeuralDbgError, RuntimeError):
    """The engine was fed inconsistent statistics (a bug in a collector, or a misuse)."""


class UnknownNameError(NeuralDbgError, ValueError):
    """A layer, metric, failure or event name that does not exist."""


class TraceError(NeuralDbgError, OSError):
    """A trace file cannot be read: missing, not a trace, written by a newer NeuralDBG, damaged
    before its first step, or holding no training step."""


class TrainingFailure(NeuralDbgError):
    """Raised from the training step that confirmed a failure named in ``halt_on=`` (plain
    loops; the framework callbacks stop the trainer instead). By the time it reaches the caller
    the ``with NeuralDbg(...)`` block has exited: hooks are removed, the trace is closed and the
    report (``report=``) is written.

    Attributes:
        hypotheses: the confirmed :class:`~neuraldbg.CausalHypothesis` list, most likely first.
        step: the step that confirmed it.
    """

    def __init__(self, hypotheses: List[Any], step: int) -> None:
        self.hypotheses = list(hypotheses)
        self.step = step
        top = str(self.hypotheses[0]) if self.hypotheses else "a failure"
        super().__init__(f"training stopped at step {step}: {top}")


class NeuralDbgWarning(UserWarning):
    """Something NeuralDBG could not observe; training continues unaffected."""
