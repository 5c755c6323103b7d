"""What the framework callbacks share: one watched run whose trace and report go into the run's
directory, the halt hook, and the summary they hand to the framework's logger. Framework-free:
the callbacks in :mod:`neuraldbg.lightning` and :mod:`neuraldbg.transformers` only adapt events."""

from __future__ import annotations

import functools
import os
import warnings
from typing import Any, Callable, Dict, Iterable, List, Optional, TypeVar, Union, cast

from ._guard import REPORT, check
from .debugger import NeuralDbg
from .errors import ConfigError, ModelError, NeuralDbgWarning
from .types import CausalHypothesis

TRACE_NAME = "neuraldbg.ndbg"
REPORT_NAME = "neuraldbg.html"

PathOption = Union[bool, str, "os.PathLike[str]"]


def _path(option: PathOption, directory: str, name: str) -> Optional[str]:
    if option is False or option is None:
        return None
    if option is True:
        return os.path.join(directory, name)
    return os.fspath(option)


class WatchedRun:
    """One ``NeuralDbg`` opened by a callback: entered at the start of training, exited at the
    end (or when training raises)."""

    def __init__(
        self,
        model: Any,
        directory: str,
        *,
        trace: PathOption,
        report: PathOption,
        halt_on: Any,
        on_failure: Optional[Callable[[List[CausalHypothesis]], Any]],
        stop: Callable[[], None],
        options: Dict[str, Any],
    ) -> None:
        self.trace_path = _path(trace, directory, TRACE_NAME)
        self.report_path = _path(report, directory, REPORT_NAME)
        self.dbg = NeuralDbg(
            model, trace=self.trace_path, report=self.report_path, halt_on=halt_on, on_failure=on_failure, **options
        )
        self.dbg._on_halt = lambda hyps: stop()
        self.dbg.__enter__()
        self.open = True

    def close(self, exc: Optional[BaseException] = None) -> None:
        if self.open:
            self.open = False
            self.dbg.__exit__(type(exc) if exc is not None else None, exc, None)


F = TypeVar("F", bound=Callable[..., Any])


def guarded_callback(method: F) -> F:
    """A framework callback's ``on_*`` method under the guard (see ``_guard.py``): an internal
    error ends monitoring with one warning (what was observed is still written), never the
    trainer's run. The user's own mistakes in the options (:class:`ConfigError`,
    :class:`ModelError`) still raise."""

    @functools.wraps(method)
    def call(self: CallbackCore, *args: Any, **kwargs: Any) -> Any:
        try:
            check("callback")
            return method(self, *args, **kwargs)
        except (KeyboardInterrupt, SystemExit, ConfigError, ModelError):
            raise
        except BaseException as e:
            self.fail("callback", e)
            return None

    return cast(F, call)


class CallbackCore:
    """The options and the watched run of a framework callback.

    Every process of a distributed job opens its run (the job-wide exchange needs every rank,
    and a halt must stop every rank at the same step): only rank 0 writes the report, and the
    trace follows ``trace_rank`` (rank 0 unless set)."""

    def __init__(
        self,
        *,
        trace: PathOption = True,
        report: PathOption = True,
        halt_on: Any = None,
        on_failure: Optional[Callable[[List[CausalHypothesis]], Any]] = None,
        verbose: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self.trace = trace
        self.report = report
        self.halt_on = halt_on
        self.on_failure = on_failure
        self.verbose = verbose
        self.options = options
        self._run: Optional[WatchedRun] = None
        self.dbg: Optional[NeuralDbg] = None
        # The guard's owner protocol (see _guard.py): a callback raises nothing on purpose.
        self.raising: Optional[BaseException] = None
        self.failed = False

    def fail(self, entry: str, error: BaseException) -> None:
        """An internal error in ``entry``: say so once, stop watching (the trace and report of
        the steps observed so far are written), and let training go on."""
        if self.failed:
            return
        self.failed = True
        step = self.dbg.step if self.dbg is not None else 0
        warnings.warn(
            f"NeuralDBG stopped observing at step {step} after an internal error in {entry}: "
            f"{type(error).__name__}: {error}. Training goes on unobserved; "
            + (f"steps 0 to {step - 1} are diagnosed and written. " if step else "")
            + f"This is a bug in NeuralDBG: {REPORT}",
            NeuralDbgWarning,
            stacklevel=3,
        )
        try:
            self.close()
        except Exception:  # pragma: no cover - nothing more to do; training goes on (a Ctrl-C is raised)
            self._run = None

    def log_metrics(self, log: Callable[[Dict[str, float]], None], layers: bool) -> None:
        """Hands the verdict's numbers to the framework's logging (``log``), guarded."""
        dbg = self.dbg
        if dbg is None or self.failed:
            return
        try:
            check("log_metrics")
            numbers = metrics(dbg, layers)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as e:
            self.fail("log_metrics", e)
            return
        log(numbers)

    def _open(self, model: Any, directory: str, zero: bool, stop: Callable[[], None]) -> None:
        """Starts watching ``model`` (``zero``: this is the job's rank 0, or the only process)."""
        self.close()
        self._run = WatchedRun(
            model,
            directory,
            trace=self.trace,
            report=self.report if zero else False,
            halt_on=self.halt_on,
            on_failure=self.on_failure,
            stop=stop,
            options=self.options,
        )
        self.dbg = self._run.dbg

    def close(self, exc: Optional[BaseException] = None) -> None:
        """Ends the observation: hooks removed, trace closed, report written."""
        if self._run is not None:
            self._run.close(exc)
            self._run = None


def verdict(dbg: NeuralDbg) -> List[CausalHypothesis]:
    """Confirmed hypotheses (confidence >= 0.5), most likely first."""
    return [h for h in dbg.explain_failure() if h.confidence >= 0.5]


def metrics(dbg: NeuralDbg, layers: bool) -> Dict[str, float]:
    """Numbers for the framework's logger: how many failures are confirmed and the top
    confidence; with ``layers``, each layer's latest gradient norm (the per-layer summary)."""
    confirmed = verdict(dbg)
    out: Dict[str, float] = {
        "neuraldbg/failures": float(len({(str(h.failure), h.layer) for h in confirmed})),
        "neuraldbg/confidence": float(confirmed[0].confidence) if confirmed else 0.0,
        "neuraldbg/step": float(dbg.step),
    }
    if layers:
        for name in layer_names(dbg):
            _, values = dbg.history(name, "grad_norm")
            if len(values) and values[-1] >= 0:  # (-1: no gradient yet, a frozen layer)
                out[f"neuraldbg/grad_norm/{name or '<model>'}"] = float(values[-1])
    return out


def layer_names(dbg: NeuralDbg) -> Iterable[str]:
    """The layers the engine knows, in model order: the modules that own parameters (a module
    that only shares another's, a tied output head, is reported under the owner's name)."""
    collector = dbg._collector
    if collector is None or not collector.registered:
        return []
    watched = collector.watched
    return [watched.names[i] for i in sorted(set(watched.param_owner))]


def summary(dbg: NeuralDbg, where: Optional[str]) -> str:
    """The diagnosis as printed at the end of training."""
    confirmed = verdict(dbg)
    lines = [f"NeuralDBG: {dbg.step} steps observed"]
    if confirmed:
        lines.append("training failed:")
        lines.extend(f"  {h}" for h in confirmed[:5])
        for r in confirmed[0].remedies[:3]:
            lines.append(f"  - {r}")
    else:
        lines.append("no failure detected")
    if where:
        lines.append(f"trace and report: {where}")
    return "\n".join(lines)


def verdict_text(dbg: NeuralDbg) -> str:
    confirmed = verdict(dbg)
    return str(confirmed[0]) if confirmed else "healthy"
