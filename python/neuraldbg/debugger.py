"""``NeuralDbg``: the context manager researchers wrap around an unchanged training loop."""

from __future__ import annotations

import json
import os
import platform
import socket
import time
import warnings
from typing import TYPE_CHECKING, Any, Dict, Literal, Optional, Union

from . import _native
from .errors import ConfigError, ModelError, NeuralDbgError, NeuralDbgWarning
from ._results import Results

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NeuralDbg"]

_DEFAULTS: Dict[str, Any] = json.loads(_native.default_config_json())
_FORWARD_CHECKS = ("auto", "lazy", "off")
_STEP_ON = ("optimizer", "backward")


class NeuralDbg(Results):
    """Watches one model's training and explains why it failed.

    Use it as a context manager around an unchanged training loop::

        with NeuralDbg(model) as dbg:
            for x, y in loader:
                optimizer.zero_grad()
                loss = criterion(model(x), y)
                loss.backward()
                optimizer.step()
        for h in dbg.explain_failure():
            print(h)

    Hooks are installed on ``__enter__`` and removed on ``__exit__`` (also when the loop
    raises; the exception propagates unchanged). Only ``model`` is observed: other models and
    optimizers in the process are untouched. Steps are counted automatically at each
    ``optimizer.step()`` of an optimizer that holds the model's parameters; several backward
    passes before one optimizer step (gradient accumulation) are one step.

    Args:
        model: the ``torch.nn.Module`` to watch.
        threshold_vanishing: a layer gradient norm below this is VANISHING (seed default 1e-6).
        threshold_exploding: above this it is EXPLODING (1e3).
        threshold_saturated: above this (and not exploding) it is SATURATED, a warning (1.0).
        criterion: the loss module (e.g. ``nn.CrossEntropyLoss()``) used in the loop. When given,
            its output is read each step (no extra synchronization: it travels with the
            step's other statistics) and loss divergence and plateaus are diagnosed. Without
            it, call :meth:`record_loss` or go without loss-level diagnosis.
        activation_every: measure activation statistics (saturation, dead units) every this
            many steps after the first ``dense_steps`` (1 = every step). While an activation
            module shows a new, unconfirmed state, every step is measured until it is confirmed
            or dismissed. Gradients, loss, inputs and NaN/Inf are watched on every step
            regardless.
        weight_every: measure parameter norms every this many steps after ``dense_steps``.
        dense_steps: steps at the start that are always fully measured.
        forward_check: ``"auto"``/``"lazy"``: when a step's loss is NaN/Inf, scan that step's
            module outputs in forward order for the first non-finite one (free on healthy
            steps). On CPU the loss is checked when backward starts and the outputs are let go
            there; on CUDA they are kept until the step's statistics reach the host, when the
            next forward starts (more memory during backward, no synchronization). ``"off"``:
            don't keep outputs (the origin of a NaN is then located from gradients only).
        step_on: ``"optimizer"`` (default) counts a step per ``optimizer.step()``;
            ``"backward"`` counts one per backward pass, for loops without a torch optimizer.
        trace: a file path (``"runs/x.ndbg"``) to record the run to while it trains, for
            ``neuraldbg explain runs/x.ndbg`` and the other commands after the run, even if it
            crashed or was killed: every completed step is on disk as soon as it is observed.
            Missing directories are created; an existing file is replaced. The trace is closed
            on ``__exit__``, also when the loop raises. Format: docs/trace-format.md.
        **engine_options: any other engine setting (``persistence``, ``hysteresis``,
            ``activation_dead_fraction``, ``history_capacity``, ...; see :attr:`DEFAULTS`).

    Raises:
        ModelError: ``model`` is not a ``torch.nn.Module``.
        ConfigError: an option is out of range (e.g. a negative threshold, or
            ``threshold_vanishing >= threshold_exploding``), or the trace file cannot be
            created (raised by ``__enter__``).
    """

    DEFAULTS: Dict[str, Any] = dict(_DEFAULTS)
    """The engine's default settings."""

    def __init__(
        self,
        model: "torch.nn.Module",
        *,
        threshold_vanishing: float = 1e-6,
        threshold_exploding: float = 1e3,
        threshold_saturated: float = 1.0,
        criterion: "Optional[torch.nn.Module]" = None,
        activation_every: int = 10,
        weight_every: int = 10,
        dense_steps: int = 10,
        forward_check: str = "auto",
        step_on: str = "optimizer",
        trace: "Union[str, os.PathLike[str], None]" = None,
        **engine_options: Any,
    ) -> None:
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ModelError("NeuralDbg needs PyTorch: pip install torch") from e
        if not isinstance(model, torch.nn.Module):
            raise ModelError(
                f"NeuralDbg watches a torch.nn.Module, got {type(model).__module__}.{type(model).__qualname__}"
            )
        if criterion is not None and not isinstance(criterion, torch.nn.Module):
            raise ConfigError(
                "criterion must be the loss module used in the loop (e.g. nn.MSELoss()), "
                f"got {type(criterion).__qualname__}; for a functional loss call dbg.record_loss(loss)"
            )
        for name, value, lowest in (
            ("activation_every", activation_every, 1),
            ("weight_every", weight_every, 1),
            ("dense_steps", dense_steps, 0),
        ):
            if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
                raise ConfigError(f"{name} must be an integer >= {lowest}, got {value!r}")
        if forward_check not in _FORWARD_CHECKS:
            raise ConfigError(f"forward_check must be one of {_FORWARD_CHECKS}, got {forward_check!r}")
        if step_on not in _STEP_ON:
            raise ConfigError(f"step_on must be one of {_STEP_ON}, got {step_on!r}")
        if trace is not None and not isinstance(trace, (str, os.PathLike)):
            raise ConfigError(f"trace must be a file path or None, got {type(trace).__qualname__}")
        trace_path = None if trace is None else os.fspath(trace)
        if trace_path is not None and (not isinstance(trace_path, str) or not trace_path):
            raise ConfigError(f"trace must be a non-empty file path, got {trace!r}")
        unknown = sorted(set(engine_options) - set(_DEFAULTS))
        if unknown:
            raise ConfigError(
                f"unknown option(s) {', '.join(unknown)}; engine options are: {', '.join(sorted(_DEFAULTS))}"
            )
        config = dict(engine_options)
        config.update(
            threshold_vanishing=_number("threshold_vanishing", threshold_vanishing),
            threshold_exploding=_number("threshold_exploding", threshold_exploding),
            threshold_saturated=_number("threshold_saturated", threshold_saturated),
        )
        # Validated by the engine; raises ConfigError with the offending name.
        self._engine = _native.Engine(json.dumps(config))
        self.model = model
        self._options: Dict[str, Any] = dict(
            criterion=criterion,
            activation_every=activation_every,
            weight_every=weight_every,
            dense_steps=dense_steps,
            forward_check=forward_check,
            step_on=step_on,
        )
        self._trace_path: Optional[str] = trace_path
        self._collector: Any = None
        self._active = False

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> "NeuralDbg":
        if self._active:
            raise NeuralDbgError("this NeuralDbg is already active; use one `with` block per debugger")
        if self._collector is not None:
            raise NeuralDbgError(
                "a NeuralDbg watches one training run; create a new NeuralDbg for another run"
            )
        from ._collect import Collector

        if self._trace_path is not None:
            # Opened before any hook is installed, so a bad path leaves nothing behind.
            self._engine.open_trace(self._trace_path, json.dumps(self._trace_meta()))
        try:
            self._collector = Collector(self.model, self._engine, **self._options)
            self._collector.install()
        except BaseException:
            self._close_trace()
            raise
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> "Literal[False]":
        collector = self._collector
        try:
            if collector is not None:
                collector.finish(crashed=exc_type is not None)
        finally:
            try:
                if collector is not None:
                    collector.remove()
            finally:
                self._active = False
                self._close_trace()
        return False  # never swallow the user's exception

    def _trace_meta(self) -> Dict[str, Any]:
        """Facts about the run stored in the trace header."""
        import torch

        return {
            "producer": f"neuraldbg {_native.__version__} (python)",
            "python": platform.python_version(),
            "torch": str(torch.__version__),
            "model": type(self.model).__qualname__,
            "started": time.time(),
            # `neuraldbg watch` on this machine tells a killed writer from a slow one.
            "pid": os.getpid(),
            "host": socket.gethostname(),
        }

    def _close_trace(self) -> None:
        """Closes the trace; problems are warnings, never an exception that would replace the
        user's own."""
        try:
            summary = self._engine.close_trace()
        except NeuralDbgError as e:
            warnings.warn(f"NeuralDBG could not close the trace: {e}", NeuralDbgWarning, stacklevel=3)
            return
        if summary is not None and not summary[3]:
            warnings.warn(
                f"the trace {summary[0]} holds no model header: no training step was observed "
                "(no optimizer.step() on the model's parameters), so there is nothing to replay",
                NeuralDbgWarning,
                stacklevel=3,
            )

    # ---------------------------------------------------------------- observation

    @property
    def step(self) -> int:
        """Completed ``optimizer.step()`` calls of the model's optimizer(s) (0 during the first
        iteration)."""
        return 0 if self._collector is None else int(self._collector.step)

    def record_loss(self, loss: Any) -> None:
        """Optionally tells the debugger this iteration's loss (a tensor or a number), for loops
        whose loss is not an ``nn.Module`` given as ``criterion``. No synchronization happens
        here: the value is read with the step's other statistics."""
        if self._collector is None or not self._active:
            raise NeuralDbgError("record_loss() is only meaningful inside the `with NeuralDbg(...)` block")
        self._collector.record_loss(loss)

    # ---------------------------------------------------------------- results

    def _sync(self) -> None:
        # On CUDA the last step's statistics reach the engine when the next forward starts;
        # results read mid-training include it.
        if self._collector is not None and self._active:
            self._collector.flush()

    def _title(self) -> str:
        return f"NeuralDBG report: {type(self.model).__name__}"

    def __repr__(self) -> str:
        state = "active" if self._active else ("finished" if self._collector is not None else "idle")
        return f"NeuralDbg({type(self.model).__name__}, step={self.step}, {state})"


def _number(name: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ConfigError(f"{name} must be a number, got {value!r}")
    return float(value)
