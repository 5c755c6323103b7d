"""``neuraldbg.run(fn)``: ``neuraldbg run`` for a function that builds and trains, from a
notebook or any Python code."""

from __future__ import annotations

import importlib
import os
import sys
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Union

from ._load import TraceRun, load
from .errors import ConfigError

__all__ = ["RunResult", "resolve", "run"]


@dataclass
class RunResult:
    """What :func:`neuraldbg.run` found. ``hypotheses`` and ``models`` are the objects
    ``neuraldbg run --json`` writes."""

    steps: int
    """Optimizer steps observed (the most any watched model took)."""
    hypotheses: List[Dict[str, Any]]
    """The final ranking, most likely first: ``model``, ``failure``, ``cause``, ``layer``,
    ``step``, ``confidence``, ``description``, ``remedies``, and after ``confirm=True`` the
    ``verdict`` (confirmed, refuted, inconclusive, untested), the ``intervention`` tried and the
    ``evidence`` behind the verdict; confirmed hypotheses first."""
    models: List[Dict[str, Any]]
    """Each watched model: ``name``, ``class``, ``steps``, ``loss_steps``, ``loss``, ``trace``
    and ``report`` (file paths)."""
    out: str
    """The folder holding the traces, reports and the ``confirm/`` runs."""
    exit_code: int
    """What the function's run would exit with as a script: 0, 1 after an exception, 130
    after Ctrl-C, 3 after ``halt_on``, or its ``sys.exit`` status."""
    stopped: Optional[str]
    """Why the run was stopped (``--steps N``, ``halted: ...``, ``interrupted``), or None."""
    exception: Optional[BaseException]
    """The exception the function ended with (its traceback was printed), or None."""
    value: Any
    """What the function returned (None when it did not return)."""
    confirm: Optional[Dict[str, Any]]
    """With ``confirm=True``: the re-runs' ``steps`` and ``runs`` (folder, intervention, exit
    code); else None."""

    @property
    def traces(self) -> Dict[str, str]:
        """Each model's trace file, by model name."""
        return {m["name"]: m["trace"] for m in self.models}

    @property
    def reports(self) -> Dict[str, str]:
        """Each model's HTML report, by model name."""
        return {m["name"]: m["report"] for m in self.models}

    def load(self, model: Optional[str] = None) -> TraceRun:
        """The trace of ``model`` (the only one when None) opened with :func:`neuraldbg.load`."""
        if model is None and len(self.models) != 1:
            raise ConfigError(f"this run watched {len(self.models)} models: name one of {sorted(self.traces)}")
        name = self.models[0]["name"] if model is None else model
        if name not in self.traces:
            raise ConfigError(f"no model {name!r} in this run: it watched {sorted(self.traces)}")
        return load(self.traces[name])

    def __str__(self) -> str:
        lines = [f"{self.steps} steps, {len(self.models)} model(s), outputs in {self.out}"]
        for h in self.hypotheses:
            if h["confidence"] < 0.5 and "verdict" not in h:
                continue
            verdict = f"{h['verdict'].upper():<12} " if "verdict" in h else ""
            lines.append(f"  {verdict}[{h['confidence']:.2f}] {h['failure']} <- {h['cause']} ({h['model']})")
        return "\n".join(lines)


def resolve(spec: str) -> Callable[[], Any]:
    """The function named ``"module:qualname"``, imported."""
    module, colon, qualname = spec.partition(":")
    if not colon or not module or not qualname:
        raise ConfigError(f"a function is named 'module:function' (e.g. 'train:main'), got {spec!r}")
    try:
        obj: Any = importlib.import_module(module)
        for part in qualname.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"cannot import {spec!r}: {e}") from e
    if not callable(obj):
        raise ConfigError(f"{spec!r} is a {type(obj).__qualname__}, not a function")
    return obj  # type: ignore[no-any-return]


def _name_of(fn: Callable[[], Any]) -> str:
    """``"module:qualname"`` of an importable function, or a ConfigError saying why a fresh
    process could not find it."""
    module = getattr(fn, "__module__", None)
    qualname = getattr(fn, "__qualname__", None)
    need = (
        "confirm=True runs the function again in fresh processes, which import it by name: define "
        "it at the top level of a .py file (not in a notebook cell, a lambda or another function) "
        "and import it from there, or pass its name as 'module:function'"
    )
    if not module or not qualname:
        raise ConfigError(f"{need}; {fn!r} has no module and name")
    if module == "__main__":
        raise ConfigError(f"{need}; {qualname} is defined in __main__")
    if "<" in qualname:
        raise ConfigError(f"{need}; {module}.{qualname} is not reachable by name")
    spec = f"{module}:{qualname}"
    if resolve(spec) is not fn:
        raise ConfigError(f"{need}; {spec} names another object than the function given")
    return spec


def _import_root(module: str) -> Optional[str]:
    """The folder to put on a fresh process's path so that ``module`` imports as it did here."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if path is None:
        return None
    root = os.path.dirname(os.path.abspath(path))
    levels = module.count(".") + (1 if os.path.basename(path) == "__init__.py" else 0)
    for _ in range(levels):
        root = os.path.dirname(root)
    return root


def _option_word(key: str, value: Any) -> str:
    """An option as the ``-o KEY=VALUE`` word the re-runs are given."""
    if isinstance(value, bool) or value is None:
        return f"{key}={str(value).lower()}"
    if isinstance(value, (int, float, str)):
        return f"{key}={value!r}" if isinstance(value, float) else f"{key}={value}"
    raise ConfigError(
        f"confirm=True passes the options to fresh processes as text: {key}={value!r} is not a number, "
        "boolean, string or None"
    )


def run(
    fn: Union[Callable[[], Any], str],
    *,
    steps: Optional[int] = None,
    out: Union[str, os.PathLike[str], None] = None,
    confirm: bool = False,
    confirm_steps: Optional[int] = None,
    confirm_top: int = 3,
    jobs: int = 1,
    seed: Optional[int] = 0,
    halt_on: Union[bool, float, str, List[str], None] = None,
    quiet: bool = False,
    **options: Any,
) -> RunResult:
    """Calls ``fn()``, a function of no arguments that builds a model and trains it, and watches
    every model an optimizer trains, as ``neuraldbg run`` does a script: at the end, also after
    an exception or Ctrl-C, the diagnosis is printed and each model's trace and HTML report are
    written to ``out``. The training code is not changed.

    Args:
        fn: the function, or its name as ``"module:function"``.
        steps: stop the function cleanly after this many optimizer steps (None: let it finish).
        out: where traces and reports go (default ``runs/<function>-<time>``).
        confirm: then try the mechanical remedy of each of the top ``confirm_top`` hypotheses,
            each in a fresh process that calls the function again with the same seed for
            ``confirm_steps`` steps (default: the steps this run took), once unchanged and once
            per remedy, ``jobs`` at a time; each hypothesis gets a ``verdict`` (see
            ``neuraldbg run --confirm``). A fresh process imports the function by name, so it
            must be defined at the top level of an importable ``.py`` file (not in a notebook
            cell, a lambda or a nested function); otherwise :class:`~neuraldbg.ConfigError` is
            raised before anything runs.
        seed: set in ``random``, ``numpy`` and ``torch`` before this run and each re-run, so
            they start alike; None leaves the generators as they are.
        halt_on: stop training when a failure is confirmed, as in :class:`~neuraldbg.NeuralDbg`.
        quiet: print only the paths, not the diagnosis.
        **options: any other :class:`~neuraldbg.NeuralDbg` option (e.g.
            ``threshold_vanishing=1e-3``); with ``confirm`` each must be a number, boolean,
            string or None.

    Returns:
        A :class:`RunResult`: the steps, the hypotheses (with their verdicts), the trace and
        report paths, and the function's return value or exception. An exception from ``fn``
        does not propagate: its traceback is printed and it is kept in ``exception``.

    Raises:
        ConfigError: a bad option, or ``confirm=True`` with a function a fresh process cannot
            import.
    """
    from . import _run

    name = fn if isinstance(fn, str) else None
    call = resolve(fn) if isinstance(fn, str) else fn
    if not callable(call):
        raise ConfigError(f"fn must be a function of no arguments, got {type(call).__qualname__}")
    if steps is not None and (isinstance(steps, bool) or not isinstance(steps, int) or steps < 1):
        raise ConfigError(f"steps must be an integer >= 1, got {steps!r}")
    for fixed in ("trace", "report"):
        if fixed in options:
            raise ConfigError(f"{fixed}=... is set by neuraldbg.run (use out=...)")
    _run._check_options(options, halt_on)
    plan = None
    if confirm:
        from ._confirm import Confirm

        name = name if name is not None else _name_of(call)
        words = [_option_word(k, v) for k, v in options.items()]
        # The re-runs import the function, and this neuraldbg, from where this process did.
        here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        roots = [r for r in (_import_root(name.partition(":")[0]), here) if r]
        env = {"PYTHONPATH": os.pathsep.join(dict.fromkeys(roots))}
        plan = Confirm(("module", "neuraldbg._call"), [name], words, confirm_steps, confirm_top, jobs, seed, env)
    stem = getattr(call, "__name__", "function")
    folder = os.fspath(out) if out is not None else os.path.join("runs", f"{stem}-{time.strftime('%Y%m%d-%H%M%S')}")
    if seed is not None:
        _run._seed(seed)
    returned: List[Any] = []
    watch = _run.Watch(folder, dict(options), halt_on, steps, None)
    where = getattr(getattr(call, "__code__", None), "co_filename", None)
    code, stopped, exc = _run._execute(watch, lambda: returned.append(call()), where)
    data = _run._conclude(watch, code, stopped, quiet, plan, None) or _run.results(watch, code, stopped)
    return RunResult(
        steps=int(data["steps"]),
        hypotheses=list(data["hypotheses"]),
        models=list(data["models"]),
        out=folder,
        exit_code=code,
        stopped=stopped,
        exception=exc,
        value=returned[0] if returned else None,
        confirm=data.get("confirm"),
    )
