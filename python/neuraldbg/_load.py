"""``neuraldbg.load``: a trace opened from Python, with the members of a live ``NeuralDbg``."""

from __future__ import annotations

import json
import os
import warnings
from typing import Any, Dict, List, Optional, Union

from . import _native
from ._results import Results
from .errors import ConfigError, NeuralDbgWarning, TraceError

__all__ = ["TraceRun", "load"]


class TraceRun(Results):
    """A run read back from its trace: the same diagnosis members as the live ``dbg``
    (``events``, ``explain_failure()``, ``history()``, ``save_report()``, ``to_pandas()``...),
    exactly what the live run answered, since the trace holds the engine's inputs.

    Create one with :func:`neuraldbg.load`.
    """

    def __init__(self, engine: Any, facts: Dict[str, Any]) -> None:
        self._engine = engine
        self.path: str = str(facts["path"])
        """The trace file."""
        self.closed: bool = bool(facts["closed"])
        """Whether the writer closed the trace (False: the run was killed or crashed, or the
        trace is damaged; every complete step is still used)."""
        self.damage: Optional[str] = facts["damage"]
        """Where reading stopped early and why, when the trace is damaged; else None."""
        self.meta: Dict[str, Any] = dict(facts["meta"])
        """What the writer recorded about the run (producer, versions, model class, start
        time, process id and host)."""
        self.steps_observed: int = int(facts["steps"])
        """Steps recorded in the trace."""
        self.unobserved: List[str] = list(facts.get("unobserved", []))
        """Steps the run took that were not observed, and why (monitoring stopped: a rank
        left, an internal error), one sentence each; empty when every step was observed."""

    @property
    def step(self) -> int:
        """Completed steps recorded: the last recorded step + 1 (0 when none was), what the
        live ``dbg.step`` read after the same run's last step."""
        last = self._engine.last_step
        return 0 if last is None else int(last) + 1

    def _title(self) -> str:
        return f"NeuralDBG report: {os.path.basename(self.path)}"

    def __repr__(self) -> str:
        model = self.meta.get("model", "model")
        state = "closed" if self.closed else ("damaged" if self.damage else "not closed")
        return f"TraceRun({self.path!r}, {model}, {self.steps_observed} steps, {state})"


def _steps(n: int) -> str:
    return {0: "no step", 1: "1 step"}.get(n, f"{n} steps")


def load(path: Union[str, os.PathLike[str]]) -> TraceRun:
    """Opens a trace written by ``NeuralDbg(model, trace=path)``, to analyse a run that trained
    elsewhere (or was killed): the result has the members of a live ``dbg``.

    A trace that is still being written gives the steps written so far. A damaged trace is
    read up to the damage, with a :class:`~neuraldbg.NeuralDbgWarning` saying where.

    Raises:
        TraceError: the file cannot be read, is not a trace, was written by a newer NeuralDBG,
            holds no training step, or is damaged before its first step.
    """
    if not isinstance(path, (str, os.PathLike)):
        raise ConfigError(f"path must be a file path, got {type(path).__qualname__}")
    engine, facts_json = _native.Engine.load_trace(os.fspath(path))
    facts = json.loads(facts_json)
    if facts["damage"] is not None and not facts["steps"]:
        raise TraceError(
            f"{facts['path']} is damaged before its first step ({facts['damage']}): no step can be read "
            "(two processes writing one file? each rank of a job writes its own with trace_rank=None)"
        )
    if facts["damage"] is not None:
        warnings.warn(
            f"{facts['path']} is damaged at {facts['damage']}; using the {_steps(facts['steps'])} before it",
            NeuralDbgWarning,
            stacklevel=2,
        )
    for gap in facts.get("unobserved", []):
        warnings.warn(f"{facts['path']}: {gap}", NeuralDbgWarning, stacklevel=2)
    return TraceRun(engine, facts)
