"""``NeuralDbg``: the context manager researchers wrap around an unchanged training loop."""

from __future__ import annotations

import json
import math
import numbers
import os
import platform
import socket
import time
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, Iterable, List, Literal, Optional, Set, Tuple, Union

from . import _native
from ._guard import check
from ._results import Results, newly_confirmed
from .errors import ConfigError, ModelError, NeuralDbgError, NeuralDbgWarning, TrainingFailure
from .types import CausalHypothesis, Failure

if TYPE_CHECKING:  # pragma: no cover
    import torch

__all__ = ["NeuralDbg"]

_DEFAULTS: Dict[str, Any] = json.loads(_native.default_config_json())
_FORWARD_CHECKS = ("auto", "lazy", "off")
_STEP_ON = ("optimizer", "each_optimizer", "backward")
_DISTRIBUTED = ("auto", "off")


def _not_a_module(model: Any, torch: Any) -> str:
    """What to watch instead of ``model``, which is not a ``torch.nn.Module``."""
    kind = type(model)
    said = f"NeuralDbg watches a torch.nn.Module, got {kind.__module__}.{kind.__qualname__}"
    root = kind.__module__.split(".")[0]
    if root in ("flax", "jax", "jaxlib"):
        return f"{said}: for a flax or JAX model use `from neuraldbg.jax import NeuralDbg` (docs/jax-keras.md)"
    if root in ("keras", "tf_keras", "tensorflow"):
        return f"{said}: for Keras give `model.fit` a `neuraldbg.keras.NeuralDbgCallback()` (docs/jax-keras.md)"
    items = list(model.values()) if isinstance(model, dict) else model if isinstance(model, (list, tuple)) else [model]
    if items and all(isinstance(t, torch.Tensor) for t in items):
        return (
            f"{said}: NeuralDBG observes a model's layers, and weights kept as bare tensors have none. "
            "Build the model from torch.nn layers (nn.Linear(784, 10) holds a weight and a bias) and "
            "watch it: NeuralDbg(model)"
        )
    if items and all(isinstance(m, torch.nn.Module) for m in items):
        return (
            f"{said}: modules trained together as one model are watched as one, "
            "NeuralDbg(torch.nn.ModuleList([encoder, decoder])); models trained against each other "
            "(a GAN's two) each in their own, `with NeuralDbg(g) as dg, NeuralDbg(d) as dd:`"
        )
    return said


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
            steps). On CPU the loss is checked when backward starts; a step that recorded no
            module call (the unmeasured ones) has its forward computed again from its inputs
            then, no grad, buffers and random generator left as they were. On CUDA each module
            call's output and inputs are reduced on the device as it returns (their largest
            magnitude, kept instead of the tensors: no synchronization, no memory held through
            backward, but a second read of every activation: on a GPU, most of what watching a
            convolutional network costs). ``"off"``: no per-call reads (the origin of a NaN is
            then located from gradients only).
        step_on: ``"optimizer"`` (default) counts a step per ``optimizer.step()`` (several
            optimizers stepped after one backward pass are one step); ``"each_optimizer"`` counts
            every ``optimizer.step()``, also several in one iteration (what Lightning's manual
            optimization calls ``global_step``; its callback sets it); ``"backward"`` counts one
            per backward pass, for loops without a torch optimizer (one that updates the weights
            by hand is found before its first step and counted so without it).
        halt_on: stop training once a failure is confirmed (opt-in): ``True`` for any failure
            (a hypothesis with confidence >= 0.5), a number for any failure at least that
            confident, or failure names (``"non_finite"``, :class:`~neuraldbg.Failure`, or a list
            of them). A plain loop gets :class:`~neuraldbg.TrainingFailure`, raised from the
            ``optimizer.step()`` that confirmed it (on a GPU, whose statistics reach the host
            a step later without waiting for it: from the first forward pass or optimizer step
            after they did), after the block has exited (trace closed, report written); the
            framework callbacks stop the trainer instead.
        on_failure: called with the list of newly confirmed hypotheses each time a failure is
            confirmed (once per failure and layer), from the step that confirmed it. Looked up
            only when the engine records a new event, so it costs nothing on healthy steps.
        report: a file path: the HTML report (:meth:`save_report`) is written there on exit,
            also when the loop raised or was halted.
        trace: a file path (``"runs/x.ndbg"``) to record the run to while it trains, for
            ``neuraldbg explain runs/x.ndbg`` and the other commands after the run, even if it
            crashed or was killed: every completed step is on disk as soon as it is observed.
            Missing directories are created; an existing file is replaced. The trace is closed
            on ``__exit__``, also when the loop raises. Format: docs/trace-format.md. In a
            distributed job only rank ``trace_rank`` writes it.
        distributed: ``"auto"`` (default): when ``torch.distributed`` is initialized with more
            than one process, statistics are job-wide (the norm of each layer's full, reduced
            gradient under DDP, FSDP2 and HSDP; every rank's input batch, loss and NaN origin,
            named with its rank) at one extra collective per step, and every rank's debugger
            gives the same diagnosis. Every rank must enter its ``with NeuralDbg(...)`` block.
            ``"off"``: each rank watches only itself.
        distributed_timeout: seconds a rank waits for the others' statistics before it stops
            observing with a warning (a rank that crashed or left the block); training goes on.
        trace_rank: the rank that writes ``trace`` (default 0); None: every rank writes its
            own, ``run.ndbg`` becoming ``run.rank3.ndbg``.
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
        model: torch.nn.Module,
        *,
        threshold_vanishing: float = 1e-6,
        threshold_exploding: float = 1e3,
        threshold_saturated: float = 1.0,
        criterion: Optional[torch.nn.Module] = None,
        activation_every: int = 10,
        weight_every: int = 10,
        dense_steps: int = 10,
        forward_check: str = "auto",
        step_on: str = "optimizer",
        trace: Union[str, os.PathLike[str], None] = None,
        halt_on: Union[bool, float, str, Iterable[str], None] = None,
        on_failure: Optional[Callable[[List[CausalHypothesis]], Any]] = None,
        report: Union[str, os.PathLike[str], None] = None,
        distributed: str = "auto",
        distributed_timeout: float = 60.0,
        trace_rank: Optional[int] = 0,
        **engine_options: Any,
    ) -> None:
        try:
            import torch
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ModelError("NeuralDbg needs PyTorch: pip install torch") from e
        if not isinstance(model, torch.nn.Module):
            raise ModelError(_not_a_module(model, torch))
        # torch.compile(model) returns a wrapper whose only child is the model: watch the model
        # (its own names; its hooks are traced into the compiled graph).
        inner = getattr(model, "_orig_mod", None)
        if isinstance(inner, torch.nn.Module) and type(model).__name__ == "OptimizedModule":
            model = inner
        if isinstance(model, torch.jit.ScriptModule):
            raise ModelError(
                f"NeuralDbg cannot watch a TorchScript model ({type(model).__name__}): TorchScript "
                "modules take no Python hooks. Watch the nn.Module before torch.jit.script (scripted "
                "submodules inside a plain model are fine: they are watched from around)"
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
        if distributed not in _DISTRIBUTED:
            raise ConfigError(f"distributed must be one of {_DISTRIBUTED}, got {distributed!r}")
        timeout = _number("distributed_timeout", distributed_timeout)
        if not timeout > 0 or not math.isfinite(timeout):
            raise ConfigError(f"distributed_timeout must be a positive number of seconds, got {distributed_timeout!r}")
        if trace_rank is not None and (
            isinstance(trace_rank, bool) or not isinstance(trace_rank, int) or trace_rank < 0
        ):
            raise ConfigError(f"trace_rank must be a rank (an integer >= 0) or None, got {trace_rank!r}")
        if trace is not None and not isinstance(trace, (str, os.PathLike)):
            raise ConfigError(f"trace must be a file path or None, got {type(trace).__qualname__}")
        trace_path = None if trace is None else os.fspath(trace)
        if trace_path is not None and (not isinstance(trace_path, str) or not trace_path):
            raise ConfigError(f"trace must be a non-empty file path, got {trace!r}")
        self._engine = _engine(threshold_vanishing, threshold_exploding, threshold_saturated, engine_options)
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
        self._distributed = distributed
        self._distributed_timeout = timeout
        self._trace_rank = trace_rank
        self._collector: Any = None
        self._active = False
        # Why no step was observed, when the loop shows it, and what to do (see _no_step).
        self._no_step: Optional[Tuple[str, str]] = None
        if on_failure is not None and not callable(on_failure):
            raise ConfigError(f"on_failure must be callable, got {type(on_failure).__qualname__}")
        if report is not None and not isinstance(report, (str, os.PathLike)):
            raise ConfigError(f"report must be a file path or None, got {type(report).__qualname__}")
        self._report_path: Optional[str] = None if report is None else os.fspath(report)  # type: ignore[assignment]
        self._halt = _halt_rule(halt_on)
        self._on_failure = on_failure
        # What a halt does: None raises TrainingFailure (plain loops); the callbacks set it to
        # stop their trainer instead.
        self._on_halt: Optional[Callable[[List[CausalHypothesis]], None]] = None
        self._events_seen = 0
        self._confirmed: Set[Tuple[str, Optional[str]]] = set()
        self.halted: Optional[List[CausalHypothesis]] = None
        """The hypotheses that halted training (``halt_on``), or None."""

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> NeuralDbg:
        if self._active:
            raise NeuralDbgError("this NeuralDbg is already active; use one `with` block per debugger")
        if self._collector is not None:
            raise NeuralDbgError("a NeuralDbg watches one training run; create a new NeuralDbg for another run")
        from . import _distributed
        from ._collect import Collector

        where = _distributed.rank_and_world()
        job = self._join(where) if where is not None and self._distributed == "auto" else None
        trace_path = self._rank_trace(where)
        if trace_path is not None:
            # Opened before any hook is installed, so a bad path leaves nothing behind.
            meta = self._trace_meta()
            if where is not None:
                meta.update(rank=where[0], world_size=where[1])
            if job is not None:
                meta.update(backend=job.backend)
            self._engine.open_trace(trace_path, json.dumps(meta))
        try:
            watch = self._halt is not None or self._on_failure is not None
            self._collector = Collector(
                self.model,
                self._engine,
                on_observed=self._after_step if watch else None,
                distributed=job,
                **self._options,
            )
            self._collector.install()
        except BaseException as e:
            # Nothing of ours stays installed: no hook, no tap, no kept tensor.
            if self._collector is not None:
                try:
                    self._collector.remove()
                except Exception:  # pragma: no cover - the first error is the one to report
                    pass
                self._collector = None
            self._close_trace()
            if isinstance(e, NeuralDbgError) or not isinstance(e, Exception):
                raise
            raise ModelError(
                f"NeuralDbg could not install its hooks on {type(self.model).__name__}: {type(e).__name__}: {e}"
            ) from e
        self._active = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        collector = self._collector
        try:
            if collector is not None:
                check("exit")
                roster = getattr(collector.dist, "roster", None)
                if roster is not None:  # the other ranks stop waiting for this one
                    roster.leave(int(collector.step), None if exc is None else repr(exc))
                # Ctrl-C is the user stopping the run, not the run failing: a forward it cut
                # short is no step (dbg.step and the trace's step count agree).
                crashed = exc_type is not None and not issubclass(exc_type, KeyboardInterrupt)
                self._no_step = (
                    None if int(collector.step) or crashed else _no_step(collector, type(self.model).__name__)
                )
                collector.boundary.finish(crashed=crashed)
                self._record_unobserved(collector)
        except Exception as e:  # never raise from the exit of the user's block
            if collector is not None:
                collector.fail("exit", e)
        finally:
            try:
                if collector is not None:
                    collector.remove()
            finally:
                self._active = False
                self._close_trace()
                self._write_report()
        return False  # never swallow the user's exception

    # ---------------------------------------------------------------- distributed set-up

    def _join(self, where: Tuple[int, int]) -> Any:
        """The job's distributed side once every rank entered its block, or None (with one
        warning naming the ranks that did not) after a short wait: this rank is then watched
        on its own."""
        from . import _distributed

        wait = min(_distributed.ENTER_WAIT, self._distributed_timeout)
        roster, late = _distributed.Roster.join(where[0], where[1], wait)
        if late is not None:
            warnings.warn(late, NeuralDbgWarning, stacklevel=3)
            return None
        return _distributed.Distributed(self._distributed_timeout, roster)

    def _rank_trace(self, where: Optional[Tuple[int, int]]) -> Optional[str]:
        """The trace this rank writes in a job of several processes (``where``: rank and world
        size): rank ``trace_rank``'s, or each rank its own with ``trace_rank=None``; never one
        file written by several ranks at once (with ``distributed="off"`` too)."""
        from . import _distributed

        path = self._trace_path
        if path is None or where is None:
            return path
        rank, world = where
        if self._trace_rank is None:
            return _distributed.rank_path(path, rank)
        writer = self._trace_rank
        if writer >= world:
            writer = 0
            if rank == 0:
                warnings.warn(
                    f"trace_rank={self._trace_rank} is not a rank of this job (ranks 0 to {world - 1}): "
                    f"rank 0 writes {path} instead; pass trace_rank between 0 and {world - 1}, or "
                    f"trace_rank=None for one trace per rank ({_distributed.rank_path(path, rank)}, ...)",
                    NeuralDbgWarning,
                    stacklevel=4,
                )
        elif self._distributed == "off" and rank == writer:
            warnings.warn(
                f'distributed="off": each rank is watched on its own, and only rank {writer} '
                f"(trace_rank) writes {path}; pass trace_rank=None for one trace per rank "
                f"({_distributed.rank_path(path, rank)}, ...)",
                NeuralDbgWarning,
                stacklevel=4,
            )
        return path if rank == writer else None

    def _record_unobserved(self, collector: Any) -> None:
        """When monitoring stopped before the run ended, the trace records the steps it did not
        see and why (readers say so instead of taking its last step for the run's end)."""
        error = getattr(collector, "internal_error", None)
        if error is None:
            return
        last = self._engine.last_step
        first = 0 if last is None else int(last) + 1
        end = int(collector.step)  # optimizer steps completed, also those not observed
        if end <= first:
            return
        from ._distributed import CollectiveError, StoppedElsewhere

        why = str(error)
        if not isinstance(error, (CollectiveError, StoppedElsewhere)):
            why = f"monitoring stopped after an internal error ({type(error).__name__}: {error})"
        try:
            self._engine.record_unobserved(first, end - 1, why)
        except Exception:  # pragma: no cover - recorded best effort, never the user's problem
            pass

    def _write_report(self) -> None:
        if self._report_path is None or self._collector is None:
            return
        try:
            directory = os.path.dirname(self._report_path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self.save_report(self._report_path)
        except Exception as e:  # never replace the user's exception
            warnings.warn(f"NeuralDBG could not write the report: {e}", NeuralDbgWarning, stacklevel=3)

    def _after_step(self, step: int) -> None:
        """After each observed step (only with ``halt_on``/``on_failure``): when the engine has
        recorded new events, the hypotheses confirmed so far; new ones go to ``on_failure``, and
        one that ``halt_on`` names halts training."""
        n = self._engine.event_count
        if n == self._events_seen:
            return
        self._events_seen = n
        confirmed, new = newly_confirmed(self._engine, self._confirmed)
        if not new:
            return
        collector = self._collector
        if self._on_failure is not None:
            try:
                self._on_failure(new)
            except BaseException as e:  # the user's own error: raised from the step, as theirs
                collector.halt = e
                return
        if self.halted is None and self._halt is not None:
            hit = [h for h in confirmed if self._halt(h)]
            if hit:
                self.halted = hit
                if self._on_halt is not None:
                    self._on_halt(hit)
                else:
                    collector.halt = TrainingFailure(hit, step)

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
        if self._no_step is not None:
            why, fix = self._no_step
            where = f" (the trace {summary[0]} holds no step)" if summary is not None else ""
            warnings.warn(f"{why}{where}. {fix}", NeuralDbgWarning, stacklevel=3)
        elif summary is not None and not summary[3]:
            warnings.warn(
                f"the trace {summary[0]} holds no model header: no training step was observed "
                "(no optimizer.step() on the model's parameters), so there is nothing to replay",
                NeuralDbgWarning,
                stacklevel=3,
            )

    # ---------------------------------------------------------------- observation

    @property
    def _untrained(self) -> Optional[str]:
        """After the block, why no step was observed, when the loop shows it (None otherwise)."""
        return None if self._no_step is None else self._no_step[0]

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
        self._collector.entry_record_loss(loss)

    # ---------------------------------------------------------------- results

    def _sync(self) -> None:
        # On CUDA the last step's statistics reach the engine when the next forward starts;
        # results read mid-training include it.
        if self._collector is not None and self._active:
            self._collector.boundary.flush()

    def _title(self) -> str:
        return f"NeuralDBG report: {type(self.model).__name__}"

    def __repr__(self) -> str:
        state = "active" if self._active else ("finished" if self._collector is not None else "idle")
        return f"NeuralDbg({type(self.model).__name__}, step={self.step}, {state})"


def _engine(vanishing: Any, exploding: Any, saturated: Any, engine_options: Dict[str, Any]) -> Any:
    """The engine of one watched run: the seed's thresholds and any other engine setting
    (ConfigError for an unknown name; the engine validates the values, naming the offender)."""
    unknown = sorted(set(engine_options) - set(_DEFAULTS))
    if unknown:
        raise ConfigError(f"unknown option(s) {', '.join(unknown)}; engine options are: {', '.join(sorted(_DEFAULTS))}")
    config = _engine_config(
        dict(
            engine_options,
            threshold_vanishing=vanishing,
            threshold_exploding=exploding,
            threshold_saturated=saturated,
        )
    )
    return _native.Engine(json.dumps(config))


def _number(name: str, value: Any) -> float:
    """A real number option (Python or numpy scalar) as a float; NaN is no setting."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise ConfigError(f"{name} must be a number, got {type(value).__qualname__} {value!r}")
    out = float(value)
    if math.isnan(out):
        raise ConfigError(f"{name} must be a number, got nan")
    return out


def _engine_config(options: Dict[str, Any]) -> Dict[str, Any]:
    """The engine's settings as plain JSON numbers, each checked against the kind of its
    default (an integer or a finite number): Python and numpy scalars alike, and a message
    naming the option, rather than a JSON encoder's or parser's. Ranges are the engine's."""
    out: Dict[str, Any] = {}
    for name, value in options.items():
        default = _DEFAULTS[name]
        if isinstance(default, bool) or not isinstance(default, (int, float)):
            out[name] = value  # not a number: the engine checks it
        elif isinstance(default, int):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                raise ConfigError(
                    f"{name} must be a whole number (an integer >= 0, default {default}), "
                    f"got {type(value).__qualname__} {value!r}"
                )
            if int(value) < 0:
                raise ConfigError(f"{name} must be an integer >= 0 (default {default}), got {int(value)}")
            out[name] = int(value)
        else:
            number = _number(name, value)
            if not math.isfinite(number):
                raise ConfigError(f"{name} must be a finite number (default {default}), got {number}")
            out[name] = number
    return out


def _no_step(collector: Any, name: str) -> Optional[Tuple[str, str]]:
    """A run that ended without a step observed: why, as the loop shows it, and what to do
    (None when it does not show: no forward pass with gradients on at all)."""
    if collector.cur.grad_read:
        return (
            f"backward passes gave {name} gradients, but no optimizer.step() on its parameters followed: it did not train",
            "Call optimizer.step() after loss.backward(), with an optimizer built from model.parameters()",
        )
    if collector.idle_steps:
        return (
            f"the optimizer holding {name}'s parameters stepped {collector.idle_steps} times, but {name} ran no "
            "forward pass and got no gradient: the loop trains another model",
            "Was the model re-created (or copied) after the optimizer was made? Build the optimizer from the "
            "parameters of the model the loop calls",
        )
    if not any(p.requires_grad for p in collector.params):
        return (
            f"{name} has no parameter that requires a gradient (frozen, or none at all): nothing in it trained",
            "Watch the model the optimizer trains (for a frozen backbone, the head: NeuralDbg(head)), or unfreeze "
            "it: model.requires_grad_(True)",
        )
    if collector.loop.grad_forwards:
        return (
            f"{name} ran {collector.loop.grad_forwards} forward passes with gradients on, but no backward pass "
            "reached its parameters' .grad",
            "NeuralDBG reads the gradients loss.backward() leaves in .grad; gradients taken with "
            "torch.autograd.grad(...) are not seen (for evaluation alone, run it under torch.no_grad())",
        )
    return None


def _halt_rule(halt_on: Any) -> Optional[Callable[[CausalHypothesis], bool]]:
    """``halt_on`` as a test of one confirmed hypothesis (None: never halt)."""
    if halt_on is None or halt_on is False:
        return None
    if halt_on is True:
        return lambda h: True
    if isinstance(halt_on, (int, float)) and not isinstance(halt_on, bool):
        if not 0.0 <= float(halt_on) <= 1.0:
            raise ConfigError(f"halt_on as a confidence must be in [0, 1], got {halt_on!r}")
        least = float(halt_on)
        return lambda h: h.confidence >= least
    names = [halt_on] if isinstance(halt_on, str) else list(halt_on)
    known = {str(f) for f in Failure}
    wanted = set()
    for n in names:
        name = str(n)
        if name not in known:
            raise ConfigError(f"halt_on: unknown failure {name!r}; failures are: {', '.join(sorted(known))}")
        wanted.add(name)
    return lambda h: str(h.failure) in wanted
