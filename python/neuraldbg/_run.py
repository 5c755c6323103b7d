"""``neuraldbg run [OPTIONS] SCRIPT [ARGS...]``: an unchanged training script, watched.

The script runs as ``__main__`` (``runpy``) with its own ``sys.argv``, output and exit status.
Every model an optimizer trains is found when the optimizer is made (``Optimizer.__init__`` is
wrapped while the script runs) and watched by its own :class:`~neuraldbg.NeuralDbg`, entered
there and exited when the script ends, also after an exception or Ctrl-C. The diagnosis then
goes to standard error, and each model's trace and HTML report to ``--out``.

The other spokes the same way, each once the script imports its framework (nothing is imported
for it): each Keras ``model.fit`` gets a :class:`~neuraldbg.keras.NeuralDbgCallback` (unless it
has one); a flax ``nnx.Optimizer`` or linen ``TrainState.create`` gets its transformation
wrapped by a :class:`neuraldbg.jax.NeuralDbg` of the model (the loss arrives where the step
passes optax's ``value=`` already). A compiled JAX loop is stopped (``--steps``, ``--halt-on``)
where the host reads its steps: when the script hands the compiled call a newer state, up to 16
updates after the step that stops it; the diagnosis holds the steps up to that one.

``--confirm`` (see :mod:`neuraldbg._confirm`) runs the script again in fresh processes, each
through this same command with a hidden ``--apply`` naming one remedy.
"""

from __future__ import annotations

import argparse
import functools
import gc
import importlib.abc
import importlib.util
import json
import math
import os
import runpy
import sys
import time
import traceback
import warnings
from types import ModuleType
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ._taps import STEP_TAP
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


class _HaltRun(BaseException):
    """A JAX debugger's ``--halt-on`` halt, raised out of the script's compiled call where the
    host reads the state (an ``Exception`` there would be taken for a reading problem);
    reported as the :class:`TrainingFailure` it carries."""

    def __init__(self, failure: TrainingFailure) -> None:
        super().__init__(str(failure))
        self.failure = failure


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


# ------------------------------------------------------------------------- frameworks


class _AfterImport(importlib.abc.MetaPathFinder):
    """Calls ``hooks[name](module)`` once the module ``name`` has been imported by the script
    (at once for one imported already), so that a framework is patched only if the script uses
    it and nothing is imported for the others. The module's own loader runs it; only its
    ``exec_module`` is followed by the hook (an attribute of that loader for that import)."""

    def __init__(self, hooks: Dict[str, Callable[[ModuleType], None]]) -> None:
        self.hooks = dict(hooks)
        self._finding: Set[str] = set()

    def install(self) -> None:
        for name in list(self.hooks):
            module = sys.modules.get(name)
            if module is not None:
                self._fire(name, module)
        sys.meta_path.insert(0, self)

    def remove(self) -> None:
        if self in sys.meta_path:
            sys.meta_path.remove(self)

    def find_spec(self, name: str, path: Any, target: Any = None) -> Any:
        if name not in self.hooks or name in self._finding:
            return None
        self._finding.add(name)
        try:
            spec = importlib.util.find_spec(name)  # the finders after this one
        finally:
            self._finding.discard(name)
        loader = None if spec is None else spec.loader
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        run = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            try:
                run(module)
            finally:
                loader.__dict__.pop("exec_module", None)
            self._fire(name, module)

        try:
            loader.exec_module = exec_module  # type: ignore[method-assign]
        except AttributeError:  # a loader that takes no attribute: imported as it would be, unwatched
            return None
        return spec

    def _fire(self, name: str, module: ModuleType) -> None:
        hook = self.hooks.pop(name, None)
        if hook is None:
            return
        try:
            hook(module)
        except Exception as e:  # the script goes on, that framework unwatched
            warnings.warn(f"neuraldbg run cannot watch {name}: {type(e).__name__}: {e}", NeuralDbgWarning, stacklevel=2)


# ------------------------------------------------------------------------- finding models


def _modules_training(params: Sequence[Any]) -> List[Any]:
    """The modules to watch for an optimizer holding ``params``: the smallest module that
    holds them all, widened to the outermost wrapper that trains exactly the same parameters (a
    ``DistributedDataParallel`` or a one-child wrapper, as the in-code API would be given; a
    model whose backbone is frozen and whose head alone is optimized);
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
            return [_outermost(cover, parents)]
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


def _graph_parameters(tensors: Any) -> List[Any]:
    """The tensors that a backward pass of ``tensors`` (a tensor or a sequence of them) would
    give a ``.grad``: the leaves its graph accumulates into, in the order first met."""
    import torch

    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    todo: List[Any] = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen: Set[int] = set()
    found: Dict[int, Any] = {}
    while todo:
        fn = todo.pop()
        if fn is None or id(fn) in seen:
            continue
        seen.add(id(fn))
        leaf = getattr(fn, "variable", None)  # an AccumulateGrad node
        if isinstance(leaf, torch.Tensor):
            found.setdefault(id(leaf), leaf)
        todo.extend(next_fn for next_fn, _ in fn.next_functions)
    return list(found.values())


def _outermost(m: Any, parents: Dict[int, List[Any]]) -> Any:
    """``m`` widened while a parent trains the same parameters as it (frozen ones aside)."""

    def trains(m: Any) -> Set[int]:
        return {id(p) for p in m.parameters() if p.requires_grad}

    while True:
        same = [p for p in parents.get(id(m), []) if trains(p) == trains(m)]
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
        seed: Optional[int] = None,
    ) -> None:
        self.out = out
        self.options = options
        self.halt_on = halt_on
        self.steps = steps
        self.apply = apply
        self.models: List[Tuple[str, Any, Any]] = []  # (name, module, debugger)
        self.watched: Set[int] = set()  # ids of watched parameters
        self.notes: List[str] = []  # what the remedy did, or why it could not be applied
        self.seed = seed  # torch's and Keras' generators, once the script imports them
        self._patched: List[Tuple[Any, str, Any]] = []  # (owner, attribute, its own value or None)
        self._imports = _AfterImport(
            {
                "torch": self._torch,
                "keras": self._keras,
                "flax.nnx": self._nnx,
                "flax.training.train_state": self._train_state,
                "optax": self._optax,
            }
        )
        self._losses_watched = False
        self._remedy: Any = None
        self._jax_kind: Any = None
        self.failed: Optional[str] = None
        self.running = False  # the script runs: --steps and --halt-on may stop it
        # Whether a torch optimizer was made, and the first backward pass met (a loop with no
        # optimizer updates its weights by hand: its model is found at that backward).
        self._optimizer_made = False
        self._backward_met = False

    def start(self) -> None:
        self.running = True
        self._imports.install()

    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        """``owner.name`` replaced by ``make(original)`` until :meth:`finish` (an attribute
        ``owner`` inherits is given back by deleting ours)."""
        own = owner.__dict__.get(name)
        self._patched.append((owner, name, own))
        setattr(owner, name, make(own if own is not None else getattr(owner, name)))

    def _name(self, base: str) -> str:
        names = {n for n, _, _ in self.models}
        name, k = base, 2
        while name in names:
            name, k = f"{base}-{k}", k + 1
        return name

    # A framework's hook runs when the script imports it.

    def _torch(self, torch: ModuleType) -> None:
        if self.seed is not None:
            torch.manual_seed(self.seed)
        watch = self

        def wrap(original: Any) -> Any:
            def __init__(optimizer: Any, params: Any, defaults: Any) -> None:
                original(optimizer, params, defaults)
                watch._made(optimizer)

            __init__.__wrapped__ = original  # type: ignore[attr-defined]
            return __init__

        self._patch(torch.optim.Optimizer, "__init__", wrap)

        def wrap_backward(original: Any) -> Any:
            @functools.wraps(original)
            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                if not watch._backward_met and watch._first_backward(tensors):
                    # Through the watching debugger's own wrapper, now in place (it reads this
                    # backward; this one only passes calls on from now on).
                    return torch.autograd.backward(tensors, *args, **kwargs)
                if (
                    watch.steps is not None
                    and not watch._optimizer_made
                    and watch.models
                    and watch.step() >= watch.steps
                ):
                    # A loop stepped by hand: a step ends with its backward, so --steps stops
                    # the script as the backward after the last begins.
                    raise _StopRun()
                return original(tensors, *args, **kwargs)

            return backward

        self._patch(torch.autograd, "backward", wrap_backward)

    def _keras(self, keras: ModuleType) -> None:
        from .keras import NeuralDbgCallback, _guard_fit

        if self.seed is not None:
            keras.utils.set_random_seed(self.seed)
        _guard_fit()  # inside ours: a fit that raises ends the watch of the callback added here
        watch = self

        class RunCallback(NeuralDbgCallback):  # type: ignore[misc]
            """The callback of one fit of the run: its debugger listed among the models when
            the fit begins; ``--steps`` stops the script before the batch after the last."""

            def __init__(self, name: str) -> None:
                super().__init__(
                    trace=os.path.join(watch.out, f"{name}.ndbg"), halt_on=watch.halt_on, verbose=False, **watch.options
                )
                self.name = name

            def on_train_begin(self, logs: Any = None) -> None:
                super().on_train_begin(logs)
                if self.dbg is not None:
                    watch.models.append((self.name, self.model, self.dbg))

            def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
                # Counted, not read: dbg.step would wait for the device at every batch.
                if watch.steps is not None and self.dbg is not None and self.dbg.updates_before(batch) >= watch.steps:
                    raise _StopRun()
                super().on_train_batch_begin(batch, logs)

        def wrap(fit: Any) -> Any:
            @functools.wraps(fit)
            def watched_fit(model: Any, *args: Any, **kwargs: Any) -> Any:
                given = kwargs.get("callbacks")
                if len(args) > 5 or not isinstance(given, (list, tuple, type(None))):
                    _say("this fit's callbacks come by position or as a CallbackList: it is not watched")
                    return fit(model, *args, **kwargs)
                given = list(given or [])
                if any(isinstance(c, NeuralDbgCallback) for c in given):
                    return fit(model, *args, **kwargs)
                try:
                    cb = RunCallback(watch._name(type(model).__name__))
                except NeuralDbgError as e:
                    watch.failed = str(e)
                    _say(f"cannot watch this script's model: {e}")
                    return fit(model, *args, **kwargs)
                history = fit(model, *args, **{**kwargs, "callbacks": [*given, cb]})
                if cb.dbg is not None and cb.dbg.halted and watch.halt_on is not None:
                    # fit ended at the failure: so does the script, as a plain loop's would.
                    raise TrainingFailure(cb.dbg.halted, cb.dbg.step - 1)
                return history

            watched_fit._neuraldbg_guard = True  # type: ignore[attr-defined]
            return watched_fit

        self._patch(keras.Model, "fit", wrap)

    def _nnx(self, nnx: ModuleType) -> None:
        watch = self

        def wrap(original: Any) -> Any:
            @functools.wraps(original)
            def __init__(optimizer: Any, model: Any, tx: Any, *args: Any, **kwargs: Any) -> None:
                original(optimizer, model, watch._jax_tx(model, tx, type(model).__name__), *args, **kwargs)

            return __init__

        self._patch(nnx.Optimizer, "__init__", wrap)

    def _optax(self, optax: ModuleType) -> None:
        """optax's losses and jax.nn's activations noted from the script's import of optax on
        (`_jax_loss`): a name the script imports from them (``from optax import X``) is then
        the noting one, which a debugger entered later could not make it."""
        from . import _jax_loss

        _jax_loss.watch(wants=False)  # (the debuggers made later want their losses)
        self._losses_watched = True

    def _train_state(self, module: ModuleType) -> None:
        watch = self

        def wrap(original: Any) -> Any:
            function = original.__func__

            @functools.wraps(function)
            def create(cls: Any, *, apply_fn: Any, params: Any, tx: Any, **kwargs: Any) -> Any:
                owner = getattr(apply_fn, "__self__", None)
                name = type(owner).__name__ if owner is not None else cls.__name__
                return function(cls, apply_fn=apply_fn, params=params, tx=watch._jax_tx(params, tx, name), **kwargs)

            return classmethod(create)

        self._patch(module.TrainState, "create", wrap)

    def _jax_tx(self, model: Any, tx: Any, base: str) -> Any:
        """``tx`` wrapped by a JAX debugger of ``model`` (entered until the script ends), or
        ``tx`` itself when the model cannot be watched (said)."""
        from .jax import NeuralDbg as JaxDbg
        from .jax import watched

        if any(m is model for _, m, _ in self.models) or watched(tx):
            return tx  # watched already (by the script's own debugger too)
        if self._jax_kind is None:
            watch = self

            class RunJaxDbg(JaxDbg):  # type: ignore[misc]
                """The host reads a compiled loop's steps when the script hands it a newer
                state (up to 0.1 s, or half the ring's updates, after they ran): ``--steps``
                and ``--halt-on`` stop the script there, by raising out of that call. The
                updates the device ran past the ``--steps``-th are not observed (read with it,
                or at the exit's last read)."""

                def _after_step(self, step: int) -> None:
                    super()._after_step(step)
                    if watch.running and watch.steps is not None and step + 1 >= watch.steps:
                        self._stopped_at = step
                        raise _StopRun()

            self._jax_kind = RunJaxDbg
        name = self._name(base)
        try:
            dbg = self._jax_kind(
                model, trace=os.path.join(self.out, f"{name}.ndbg"), halt_on=self.halt_on, **self.options
            )
            dbg._on_halt = functools.partial(self._jax_halted, dbg)
            dbg.__enter__()
            wrapped = dbg.wrap(tx)
        except NeuralDbgError as e:
            self.failed = str(e)
            _say(f"cannot watch this script's model: {e}")
            return tx
        self.models.append((name, model, dbg))
        return wrapped

    def _jax_halted(self, dbg: Any, hypotheses: Any) -> None:
        if self.running:
            raise _HaltRun(TrainingFailure(hypotheses, dbg._fed))

    def _first_backward(self, tensors: Any) -> bool:
        """The script's first backward pass, before it runs. With no optimizer made, the loop
        updates the weights by hand (``p -= lr * p.grad``): the modules holding the parameters
        its graph reaches are watched from now on, and the debugger finds the updates from the
        next iteration on (the in-code API's "updates written by hand"). Whether a model is
        watched now."""
        self._backward_met = True
        if self._optimizer_made or not self.running:
            return False
        found = False
        try:
            for module in _modules_training(_graph_parameters(tensors)):
                if type(module).__module__.startswith("keras."):
                    continue  # Keras on torch: its fit is watched, by a callback
                dbg = self._watch(module)
                if dbg is not None:
                    dbg._collector.joined_in_backward = True
                    found = True
        except Exception as e:
            self._unwatched(e, stacklevel=4)
        return found

    def _made(self, optimizer: Any) -> None:
        """An optimizer was made: the models it trains that are not watched yet are watched
        from now on. An error here is reported and the script goes on, that model unwatched."""
        self._optimizer_made = True
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
        except Exception as e:
            self._unwatched(e, stacklevel=3)

    def _unwatched(self, e: Exception, stacklevel: int) -> None:
        """A model could not be watched: said (ours, a clear error; else a warning at the
        script's line ``stacklevel`` frames up), and the script goes on."""
        if isinstance(e, NeuralDbgError):
            self.failed = str(e)
            _say(f"cannot watch this script's model: {e}")
        else:
            self.failed = f"{type(e).__name__}: {e}"
            warnings.warn(
                f"neuraldbg run could not watch a model: {self.failed}", NeuralDbgWarning, stacklevel=stacklevel
            )

    def _watch(self, module: Any) -> Any:
        """Watches ``module`` from now on: its debugger, None if it was watched already."""
        from .debugger import NeuralDbg

        if any(m is module for _, m, _ in self.models):
            return None
        name = self._name(type(module).__name__)
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
        return dbg

    def _count_last(self) -> None:
        """The ``--steps`` counter, called after every debugger's own step hook so the step
        that reaches N is observed before the script is stopped."""
        if self.steps is not None and self._counted not in STEP_TAP.last:
            STEP_TAP.add(self._counted, last=True)

    def _counted(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.steps is not None and self.models and self.step() >= self.steps:
            raise _StopRun()

    def step(self) -> int:
        """Optimizer steps observed: the most any watched model took."""
        return max((int(d.step) for _, _, d in self.models), default=0)

    def finish(self, exc: Optional[BaseException]) -> None:
        """Every debugger exits (trace closed), the remedy's hooks go, what was patched is the
        script's again."""
        self.running = False
        self._imports.remove()
        for owner, name, own in reversed(self._patched):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self._patched = []
        STEP_TAP.remove(self._counted)
        if self._remedy is not None:
            self._remedy.remove()
        kind = None if exc is None else type(exc)
        for _, _, dbg in self.models:
            if hasattr(dbg, "__exit__"):  # (a Keras fit's ended with the fit)
                dbg.__exit__(kind, exc, None if exc is None else exc.__traceback__)
        if self._losses_watched:
            from . import _jax_loss

            self._losses_watched = False
            _jax_loss.unwatch(wants=False)


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
        _say(
            "no model was trained: no torch optimizer was made for one, no Keras model was fitted, "
            f"no flax nnx.Optimizer or TrainState was made, no backward pass reached a torch module's "
            f"parameters{why}. Weights kept as bare tensors (no torch.nn module) cannot be watched: "
            "build the model from torch.nn layers"
        )
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
            elif getattr(dbg, "_untrained", None):
                _say(f"{head}: {dbg._untrained}")
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
    """Python's and numpy's generators; torch's and Keras' when the script imports them."""
    import random

    random.seed(seed)
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
    watch = Watch(out, options, halt_on, args.steps, apply, args.seed)
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
    elif confirm is not None and not all(_is_torch(m) for _, m, _ in watch.models):
        if rank == 0:
            _say("--confirm tries its remedies on PyTorch models only: the diagnosis above is the run's own")
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


def _is_torch(model: Any) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(model, torch.nn.Module)


def _check_options(options: Dict[str, Any], halt_on: Any) -> None:
    """Bad ``-o``/``--halt-on`` values are reported before the script starts (by the PyTorch
    debugger where torch is installed: it takes the most options; with none given, nothing is
    imported for it)."""
    if not options and halt_on is None:
        return
    if importlib.util.find_spec("torch") is None:
        from ._spoke import Spoke

        Spoke(halt_on=halt_on, **options)
        return
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
    except _HaltRun as e:
        exc, code, stopped = e.failure, HALTED, f"halted: {e.failure}"
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
