"""``neuraldbg run [OPTIONS] SCRIPT [ARGS...]``: an unchanged training script, watched.

The script runs as ``__main__`` (``runpy``) with its own ``sys.argv``, output and exit status.
Every model an optimizer trains is found when the optimizer is made (``Optimizer.__init__`` is
wrapped while the script runs) and watched by its own :class:`~neuraldbg.NeuralDbg`, entered
there and exited when the script ends, also after an exception or Ctrl-C. The diagnosis then
goes to standard error, and each model's trace and HTML report to ``--out``.

``--confirm`` (see :mod:`neuraldbg._confirm`) runs the script again in fresh processes, each
through this same command with a hidden ``--apply`` naming one remedy.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import runpy
import sys
import time
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .errors import ConfigError, NeuralDbgError, NeuralDbgWarning, TrainingFailure

__all__ = ["main"]

# Exit status of a script that ``--halt-on`` stopped (the script's own statuses pass through).
HALTED = 3
# Options that take a value: the first other word is the script (or ``-m module``).
_VALUED = {
    "--out",
    "--json",
    "--steps",
    "--halt-on",
    "-o",
    "--option",
    "--confirm-steps",
    "--confirm-top",
    "--jobs",
    "--apply",
    "--seed",
}


class _StopRun(BaseException):
    """Raised from the optimizer step that completed ``--steps`` steps and caught around the
    script: a BaseException, so the script's own ``except Exception`` does not swallow it."""


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="neuraldbg run",
        usage="neuraldbg run [OPTIONS] (SCRIPT | -m MODULE) [ARGS...]",
        description="Run an unchanged training script as __main__ with its own arguments, watch "
        "every model an optimizer trains, and print the diagnosis when it ends (also after an "
        "exception or Ctrl-C). Each model's trace and HTML report are written to --out.",
        epilog="Example: neuraldbg run --steps 200 --json diag.json train.py --lr 0.1",
    )
    p.add_argument("--out", metavar="DIR", help="where traces and reports go (default: runs/<script>-<time>)")
    p.add_argument("--json", metavar="FILE", help="write {steps, hypotheses, models} as JSON to FILE")
    p.add_argument("--steps", type=int, metavar="N", help="stop the script cleanly after N optimizer steps (exit 0)")
    p.add_argument(
        "--halt-on",
        metavar="FAILURES",
        help="stop training once a failure is confirmed: 'any', a confidence (0.8) or failure names "
        f"separated by commas (non_finite,exploding_gradients); the exit status is then {HALTED}",
    )
    p.add_argument(
        "-o",
        "--option",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any NeuralDbg option, e.g. -o threshold_vanishing=1e-3 -o activation_every=1 (repeatable)",
    )
    p.add_argument("--quiet", action="store_true", help="print only the paths, not the diagnosis")
    p.add_argument(
        "--confirm",
        action="store_true",
        help="after the run, try the mechanical remedy of each top hypothesis in a fresh run of the "
        "script (same seeds and steps) and give each a verdict: confirmed, refuted, inconclusive "
        "or untested",
    )
    p.add_argument("--confirm-steps", type=int, metavar="N", help="steps of each --confirm run (default: the run's)")
    p.add_argument("--confirm-top", type=int, default=3, metavar="K", help="hypotheses --confirm tries (default 3)")
    p.add_argument("--jobs", type=int, default=1, metavar="J", help="--confirm runs at once (default 1)")
    # Used by --confirm for its runs; not for users.
    p.add_argument("--apply", metavar="JSON", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, metavar="S", help=argparse.SUPPRESS)
    return p


def split_argv(argv: Sequence[str]) -> Tuple[List[str], Optional[Tuple[str, str]], List[str]]:
    """``(options, target, script_args)``: the options of ``run``, then the script
    (``("path", file)``) or module (``("module", name)``), then the script's own arguments; the
    target is None when there is none (``--help``, or a mistake the parser reports)."""
    args = list(argv)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m":
            if i + 1 >= len(args):
                return args[:i], None, []
            return args[:i], ("module", args[i + 1]), args[i + 2 :]
        if a == "--":
            if i + 1 >= len(args):
                return args[:i], None, []
            return args[:i], ("path", args[i + 1]), args[i + 2 :]
        if a.startswith("-") and a != "-":
            i += 2 if a in _VALUED else 1
            continue
        return args[:i], ("path", a), args[i + 1 :]
    return args, None, []


def _value(text: str) -> Any:
    """``-o`` values: a number, a boolean, None, or the text itself."""
    low = text.strip().lower()
    if low in ("true", "false"):
        return low == "true"
    if low in ("none", "null"):
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def _options(pairs: Sequence[str]) -> Dict[str, Any]:
    out: Dict[str, Any] = {}
    for pair in pairs:
        key, eq, value = pair.partition("=")
        if not eq or not key.strip():
            raise ConfigError(f"-o takes KEY=VALUE (e.g. -o threshold_vanishing=1e-3), got {pair!r}")
        out[key.strip()] = _value(value)
    for fixed in ("trace", "report"):
        if fixed in out:
            raise ConfigError(f"-o {fixed}=... is set by neuraldbg run (use --out DIR)")
    return out


def _halt_on(text: Optional[str]) -> Any:
    if text is None:
        return None
    if text.strip().lower() in ("any", "true"):
        return True
    try:
        return float(text)
    except ValueError:
        return [t.strip() for t in text.split(",") if t.strip()]


def _rank() -> int:
    """This process's rank under torchrun (0 otherwise)."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def _world() -> int:
    """Processes in this torchrun job (1 otherwise)."""
    try:
        return int(os.environ.get("WORLD_SIZE", "1"))
    except ValueError:
        return 1


def _say(text: str) -> None:
    print(f"neuraldbg: {text}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------- finding models


def _modules_training(params: Sequence[Any]) -> List[Any]:
    """The modules to watch for an optimizer holding ``params``: the smallest module that
    holds them all, widened to the outermost wrapper holding exactly the same parameters (a
    ``DistributedDataParallel`` or a one-child wrapper, as the in-code API would be given);
    when no module holds them all (one optimizer over two models), each top-level model that
    holds some. Found among every live module (``gc``), so however the script holds them."""
    import torch

    want = {id(p) for p in params}
    if not want:
        return []
    modules = [o for o in gc.get_objects() if issubclass(type(o), torch.nn.Module)]
    parents: Dict[int, List[Any]] = {}
    owner: Dict[int, Any] = {}
    for m in modules:
        for child in m._modules.values():
            if child is not None:
                parents.setdefault(id(child), []).append(m)
        for p in m._parameters.values():
            if p is not None and id(p) in want:
                owner.setdefault(id(p), m)
    if not owner:
        return []
    held: Dict[int, Set[int]] = {}

    def holds(m: Any) -> Set[int]:
        if id(m) not in held:
            held[id(m)] = {id(p) for p in m.parameters()}
        return held[id(m)]

    first = next(owner[i] for i in (id(p) for p in params) if i in owner)
    level, seen = [first], {id(first)}
    while level:
        cover = next((m for m in level if want <= holds(m)), None)
        if cover is not None:
            return [_outermost(cover, parents, holds)]
        up = []
        for m in level:
            for parent in parents.get(id(m), []):
                if id(parent) not in seen:
                    seen.add(id(parent))
                    up.append(parent)
        level = up
    roots: Dict[int, Any] = {}
    for m in owner.values():
        top = m
        while parents.get(id(top)):
            top = parents[id(top)][0]
        roots.setdefault(id(top), top)
    return list(roots.values())


def _outermost(m: Any, parents: Dict[int, List[Any]], holds: Callable[[Any], Set[int]]) -> Any:
    while True:
        same = [p for p in parents.get(id(m), []) if holds(p) == holds(m)]
        if not same:
            return m
        m = same[0]


# ------------------------------------------------------------------------- the watch


class Watch:
    """Every model trained while the script runs, each under its own :class:`NeuralDbg`."""

    def __init__(
        self,
        out: str,
        options: Dict[str, Any],
        halt_on: Any,
        steps: Optional[int],
        apply: Optional[Dict[str, Any]],
    ) -> None:
        self.out = out
        self.options = options
        self.halt_on = halt_on
        self.steps = steps
        self.apply = apply
        self.models: List[Tuple[str, Any, Any]] = []  # (name, module, debugger)
        self.watched: Set[int] = set()  # ids of watched parameters
        self.notes: List[str] = []  # what the remedy did, or why it could not be applied
        self._original_init: Any = None
        self._count_handle: Any = None
        self._remedy: Any = None
        self.failed: Optional[str] = None

    def start(self) -> None:
        import torch

        original = torch.optim.Optimizer.__init__
        watch = self

        def __init__(optimizer: Any, params: Any, defaults: Any) -> None:
            original(optimizer, params, defaults)
            watch._made(optimizer)

        __init__.__wrapped__ = original  # type: ignore[attr-defined]
        self._original_init = original
        torch.optim.Optimizer.__init__ = __init__  # type: ignore[method-assign, assignment]

    def _made(self, optimizer: Any) -> None:
        """An optimizer was made: the models it trains that are not watched yet are watched
        from now on. An error here is reported and the script goes on, that model unwatched."""
        try:
            params = [p for g in optimizer.param_groups for p in g["params"]]
            if all(id(p) in self.watched for p in params):
                if self._remedy is not None:
                    self._remedy.optimizer_made(optimizer)
                return
            for module in _modules_training(params):
                self._watch(module)
            if self._remedy is not None:
                self._remedy.optimizer_made(optimizer)
            self._count_last()
        except NeuralDbgError as e:
            self.failed = str(e)
            _say(f"cannot watch this script's model: {e}")
        except Exception as e:
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(f"neuraldbg run could not watch a model: {self.failed}", NeuralDbgWarning, stacklevel=2)

    def _watch(self, module: Any) -> None:
        from .debugger import NeuralDbg

        if any(m is module for _, m, _ in self.models):
            return
        base = type(module).__name__
        names = {n for n, _, _ in self.models}
        name, k = base, 2
        while name in names:
            name, k = f"{base}-{k}", k + 1
        if self.apply is not None and self._remedy is None:
            from ._confirm import Remedy

            self._remedy = Remedy(self.apply, self.notes)
        if self._remedy is not None:
            self._remedy.model_found(name, module)
        dbg = NeuralDbg(
            module,
            trace=os.path.join(self.out, f"{name}.ndbg"),
            halt_on=self.halt_on,
            **self.options,
        )
        dbg.__enter__()
        self.models.append((name, module, dbg))
        self.watched.update(id(p) for p in module.parameters())

    def _count_last(self) -> None:
        """The ``--steps`` counter, registered after every debugger's own step hook so the step
        that reaches N is observed before the script is stopped."""
        if self.steps is None:
            return
        from torch.optim.optimizer import register_optimizer_step_post_hook

        if self._count_handle is not None:
            self._count_handle.remove()
        self._count_handle = register_optimizer_step_post_hook(self._counted)

    def _counted(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.steps is not None and self.models and self.step() >= self.steps:
            raise _StopRun()

    def step(self) -> int:
        """Optimizer steps observed: the most any watched model took."""
        return max((int(d.step) for _, _, d in self.models), default=0)

    def finish(self, exc: Optional[BaseException]) -> None:
        """Every debugger exits (trace closed), the remedy's hooks go, ``Optimizer.__init__`` is
        the script's again."""
        import torch

        if self._original_init is not None:
            torch.optim.Optimizer.__init__ = self._original_init  # type: ignore[method-assign]
        if self._count_handle is not None:
            self._count_handle.remove()
        if self._remedy is not None:
            self._remedy.remove()
        kind = None if exc is None else type(exc)
        for _, _, dbg in self.models:
            dbg.__exit__(kind, exc, None if exc is None else exc.__traceback__)


# ------------------------------------------------------------------------- outputs


def hypothesis_json(h: Any, model: str) -> Dict[str, Any]:
    return {
        "model": model,
        "failure": str(h.failure),
        "cause": str(h.cause),
        "layer": h.layer,
        "step": h.step,
        "confidence": float(h.confidence),
        "description": h.description,
        "remedies": list(h.remedies),
    }


def _floats(values: Any) -> List[Optional[float]]:
    # JSON has no NaN: a non-finite loss is null.
    return [float(v) if math.isfinite(float(v)) else None for v in values]


def results(watch: Watch, exit_code: int, stopped: Optional[str]) -> Dict[str, Any]:
    """What ``--json`` writes (and ``--confirm`` reads back from its runs)."""
    hyps: List[Tuple[Any, str]] = []
    models = []
    for name, _, dbg in watch.models:
        found = list(dbg.explain_failure())
        hyps.extend((h, name) for h in found)
        steps, loss = dbg.history(None, "loss")
        models.append(
            {
                "name": name,
                "class": type(dbg.model).__qualname__,
                "steps": int(dbg.step),
                "loss_steps": [int(s) for s in steps],
                "loss": _floats(loss),
                "trace": os.path.join(watch.out, f"{name}.ndbg"),
                "report": os.path.join(watch.out, f"{name}.html"),
            }
        )
    hyps.sort(key=lambda hm: -float(hm[0].confidence))
    return {
        "steps": watch.step(),
        "exit_code": exit_code,
        "stopped": stopped,
        "hypotheses": [hypothesis_json(h, m) for h, m in hyps],
        "models": models,
        "applied": watch.notes,
    }


def _print_diagnosis(watch: Watch, quiet: bool) -> None:
    if not watch.models:
        why = f" ({watch.failed})" if watch.failed else ""
        _say(f"no model was trained: no torch optimizer was made for one{why}")
        return
    for name, _, dbg in watch.models:
        hyps = [h for h in dbg.explain_failure() if h.confidence >= 0.5]
        head = f"{name}: {dbg.step} steps"
        if not quiet:
            if hyps:
                _say(f"{head}, {len(hyps)} failure hypothes{'is' if len(hyps) == 1 else 'es'}:")
                for h in hyps:
                    print(f"  {h}", file=sys.stderr)
                    if h.remedies:
                        print(f"      try: {'; '.join(h.remedies)}", file=sys.stderr)
            else:
                _say(f"{head}, no failure found")
        _say(
            f"{name}: trace {os.path.join(watch.out, name + '.ndbg')}, report {os.path.join(watch.out, name + '.html')}"
        )
    sys.stderr.flush()


def _same_package_env() -> Dict[str, str]:
    """The environment for a child process that imports this very neuraldbg package."""
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path)


def _report_verdicts(data: Dict[str, Any]) -> None:
    """Each model's report made again by ``neuraldbg report``, which adds the verdicts and the
    curves ``--confirm`` wrote next to the trace."""
    import subprocess

    for m in data["models"]:
        cmd = [sys.executable, "-m", "neuraldbg", "report", m["trace"], "-o", m["report"]]
        done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_same_package_env())
        if done.returncode != 0:
            _say(f"could not add the verdicts to the report of {m['name']}: {done.stderr.strip()}")


def _write_reports(watch: Watch) -> None:
    for name, _, dbg in watch.models:
        try:
            dbg.save_report(os.path.join(watch.out, f"{name}.html"))
        except Exception as e:
            _say(f"could not write the report of {name}: {e}")


# ------------------------------------------------------------------------- running


def _seed(seed: int) -> None:
    import random

    import torch

    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:  # pragma: no cover
        pass


def _script_traceback(exc: BaseException, path: Optional[str]) -> None:
    """The traceback Python would print for the script: our frames above it left out."""
    tb = exc.__traceback__
    if path is not None:
        here = tb
        target = os.path.abspath(path)
        while here is not None and os.path.abspath(here.tb_frame.f_code.co_filename) != target:
            here = here.tb_next
        if here is not None:
            tb = here
    traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
    sys.stderr.flush()


def _run_target(target: Tuple[str, str], script_args: List[str]) -> None:
    kind, name = target
    if kind == "module":
        sys.argv = [name, *script_args]
        sys.path.insert(0, os.getcwd())
        runpy.run_module(name, run_name="__main__", alter_sys=True)
    else:
        sys.argv = [name, *script_args]
        sys.path.insert(0, os.path.dirname(os.path.abspath(name)))
        runpy.run_path(name, run_name="__main__")


def _default_out(target: Tuple[str, str]) -> str:
    stem = os.path.splitext(os.path.basename(target[1]))[0] if target[0] == "path" else target[1]
    return os.path.join("runs", f"{stem.replace('.', '_')}-{time.strftime('%Y%m%d-%H%M%S')}")


def main(argv: Sequence[str]) -> int:
    """``neuraldbg run`` with ``argv`` (the words after ``run``); returns the exit status."""
    opts_words, target, script_args = split_argv(argv)
    parser = _parser()
    args = parser.parse_args(opts_words)
    if target is None:
        parser.error("the script to run is missing: neuraldbg run [OPTIONS] SCRIPT [ARGS...]")
    assert target is not None
    if target[0] == "path" and not os.path.isfile(target[1]):
        parser.error(f"no such script: {target[1]}")
    try:
        options = _options(args.option)
        halt_on = _halt_on(args.halt_on)
        _check_options(options, halt_on)
        apply = None if args.apply is None else json.loads(args.apply)
    except (NeuralDbgError, ValueError) as e:
        parser.error(str(e))
    if args.steps is not None and args.steps < 1:
        parser.error("--steps must be at least 1")
    out = args.out if args.out is not None else _default_out(target)
    if args.seed is not None:
        _seed(args.seed)
    watch = Watch(out, options, halt_on, args.steps, apply)
    code, stopped, _ = _execute(
        watch, lambda: _run_target(target, script_args), target[1] if target[0] == "path" else None
    )
    confirm = None
    if args.confirm:
        from ._confirm import Confirm

        confirm = Confirm(target, script_args, args.option, args.confirm_steps, args.confirm_top, args.jobs, 0, {})
    _conclude(watch, code, stopped, args.quiet, confirm, args.json)
    return code


def _conclude(
    watch: Watch,
    code: int,
    stopped: Optional[str],
    quiet: bool,
    confirm: Any,
    json_path: Optional[str],
) -> Optional[Dict[str, Any]]:
    """After the run: reports written and the diagnosis printed (rank 0), the remedies tried
    when ``confirm`` is given, ``--json`` written; returns what ``--json`` holds (None on the
    other ranks of a job when nothing was watched)."""
    rank = _rank()
    if rank == 0:
        _write_reports(watch)
        _print_diagnosis(watch, quiet)
    data = results(watch, code, stopped) if watch.models or json_path else None
    if confirm is not None and _world() > 1:
        if rank == 0:
            _say("--confirm re-runs the script in single processes: run it without torchrun")
    elif confirm is not None and data is not None and watch.models:
        try:
            confirm.run(data, watch.out)
            _report_verdicts(data)
        except Exception as e:  # the run's own diagnosis and outputs still stand
            _say(f"--confirm failed ({type(e).__name__}: {e}); the diagnosis above is the run's own")
    if json_path and rank == 0 and data is not None:
        folder = os.path.dirname(json_path)
        if folder:
            os.makedirs(folder, exist_ok=True)
        with open(json_path, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=1)
    return data


def _check_options(options: Dict[str, Any], halt_on: Any) -> None:
    """Bad ``-o``/``--halt-on`` values are reported before the script starts."""
    import torch

    from .debugger import NeuralDbg

    NeuralDbg(torch.nn.Linear(1, 1), halt_on=halt_on, **options)


def _execute(
    watch: Watch, body: Callable[[], Any], path: Optional[str]
) -> Tuple[int, Optional[str], Optional[BaseException]]:
    """Runs ``body`` (the script, or a function) under ``watch``: its exit status (130 after
    Ctrl-C, :data:`HALTED` after ``--halt-on``), why we stopped it (``--steps``, ``--halt-on``,
    Ctrl-C) or None, and the exception it ended with (its traceback printed, our frames above
    ``path``'s left out)."""
    saved_argv, saved_path = list(sys.argv), list(sys.path)
    exc: Optional[BaseException] = None
    code, stopped = 0, None
    watch.start()
    try:
        body()
    except _StopRun:
        stopped = f"--steps {watch.steps}"
    except SystemExit as e:
        code = _exit_code(e.code)
    except KeyboardInterrupt as e:
        exc, code, stopped = e, 130, "interrupted"
    except TrainingFailure as e:
        exc, code, stopped = e, HALTED, f"halted: {e}"
    except BaseException as e:
        exc, code = e, 1
        _script_traceback(e, path)
    finally:
        sys.argv = saved_argv
        sys.path[:] = saved_path
        watch.finish(exc)
    if stopped is not None:
        _say(f"stopped the script: {stopped}")
    return code, stopped, exc


def _exit_code(code: Any) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
