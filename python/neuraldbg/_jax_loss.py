"""What a JAX training step's loss is, learned while the step is traced: nothing is added to the
compiled step.

While a JAX debugger is in its ``with`` block, optax's losses (``optax.softmax_cross_entropy``,
``..._with_integer_labels``, ``sigmoid_binary_cross_entropy``, ``squared_error``,
``huber_loss``) and the activations of ``jax.nn`` (and their ``flax.nnx`` / ``flax.linen``
names) are replaced by wrappers that call them unchanged and note, per call, what they were
given: an activation its output, a loss the output it compares and the targets' shape. The
debugger's wrapped transformation, traced after the loss in the same step, takes those notes
as the engine's loss facts (``LossSpec``: the operations the loss applies, in the engine's
names, the activation that made the output the loss was given, the output's units and
elements, and the elements it compared with the targets once broadcast). So a softmax fed to
``softmax_cross_entropy``, a ReLU or sigmoid making its logits, a chance level to judge the loss
by, and ``(N, 1)`` predictions regressed on ``(N,)`` targets are named as in PyTorch.

The targets a loss was given are kept with the notes: the wrapped transformation measures them
in the update, when the loop gives it the batch (``inputs=``) and they are the step's own
arrays, for the facts that need values, the targets' range and variance.

What is not seen: a loss written out by hand (``-jnp.sum(labels * jax.nn.log_softmax(z))``), a
loss or activation referenced before the first debugger watched (``from optax import X`` at the
top of a script: ``neuraldbg run`` watches from the script's import of optax on), and an
activation applied through ``jnp``.
"""

from __future__ import annotations

import collections
import functools
import importlib
import math
import threading
from typing import Any, Callable, Deque, Dict, List, Optional, Tuple

import numpy as np

# optax's losses, by the operations they apply to the output in the engine's names (PyTorch's
# autograd names, as `LossSpec.ops` holds them); each takes the output first (`logits` or
# `predictions`) and the targets second. (`l2_loss` is half a squared error: its level at a
# constant guess is not the targets' variance, so it is left out.)
_CROSS_ENTROPY = ("NllLoss", "LogSoftmax")
LOSSES: Dict[str, Tuple[str, ...]] = {
    "softmax_cross_entropy": _CROSS_ENTROPY,
    "softmax_cross_entropy_with_integer_labels": _CROSS_ENTROPY,
    "safe_softmax_cross_entropy": _CROSS_ENTROPY,
    "sigmoid_binary_cross_entropy": ("BinaryCrossEntropyWithLogits",),
    "squared_error": ("MseLoss",),
    "huber_loss": ("HuberLoss",),
}
_OUTPUT_NAMES = ("logits", "predictions")
_TARGET_NAMES = ("labels", "targets")

# jax.nn's activations as the engine names the operation that made an output.
ACTIVATIONS: Dict[str, str] = {
    "softmax": "Softmax",
    "log_softmax": "LogSoftmax",
    "sigmoid": "Sigmoid",
    "hard_sigmoid": "Hardsigmoid",
    "relu": "Relu",
    "relu6": "Relu6",
    "tanh": "Tanh",
    "hard_tanh": "Hardtanh",
    "soft_sign": "Softsign",
    "softplus": "Softplus",
    "gelu": "GELU",
    "silu": "SiLU",
    "swish": "SiLU",
    "elu": "ELU",
    "selu": "SELU",
    "leaky_relu": "LeakyReLU",
}

# Outputs an activation made lately (the object itself, kept alive so that an identity test
# cannot mistake another for it): the output a loss is given is the last activation's output
# in all but very deep chains of activations.
_RECENT = 8


class _Notes:
    """What the wrappers saw, process-wide, while at least one JAX debugger in its block still
    wants its loss (once every one has it, calls are not noted: an eager loop pays nothing more,
    and no array of it is kept)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # Who keeps the wrappers in place (debuggers in their block, `neuraldbg run`), and the
        # debuggers among them that have not taken their loss yet.
        self.watchers = 0
        self.wanting = 0
        self.outputs: Deque[Tuple[Any, str]] = collections.deque(maxlen=_RECENT)
        # Per loss call: its facts, what its targets are, the targets themselves.
        self.losses: List[Tuple[Dict[str, Any], Optional[str], Any]] = []
        # (module, name, original) of every wrapper in place.
        self.patched: List[Tuple[Any, str, Any]] = []

    def made(self, out: Any, op: str) -> None:
        if self.wanting and hasattr(out, "shape"):
            self.outputs.append((out, op))

    def compared(self, ops: Tuple[str, ...], output: Any, targets: Any) -> None:
        if not self.wanting or not hasattr(output, "shape"):
            return
        shape = tuple(output.shape)
        facts: Dict[str, Any] = {"ops": list(ops)}
        op = next((op for out, op in reversed(self.outputs) if out is output), None)
        if op is not None:
            facts["output_op"] = op
        if shape and isinstance(shape[-1], int):
            facts["output_units"] = shape[-1]
        numel = math.prod(shape)
        if numel:
            facts["output_numel"] = numel
            # Elements compared once the output is broadcast against the targets (integer labels
            # of a cross-entropy have one dimension less by design).
            if ops != _CROSS_ENTROPY and hasattr(targets, "shape"):
                try:
                    facts["compared_numel"] = math.prod(np.broadcast_shapes(shape, tuple(targets.shape)))
                except ValueError:
                    pass
        kind = None
        if hasattr(targets, "shape") and hasattr(targets, "dtype"):
            if ops != _CROSS_ENTROPY:
                kind = "values"
            elif len(targets.shape) == len(shape) - 1:
                kind = "classes"  # integer labels
        with self.lock:
            if len(self.losses) < 64:
                self.losses.append((facts, kind, targets if kind else None))

    def take(self) -> Optional[Tuple[Dict[str, Any], Optional[str], Any]]:
        """The loss of the last call noted since the last take (the step being traced calls it
        just before its update), if every call noted agrees on the loss, the output's
        activation and units (a step that computes two different losses gives none; an
        evaluation step traced earlier may differ in batch size only), else None; the notes are
        cleared. With it, what the targets are (``"classes"``: integer labels; ``"values"``:
        what the output is compared with; None: other) and that call's targets (a traced array:
        the step's own, which the update traced after the loss can measure)."""
        with self.lock:
            losses, self.losses = self.losses, []

        def kind(noted: Tuple[Dict[str, Any], Optional[str], Any]) -> Tuple[Any, ...]:
            facts = noted[0]
            return (facts["ops"], facts.get("output_op"), facts.get("output_units"), noted[1])

        if not losses or any(kind(f) != kind(losses[-1]) for f in losses):
            return None
        self._served()
        return losses[-1]

    def _served(self) -> None:
        """One debugger less wants its loss; with none left, what was noted goes."""
        with self.lock:
            self.wanting = max(0, self.wanting - 1)
            if not self.wanting:
                self.outputs.clear()
                self.losses.clear()


NOTES = _Notes()


class _Module:
    """A module, pickled as its import."""

    def __init__(self, name: str) -> None:
        self.name = name

    def __reduce__(self) -> Tuple[Any, Tuple[str]]:
        return (importlib.import_module, (self.name,))


class _Noting:
    """A function of ``jax.nn`` or ``optax.losses`` that notes what it is given and calls it
    unchanged. Pickled as that module's attribute, as the function is by its name (a wrapper
    function would not pickle: its name finds the original)."""

    def __init__(self, fn: Callable[..., Any], module: str, name: str) -> None:
        functools.update_wrapper(self, fn)
        self._neuraldbg_inner = fn
        self._at = (module, name)

    def note(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        raise NotImplementedError

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        out = self._neuraldbg_inner(*args, **kwargs)
        try:
            self.note(args, kwargs, out)
        except Exception:  # a note, never a reason to fail the user's step
            pass
        return out

    def __reduce__(self) -> Tuple[Any, Tuple[Any, str]]:
        return (getattr, (_Module(self._at[0]), self._at[1]))


class _Activation(_Noting):
    def __init__(self, fn: Callable[..., Any], module: str, name: str, op: str) -> None:
        super().__init__(fn, module, name)
        self.op = op

    def note(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        NOTES.made(out, self.op)


class _Loss(_Noting):
    def __init__(self, fn: Callable[..., Any], module: str, name: str, ops: Tuple[str, ...]) -> None:
        super().__init__(fn, module, name)
        self.ops = ops

    def note(self, args: Tuple[Any, ...], kwargs: Dict[str, Any], out: Any) -> None:
        output = args[0] if args else next((kwargs[k] for k in _OUTPUT_NAMES if k in kwargs), None)
        targets = args[1] if len(args) > 1 else next((kwargs[k] for k in _TARGET_NAMES if k in kwargs), None)
        NOTES.compared(self.ops, output, targets)


def _modules(names: Tuple[str, ...]) -> List[Any]:
    found = []
    for name in names:
        try:
            found.append(importlib.import_module(name))
        except Exception:  # flax is optional
            pass
    return found


def watch(*, wants: bool) -> None:
    """One more watcher (``wants``: a debugger that wants its loss): the wrappers go in place
    with the first."""
    with NOTES.lock:
        NOTES.watchers += 1
        NOTES.wanting += wants
        if NOTES.watchers > 1:
            return
    import jax.nn
    import optax.losses

    def patch(canonical: Any, table: Dict[str, Any], make: Callable[..., _Noting], where: List[Any]) -> None:
        for name, what in table.items():
            fn = getattr(canonical, name, None)
            if fn is None or hasattr(fn, "_neuraldbg_inner"):
                continue
            wrapper = make(fn, canonical.__name__, name, what)
            for module in [canonical, *where]:
                if getattr(module, name, None) is fn:
                    setattr(module, name, wrapper)
                    NOTES.patched.append((module, name, fn))

    patch(jax.nn, ACTIVATIONS, _Activation, _modules(("flax.nnx", "flax.linen")))
    patch(optax.losses, LOSSES, _Loss, _modules(("optax",)))


def unwatch(*, wants: bool) -> None:
    """One watcher less (``wants``: a debugger that never got its loss): the originals are back
    once none watches (a wrapper someone replaced in the meantime is left to them)."""
    if wants:
        NOTES._served()
    with NOTES.lock:
        NOTES.watchers = max(0, NOTES.watchers - 1)
        if NOTES.watchers:
            return
        patched, NOTES.patched = NOTES.patched, []
    for module, name, fn in patched:
        if getattr(getattr(module, name, None), "_neuraldbg_inner", None) is fn:
            setattr(module, name, fn)
