"""NeuralDBG for JAX training loops (flax nnx + optax): ``from neuraldbg.jax import NeuralDbg``.

::

    from neuraldbg.jax import NeuralDbg

    with NeuralDbg(model) as dbg:                    # a flax nnx Module, or a params pytree
        tx = dbg.wrap(optax.adam(1e-3))              # an optax transformation that observes
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def train_step(model, optimizer, x, y):
            loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
            optimizer.update(model, grads, value=loss)   # the loss as optax's `value=`
            return loss                                  # (`inputs=x` too: the batch's scale)
        ...
    for h in dbg.explain_failure():
        print(h)

The wrapped transformation computes each parameter's gradient sum of squares inside the
compiled step (and the parameters' on sampled steps; the host takes the square roots) and
writes them, with the loss and the learning rate, into a ring buffer that it keeps in its own
optimizer state, on the device: the compiled step holds no host callback (one would take every
call off JAX's fast dispatch path and make it synchronous). The host reads the buffer of a
state it sees once 0.1 s has passed since its last read (sooner when half the ring would fill
first), once the device is done with it (the read buffer holds the rows of the states
skipped): pytrees of the state are flattened and rebuilt by ``jit`` and ``nnx`` at every call,
and the wrapper's state is a pytree node that notes its buffer there. It works
under ``jit``, ``lax.scan`` (up to the buffer's rows of updates per call), ``pmap`` (one ring
per device) and inside ``optax.MultiSteps`` (``optax.MultiSteps(dbg.wrap(tx), k)`` or
``dbg.wrap(optax.MultiSteps(tx, k))``: one step per accumulated update, with the accumulated
gradient). Needs jax and optax (and flax for nnx models); none of them is a dependency of
neuraldbg, and torch is not needed.
"""

from __future__ import annotations

import copy
import functools
import itertools
import math
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Literal, Optional, Tuple, Union

import numpy as np

from ._spoke import (
    ALWAYS_MEASURED,
    HAS_INPUTS,
    HAS_LOSS,
    HAS_LR,
    HAS_SAMPLES,
    HAS_TARGETS,
    HAS_WEIGHTS,
    IN_EVAL,
    IN_TRAINING,
    INPUT_STATS,
    RING_BYTES,
    RING_HEAD,
    RING_MARKER,
    ParamEntry,
    Record,
    RingReader,
    Spoke,
    check_int,
    model_spec,
    roots,
    spec_order,
)
from .errors import ConfigError, ModelError, NeuralDbgError, NeuralDbgWarning
from .types import CausalHypothesis

try:
    import jax
    import jax.numpy as jnp
    import optax
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError("neuraldbg.jax needs jax and optax: pip install jax optax (flax for nnx models)") from _e

from . import _jax_loss
from ._jax_stats import as_f32, as_i32, squares, write_row
from ._measure import update_weights

__all__ = ["NeuralDbg", "WatchState"]

# Weights whose step size is measured (spread over the model: under a plain gradient step
# layers move at rates far apart, and the engine takes their median), and the elements of each
# a sampled step writes into its row; the host reads how far each update moved them from two
# consecutive rows of the first `dense_steps`. Samples of the update itself would make it an
# operand of the sampled steps' conditional, out of the fused step that applies it.
SAMPLE_WEIGHTS, SAMPLE_SIZE = 4, 8

# Path components of a Variable's own value, not of the model.
_VALUE_KEYS = ("value", "raw_value", "_value")


class _Ring(RingReader):
    """The host side of one wrapped transformation: the ring buffers of the states it meets,
    read lazily (:data:`READ_INTERVAL` after the last read, sooner when half the ring would
    fill first, once the device is done with them)."""

    max_every = 256

    def __init__(self, dbg: NeuralDbg, rows: int, width: int) -> None:
        super().__init__(dbg, rows, width, post=dbg._post_squares)
        # An nnx Variable that holds the state's buffer: its value is always the newest one.
        self.holder: Any = None

    def see(self, leaf: Any) -> None:
        """A buffer (or the nnx Variable holding one) met in a state pytree: read if lazy
        reading reads this state, else left for later (a Variable's value is only taken then)."""
        try:
            if leaf is self.last or (leaf is self.unread and isinstance(leaf, jax.Array)):
                return  # a buffer met again: the state it was built into, flattened for the next step
            holder = not isinstance(leaf, jax.Array) and hasattr(leaf, "get_value")
            if holder:
                self.holder = leaf
            elif not isinstance(leaf, jax.Array) or isinstance(leaf, jax.core.Tracer):
                return
            if not self.due():
                self.unread = leaf
                return
            if holder:
                leaf = leaf.get_value()
            if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
                self.add(leaf)
        except Exception as e:  # pragma: no cover - defensive
            warnings.warn(f"NeuralDBG could not read an update: {e}", NeuralDbgWarning, stacklevel=2)

    def pump(self, wait: int = 0) -> None:
        unread = self.unread
        if unread is not None and not isinstance(unread, jax.Array):  # an nnx Variable: its value now
            value = unread.get_value()
            self.unread = value if isinstance(value, jax.Array) and not isinstance(value, jax.core.Tracer) else None
        super().pump(wait)

    def newest(self, wait: bool = True) -> None:
        """Reads everything up to the newest state known (an nnx Variable's value changes after
        each step without a flatten), waiting for the device or not."""
        holder = self.holder
        if holder is not None:
            self.unread = holder
        self.pump(wait=len(self.pending) + 1 if wait else 0)


# Rings by key: the key is the pytree node's static data, the ring lives as long as its debugger.
_RINGS: weakref.WeakValueDictionary[int, _Ring] = weakref.WeakValueDictionary()
_KEYS = itertools.count(1)


def _seen(key: int, leaf: Any) -> None:
    ring = _RINGS.get(key)
    if ring is not None and ring.dbg._active:
        ring.see(leaf)


@jax.tree_util.register_pytree_with_keys_class
class WatchState:
    """The wrapped transformation's state: the inner state and the ring buffer of the last
    updates' statistics (``[rows + 1, columns]`` float32, the gradients' and parameters' sums
    of squares where :class:`RingReader` says norms; its last row holds the update count).
    A pytree node that tells the debugger about every concrete buffer it is built or flattened
    with: ``jit`` and ``nnx.jit`` do both at each call, which is how the host learns of a new
    state without a callback in the compiled step."""

    __slots__ = ("inner", "key", "ring")

    def __init__(self, inner: Any, ring: Any, key: int = 0) -> None:
        self.inner = inner
        self.ring = ring
        self.key = key
        _seen(key, ring)

    def tree_flatten_with_keys(self) -> Tuple[Tuple[Tuple[Any, Any], ...], int]:
        _seen(self.key, self.ring)
        keys = jax.tree_util.GetAttrKey
        return ((keys("inner"), self.inner), (keys("ring"), self.ring)), self.key

    def tree_flatten(self) -> Tuple[Tuple[Any, Any], int]:
        _seen(self.key, self.ring)
        return (self.inner, self.ring), self.key

    @classmethod
    def tree_unflatten(cls, key: int, children: Any) -> WatchState:
        return cls(children[0], children[1], key)

    @property
    def count(self) -> Any:
        """The number of updates made (a scalar array)."""
        return as_i32(jnp.asarray(self.ring)[-1, 0])

    # Code written for the unwrapped state reads it through this one: ``opt_state.hyperparams``
    # (``inject_hyperparams``), ``opt_state[0]`` (a chain's states).
    def __getattr__(self, name: str) -> Any:
        if name in WatchState.__slots__ or name.startswith("__"):  # (a slot not set yet: unpickling)
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __getitem__(self, index: Any) -> Any:
        return self.inner[index]

    def __repr__(self) -> str:
        return f"WatchState(inner={self.inner!r}, ring={getattr(self.ring, 'shape', self.ring)})"


def _serializable() -> None:
    """flax's checkpoints (``flax.serialization.to_bytes``, ``to_state_dict``: a linen
    ``TrainState`` saved whole) see a :class:`WatchState` as its inner state: a checkpoint
    saved while watched loads into an unwatched run and the other way round, and restoring
    keeps the target's ring (the run's own). Once, where flax is installed."""
    try:
        from flax import serialization
    except ImportError:
        return
    serialization.register_serialization_state(
        WatchState,
        lambda s: serialization.to_state_dict(s.inner),
        lambda target, state: WatchState(serialization.from_state_dict(target.inner, state), target.ring, target.key),
        override=True,  # (registered again by each wrap: the same functions)
    )


def _first_float(x: Any) -> Any:
    """The first floating-point array of a batch (an array, or a pytree of them), None when it
    has none (token ids only, or no batch given)."""
    for leaf in jax.tree.leaves(x):
        if hasattr(leaf, "dtype") and jnp.issubdtype(leaf.dtype, jnp.floating) and jnp.ndim(leaf) >= 1:
            return jnp.asarray(leaf)
    return None


def _batch_stats(batch: Any) -> Any:
    """``[min, max, mean, std]`` of a batch (float32) in one pass, one variadic reduction: four
    separate ones compiled to 11-13 more kernels (``bench/jax_kernels.py jax``). The spread is
    ``sqrt(E[x^2] - E[x]^2)``: cancellation only where it is far below the mean, which is
    not what the engine reads it for."""
    x = batch.astype(jnp.float32).reshape(-1)
    lo, hi, total, squares_ = jax.lax.reduce(
        (x, x, x, x * x),
        (jnp.float32(jnp.inf), jnp.float32(-jnp.inf), jnp.float32(0), jnp.float32(0)),
        lambda a, b: (jnp.minimum(a[0], b[0]), jnp.maximum(a[1], b[1]), a[2] + b[2], a[3] + b[3]),
        (0,),
    )
    n = max(x.shape[0], 1)
    mean = total / n
    return jnp.stack([lo, hi, mean, jnp.sqrt(jnp.maximum(squares_ / n - mean * mean, 0.0))])


def _samples(leaves: List[Any], where: List[int], sampled: List[Tuple[int, int]]) -> Any:
    """Strided samples of the measured weights (``[SAMPLE_WEIGHTS * SAMPLE_SIZE]`` float32, NaN
    where a weight is absent or smaller)."""
    parts = []
    for j, stride in sampled:
        k = where[j]
        part = leaves[k].reshape(-1)[::stride][:SAMPLE_SIZE].astype(jnp.float32) if k >= 0 else jnp.zeros((0,))
        parts.append(jnp.pad(part, (0, SAMPLE_SIZE - part.shape[0]), constant_values=jnp.nan))
    parts.append(jnp.full(((SAMPLE_WEIGHTS - len(sampled)) * SAMPLE_SIZE,), jnp.nan, jnp.float32))
    return jnp.concatenate(parts).astype(jnp.float32)


def _class_stats(targets: Any, classes: int) -> Any:
    """``[min, max, entropy, standard error]`` of class-index targets: their range, the entropy
    (nats) of how often each class occurs among them (indices outside ``[0, classes)`` not
    counted), the loss of a model that predicts those frequencies and nothing of the input, and
    its standard error as an estimate from these targets (the delta method)."""
    idx = targets.reshape(-1).astype(jnp.int32)
    kept = ((idx >= 0) & (idx < classes)).astype(jnp.float32)
    counts = jnp.zeros((classes,), jnp.float32).at[jnp.clip(idx, 0, classes - 1)].add(kept)
    p = counts / jnp.maximum(counts.sum(), 1.0)
    logs = jnp.log(jnp.where(p > 0, p, 1.0))
    entropy = -jnp.sum(p * logs)
    se = jnp.sqrt(jnp.maximum(jnp.sum(p * logs * logs) - entropy * entropy, 0.0) / jnp.maximum(counts.sum(), 1.0))
    return jnp.stack([idx.min().astype(jnp.float32), idx.max().astype(jnp.float32), entropy, se])


def _binary_frequency(lo: float, hi: float, mean: float, std: float, n: Optional[int]) -> Dict[str, float]:
    """A binary cross-entropy's ``class_entropy`` and ``class_entropy_se`` from its targets'
    ``[min, max, mean, std]`` over ``n`` of them, where every target is 0 or 1: values in
    [0, 1] whose variance is ``mean * (1 - mean)``, the most they can have (soft targets have
    less). The entropy of how often a target is 1, and its standard error (the delta method)."""
    spread = mean * (1.0 - mean)
    if not n or lo < 0.0 or hi > 1.0 or not 0.0 < mean < 1.0 or abs(std * std - spread) > 1e-3 * spread:
        return {}
    logs = (math.log(mean), math.log(1.0 - mean))
    h = -(mean * logs[0] + (1.0 - mean) * logs[1])
    second = mean * logs[0] ** 2 + (1.0 - mean) * logs[1] ** 2
    return {"class_entropy": h, "class_entropy_se": math.sqrt(max(second - h * h, 0.0) / n)}


def _as_targets(targets: Any) -> Any:
    """The targets the step's optax loss was given, as an array the update can measure, or None
    where they cannot be measured here: not an array of numbers, or traced inside a
    transformation the update is not in (a ``vmap`` of the loss over examples)."""
    if targets is None:
        return None
    try:
        return jax.lax.stop_gradient(jnp.asarray(targets))
    except Exception:
        return None


def _key_name(k: Any) -> str:
    for attr in ("key", "idx", "name"):
        if hasattr(k, attr):
            return str(getattr(k, attr))
    return str(k)


def _names(path: Tuple[Any, ...]) -> Tuple[str, ...]:
    names = tuple(_key_name(k) for k in path)
    while names and names[-1] in _VALUE_KEYS:
        names = names[:-1]
    return names


def _nnx() -> Any:
    try:
        from flax import nnx
    except ImportError:
        return None
    return nnx


def _ranks(root: Any) -> Dict[Tuple[str, ...], int]:
    """Each node's place in a walk of the model in definition order (attributes as assigned,
    lists by index, dicts as inserted): the forward order for the models that define their
    layers in the order they call them, as most do. flax's own traversal sorts by name, and
    names a module held twice (tied, or shared) by the path it meets first: that path and the
    nodes under it take the ranks of the path this walk met first."""
    ranks: Dict[Tuple[str, ...], int] = {}
    first: Dict[int, Tuple[str, ...]] = {}

    def walk(obj: Any, path: Tuple[str, ...]) -> None:
        if id(obj) in first:
            was = first[id(obj)]
            for p, r in list(ranks.items()):
                if p[: len(was)] == was:
                    ranks.setdefault(path + p[len(was) :], r)
            return
        first[id(obj)] = path
        ranks.setdefault(path, len(ranks))
        if isinstance(obj, dict):
            items: Iterable[Tuple[Any, Any]] = list(obj.items())
        elif isinstance(obj, (list, tuple)):
            items = list(enumerate(obj))
        elif hasattr(obj, "__dict__") and not hasattr(obj, "shape"):
            items = [(k, v) for k, v in vars(obj).items() if not str(k).startswith("_")]
        else:
            return
        for k, v in items:
            walk(v, path + (str(k),))

    walk(root, ())
    return ranks


def _resolve(root: Any, path: Tuple[str, ...]) -> Any:
    obj = root
    for p in path:
        if isinstance(obj, dict):
            obj = obj.get(p, obj.get(int(p)) if p.isdigit() else None)
        elif isinstance(obj, (list, tuple)):
            obj = obj[int(p)]
        else:
            obj = getattr(obj, p, None)
        if obj is None:
            return None
    return obj


def _pytree_kind(name: str, leaves: List[ParamEntry]) -> str:
    """A layer's kind in a plain params pytree: flax linen's automatic names say it
    (``Dense_0``), else the shape of its kernel."""
    import re

    m = re.fullmatch(r"([A-Z]\w*?)_\d+", name)
    if m:
        return m.group(1)
    for e in leaves:
        if e.leaf == "embedding":
            return "Embed"
        if e.leaf == "kernel":
            return "Dense" if len(e.shape) == 2 else "Conv"
    return "Module"


class _Model:
    """The watched parameters: names, shapes, kinds and forward ranks, and how a pytree of the
    same structure (gradients, updates, parameters) maps onto the spec's order."""

    def __init__(self, model: Any) -> None:
        nnx = _nnx()
        self.is_nnx = nnx is not None and isinstance(model, nnx.Module)
        if self.is_nnx:
            tree = nnx.as_pure(nnx.state(model, nnx.Param))
            self.root_kind = type(model).__name__
        else:
            tree = model
            self.root_kind = "Model"
        # A flax linen variables dict: {"params": {...}} (the updates are the inner dict).
        self.prefix: Tuple[str, ...] = ()
        if isinstance(tree, dict) and list(tree) == ["params"] and not self.is_nnx:
            self.prefix = ("params",)
        try:
            flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        except Exception as e:  # not a pytree at all
            raise ModelError(f"neuraldbg.jax watches a flax nnx Module or a pytree of parameters: {e}") from e
        ranks = _ranks(model)
        entries: List[ParamEntry] = []
        for path, leaf in flat:
            if not hasattr(leaf, "shape") or not hasattr(leaf, "dtype"):
                continue
            if not jnp.issubdtype(leaf.dtype, jnp.inexact):
                continue
            full = _names(path) or ("param",)
            rank = float(ranks.get(full[:-1], 1e9))
            names = full[len(self.prefix) :] if full[: len(self.prefix)] == self.prefix else full
            entries.append(ParamEntry(names[:-1], names[-1], leaf.shape, "", rank))
        if not entries:
            raise ModelError(
                f"neuraldbg.jax found no floating-point parameter in {type(model).__module__}.{type(model).__qualname__}: "
                "pass a flax nnx Module or a pytree (dict, list) of parameter arrays"
            )
        by_layer: Dict[Tuple[str, ...], List[ParamEntry]] = {}
        for entry in entries:
            by_layer.setdefault(entry.layer, []).append(entry)
        for layer, group in by_layer.items():
            kind = None
            if self.is_nnx:
                node = _resolve(model, layer) if layer else model
                if node is not None and isinstance(node, nnx.Module):
                    kind = type(node).__name__
            else:
                tail = layer[-1] if layer else ""
                kind = _pytree_kind(tail, group)
            for entry in group:
                entry.kind = kind or "Module"
        order = spec_order(entries)
        self.entries = [entries[i] for i in order]
        self.index = {self._key(e.layer + (e.leaf,)): j for j, e in enumerate(self.entries)}
        # The weights whose step size is measured, by spec index, and each one's sample stride.
        weights = update_weights([len(e.shape) >= 2 for e in self.entries], SAMPLE_WEIGHTS)
        self.step_weights = [(j, max(1, int(np.prod(self.entries[j].shape)) // SAMPLE_SIZE)) for j in weights]
        # Modules without parameters the engine reads: an nnx Dropout and the share it drops
        # (not one set deterministic, which drops nothing).
        self.extra: List[Tuple[Tuple[str, ...], str, float]] = []
        self.attrs: Dict[Tuple[str, ...], List[List[Any]]] = {}
        # The modules whose computation depends on the mode (`model.train()` / `eval()`).
        self.moded: List[Any] = []
        if self.is_nnx:
            for path, node in nnx.iter_graph(model):
                if isinstance(node, (nnx.BatchNorm, nnx.Dropout)):
                    self.moded.append(node)
                rate = getattr(node, "rate", None)
                if not isinstance(node, nnx.Dropout) or getattr(node, "deterministic", False) is True:
                    continue
                if isinstance(rate, (int, float)) and not isinstance(rate, bool):
                    names = tuple(str(k) for k in path)
                    self.extra.append((names, "Dropout", float(ranks.get(names, 1e9))))
                    self.attrs[names] = [["p", float(rate)]]

    def mode(self) -> int:
        """The mode its mode-dependent modules are in now (a static attribute of each: the one a
        step traced now is compiled with), as row flags: :data:`IN_EVAL` when any normalizes
        with running averages or drops nothing, :data:`IN_TRAINING` otherwise, 0 without any."""
        if not self.moded:
            return 0
        evaluating = any(
            getattr(m, "use_running_average", None) is True or getattr(m, "deterministic", None) is True
            for m in self.moded
        )
        return IN_EVAL if evaluating else IN_TRAINING

    def _key(self, names: Tuple[str, ...]) -> str:
        if self.prefix and names[: len(self.prefix)] == self.prefix:
            names = names[len(self.prefix) :]
        return ".".join(names)

    def spec(self, optimizer: Optional[str]) -> Dict[str, Any]:
        return model_spec(self.entries, self.root_kind, optimizer, self.extra, framework="jax", attrs=self.attrs)

    def gather(self, tree: Any) -> Tuple[List[Any], List[int]]:
        """The leaves of ``tree`` and, per spec parameter, the index of its leaf (-1: absent).
        Runs at trace time."""
        flat = jax.tree_util.tree_flatten_with_path(tree)[0]
        where = [-1] * len(self.entries)
        leaves: List[Any] = []
        for path, leaf in flat:
            j = self.index.get(self._key(_names(path)))
            if j is not None and where[j] < 0:
                where[j] = len(leaves)
                leaves.append(leaf)
        return leaves, where


# optax states of adaptive steps (each weight moved by about the learning rate whatever the
# gradient's size), by the family name the engine knows them by. Adam's state is also that of
# Adamax, Yogi, RAdam, NAdam and LAMB.
_ADAPTIVE_STATES = {
    "ScaleByAdamState": "Adam",
    "ScaleByAmsgradState": "AMSGrad",
    "ScaleByBeliefState": "AdaBelief",
    "ScaleByAdanState": "Adan",
    "ScaleByRmsState": "RMSprop",
    "ScaleByRStdDevState": "RMSprop",
    "ScaleByRssState": "Adagrad",
    "ScaleByAdaDeltaState": "Adadelta",
    "ScaleByNovogradState": "NovoGrad",
    "ScaleBySM3State": "SM3",
    "ScaleByLionState": "Lion",
    "FactoredState": "Adafactor",
}


def optimizer_kind(tx: Any) -> Optional[str]:
    """The family of adaptive step ``tx`` makes, from the types in its state (built on
    abstract values: nothing is computed), else None: a plain gradient step keeps no state
    that says so (``optax.sgd``, ``sign_sgd`` and LARS' trust ratio all keep an ``EmptyState``),
    so no claim is made for it (nor when ``tx`` needs parameters of another structure)."""
    try:
        state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((2, 2), jnp.float32)})
    except Exception:
        return None
    names: List[str] = []
    todo = [state]
    while todo:
        node = todo.pop()
        if isinstance(node, dict):
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            if hasattr(node, "_fields"):
                names.append(type(node).__name__)
            todo.extend(node)
        elif hasattr(node, "inner_state"):  # a state that is no tuple, holding another
            names.append(type(node).__name__)
            todo.append(node.inner_state)
    kinds = [_ADAPTIVE_STATES[n] for n in names if n in _ADAPTIVE_STATES]
    return kinds[0] if kinds else None


def _held_lr(state: Any) -> Any:
    """The learning rate an ``optax.inject_hyperparams`` transformation holds in its state (the
    first one met, outermost first; an array or its abstract value), or None."""
    todo = [state]
    while todo:
        node = todo.pop(0)
        hyper = getattr(node, "hyperparams", None)
        if isinstance(hyper, dict) and hasattr(hyper.get("learning_rate"), "dtype"):
            return hyper["learning_rate"]
        if isinstance(node, dict):
            todo.extend(node.values())
        elif isinstance(node, (list, tuple)):
            todo.extend(node)
    return None


def _inner_lr(state: Any) -> Any:
    """The learning rate the update used, from an ``inject_hyperparams`` state, or None."""
    lr = _held_lr(state)
    return None if lr is None else jnp.asarray(lr, jnp.float32).reshape(())


def _holds_lr(tx: Any) -> bool:
    """Whether ``tx``'s state holds its learning rate (built on abstract values)."""
    try:
        state = jax.eval_shape(tx.init, {"w": jax.ShapeDtypeStruct((2, 2), jnp.float32)})
    except Exception:
        return False
    return _held_lr(state) is not None


def watched(tx: Any, by: Any = None) -> bool:
    """Whether ``tx`` is a transformation a JAX debugger wrapped (or accumulates one); with
    ``by``, that debugger."""
    accumulating = _multi_steps(tx)
    inner = accumulating.inner_opt if accumulating is not None else tx
    owner = getattr(getattr(inner, "init", None), "_neuraldbg_watched", None)
    return owner is not None and (by is None or owner() is by)


def _multi_steps(tx: Any) -> Any:
    """The ``optax.MultiSteps`` that ``tx`` is, or whose ``gradient_transformation()`` it is;
    else None."""
    if isinstance(tx, optax.MultiSteps):
        return tx
    owner = getattr(getattr(tx, "init", None), "__self__", None)
    return owner if isinstance(owner, optax.MultiSteps) else None


def _with_inner(accumulating: Any, inner: Any) -> Any:
    """A copy of the ``optax.MultiSteps`` ``accumulating`` (its schedule, mean or sum, skip
    function and accumulator's type) that accumulates for ``inner``."""
    outer = copy.copy(accumulating)
    outer._opt = inner
    if outer.inner_opt is not inner:  # an optax that keeps its inner transformation elsewhere
        raise ConfigError(
            "this optax's MultiSteps cannot be watched from outside: wrap the transformation inside it, "
            "optax.MultiSteps(dbg.wrap(tx), every_k_schedule=k) (one step per accumulated update)"
        )
    return outer


class NeuralDbg(Spoke):
    """Watches a JAX training run through its optax transformation and explains why it failed.

    Args:
        model: a flax nnx ``Module`` (its ``nnx.Param`` variables are watched, named by path:
            ``l1.kernel`` belongs to layer ``l1``), or a pytree of parameter arrays (a dict,
            a flax linen ``{"params": ...}``). Layers are ordered as the model defines them
            (attribute assignment order, lists by index), the order most models call them in.
        threshold_vanishing, threshold_exploding, threshold_saturated: the seed's gradient
            thresholds (1e-6, 1e3, 1.0).
        weight_every: measure parameter norms every this many steps after ``dense_steps``
            (inside the compiled step: under ``lax.cond`` in a model of more than 65,536
            parameter elements, where skipped steps compute nothing; a smaller model's are
            computed at every step and kept on these).
        dense_steps: steps at the start whose parameter norms are always measured.
        trace: a file path to record the run to (``neuraldbg explain``, ``neuraldbg watch``,
            ``neuraldbg.load``).
        report: a file path: the HTML report is written there on exit.
        halt_on: as for the PyTorch ``NeuralDbg``; a compiled step cannot be stopped from
            outside, so a confirmed halt sets :attr:`halted` (check it in the loop) and calls
            ``on_failure``.
        on_failure: called with newly confirmed hypotheses as they are confirmed.
        **engine_options: any other engine setting (see :attr:`DEFAULTS`).

    Raises:
        ModelError: ``model`` has no floating-point parameter.
        ConfigError: an option is out of range.
    """

    def __init__(
        self,
        model: Any,
        *,
        threshold_vanishing: float = 1e-6,
        threshold_exploding: float = 1e3,
        threshold_saturated: float = 1.0,
        weight_every: int = 10,
        dense_steps: int = 10,
        trace: Any = None,
        report: Any = None,
        halt_on: Union[bool, float, str, Iterable[str], None] = None,
        on_failure: Optional[Callable[[List[CausalHypothesis]], Any]] = None,
        **engine_options: Any,
    ) -> None:
        super().__init__(
            threshold_vanishing=threshold_vanishing,
            threshold_exploding=threshold_exploding,
            threshold_saturated=threshold_saturated,
            weight_every=weight_every,
            dense_steps=dense_steps,
            trace=trace,
            report=report,
            halt_on=halt_on,
            on_failure=on_failure,
            **engine_options,
        )
        self.model = model
        self._model = _Model(model)
        # The optimizer's kind as the engine names it (read from the first wrapped
        # transformation's state) and the run's facts: the model is registered with them at the
        # first wrap() inside the block (or on entering it after one), before any update.
        self._optimizer: Optional[str] = None
        self._wrapped = False
        self._meta: Optional[Dict[str, Any]] = None
        self._rings: List[_Ring] = []
        # The loss the traced step computes (`_jax_loss`), once known, what its targets are, and
        # their facts from the first update's row; sent from the owner thread.
        self._loss: Optional[Dict[str, Any]] = None
        self._targets_kind: Optional[str] = None
        # Whether the traced update counts the class-index targets' frequencies (`_class_stats`).
        self._classes_counted = False
        self._target_facts: Optional[Dict[str, Any]] = None
        self._loss_sent = False
        self._watching_losses = False
        # The last sampled step's weight samples (`_step_size`); each step's mode, until fed.
        self._samples: Optional[Tuple[int, Any]] = None
        self._modes: Dict[int, float] = {}
        # Whether any update brought its loss (optax's `value=`).
        self._had_loss = False

    # ---------------------------------------------------------------- lifecycle

    def __enter__(self) -> NeuralDbg:
        if self._active or self._meta is not None:
            raise NeuralDbgError("this NeuralDbg is already active; use one `with` block per debugger")
        meta: Dict[str, Any] = {
            "jax": jax.__version__,
            "optax": optax.__version__,
            "model": type(self.model).__qualname__,
        }
        try:
            import flax

            meta["flax"] = flax.__version__
        except (ImportError, AttributeError):  # a params pytree needs no flax
            pass
        self._meta = meta
        if self._wrapped:
            self._register()
        _jax_loss.watch(wants=True)
        self._watching_losses = True
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> Literal[False]:
        if exc_type is None and not self._wrapped:
            warnings.warn(
                f"NeuralDBG watched no update of {type(self.model).__name__}: no optax transformation was "
                "wrapped; give the optimizer dbg.wrap(tx), e.g. nnx.Optimizer(model, dbg.wrap(optax.adam(1e-3)), "
                "wrt=nnx.Param)",
                NeuralDbgWarning,
                stacklevel=2,
            )
        try:
            self._register()  # (a block that wrapped nothing still leaves its trace and report)
            self._wait()
            self._finish()
            if exc_type is None and self.step >= 10 and not self._had_loss:
                warnings.warn(
                    f"NeuralDBG saw {self.step} updates of {type(self.model).__name__} but none of their losses: "
                    "a plateau or a divergence cannot be told without them. Give the update its loss, "
                    "tx.update(grads, state, params, value=loss) (nnx: optimizer.update(model, grads, value=loss))",
                    NeuralDbgWarning,
                    stacklevel=2,
                )
        finally:
            if self._watching_losses:
                self._watching_losses = False
                _jax_loss.unwatch(wants=self._loss is None)
        return False  # never swallow the user's exception

    def _drain(self, final: bool = False) -> None:
        self._send_loss()
        super()._drain(final)

    def _note_loss(self) -> Any:
        """The loss the step being traced computed, when the wrappers of `_jax_loss` saw one
        (at trace time, before the update: nothing runs in the compiled step); returns the
        targets it was given, for the update to measure (None: no loss noted in this trace)."""
        if self._loss is not None or not self._watching_losses:
            return None
        noted = _jax_loss.NOTES.take()
        if noted is None:
            return None
        self._loss, self._targets_kind, targets = noted
        return targets

    def _post_squares(self, steps: np.ndarray, flags: np.ndarray, rows: np.ndarray) -> None:
        """Rows as the compiled step writes them, with sums of squares where
        :meth:`Spoke._post_rows` takes norms: their square roots are taken here (in the step they
        would be one more kernel); -1 (absent) and NaN stay as they are. The flags that only
        some rows carry (the step's mode, the targets' and weights' samples) are read first."""
        n = self._n_params
        self._had_loss = self._had_loss or bool((flags & HAS_LOSS).any())
        roots(rows[:, RING_HEAD : RING_HEAD + 2 * n])
        moded = (flags & (IN_TRAINING | IN_EVAL)) != 0
        if moded.any():
            self._modes.update(zip(steps[moded].tolist(), ((flags[moded] & IN_TRAINING) != 0).astype(float).tolist()))
        at = RING_HEAD + 2 * n + INPUT_STATS
        measured = np.flatnonzero(flags & HAS_TARGETS)
        if self._target_facts is None and measured.size:
            self._target_facts = self._targets_facts(rows[measured[0], at : at + INPUT_STATS])
        at += INPUT_STATS
        step_sizes = [
            self._step_size(int(steps[k]), rows[k, at : at + 2 * SAMPLE_WEIGHTS * SAMPLE_SIZE])
            for k in np.flatnonzero((flags & HAS_SAMPLES) != 0)
            if steps[k] <= self._dense_steps
        ]
        self._post(*[r for r in step_sizes if r is not None], *self._records(steps, flags, rows))

    def _step_facts(self, r: Record) -> Optional[Dict[str, float]]:
        """Whether the step ran in training mode (as the PyTorch collector says it), where the
        model has modules whose computation depends on it."""
        mode = self._modes.pop(r.step, None)
        return None if mode is None else {"training": mode}

    def _step_size(self, step: int, samples: Any) -> Optional[Record]:
        """How the update before ``step`` moved each measured weight, from this row's samples
        and the previous step's, for a step of the first ``dense_steps`` updates (the caller's
        choice): how far (``|W_after - W_before| / |W_before|``) and which way (the cosine between
        the move and the gradient that update was given, at the same elements; NaN where either
        is zero), the PyTorch collector's ``update_ratio`` and ``update_direction``. A record of
        ``step``'s, posted with its row (the engine reads the first few of these, not their steps)."""
        now = np.asarray(samples, np.float64).reshape(2, SAMPLE_WEIGHTS, SAMPLE_SIZE)  # weights, gradient
        before, self._samples = self._samples, (step, now)
        if before is None or before[0] != step - 1:
            return None
        ratios = np.full(len(self._model.entries), np.nan, np.float32)
        directions = ratios.copy()
        for k, (j, _) in enumerate(self._model.step_weights):
            b, a, g = before[1][0, k], now[0, k], before[1][1, k]
            kept = np.isfinite(b) & np.isfinite(a)
            size = float(np.linalg.norm(b[kept]))
            if kept.any() and size > 0:
                ratios[j] = float(np.linalg.norm(a[kept] - b[kept])) / size
            kept &= np.isfinite(g)
            move, grad = a[kept] - b[kept], g[kept]
            scale = float(np.linalg.norm(move)) * float(np.linalg.norm(grad))
            if scale > 0:
                directions[j] = float(move @ grad) / scale
        return Record(step, measures={"update_ratio": ratios, "update_direction": directions})

    def _targets_facts(self, stats: Any) -> Dict[str, Any]:
        """The engine's facts of the targets' ``[min, max, mean, std]``: a cross-entropy's class
        indices' range and the entropy of their frequencies with its standard error (``[min,
        max, entropy, error]``, :func:`_class_stats`); the range of what a binary cross-entropy or a regression compares the
        output with, and a regression's variance."""
        lo, hi, third, std = (float(v) for v in stats)
        if not (math.isfinite(lo) and math.isfinite(hi)):
            return {}
        if self._targets_kind == "classes":
            counted = self._classes_counted and math.isfinite(third)  # (`_class_stats`' entropy)
            facts: Dict[str, Any] = {"class_range": [lo, hi]}
            if counted:
                facts["class_entropy"] = third
                if math.isfinite(std):
                    facts["class_entropy_se"] = std
            return facts
        if not math.isfinite(std):
            return {}
        facts = {"target_range": [lo, hi]}
        if self._loss is not None and any(op in ("MseLoss", "HuberLoss") for op in self._loss["ops"]):
            facts["target_var"] = std * std
        if self._loss is not None and "BinaryCrossEntropyWithLogits" in self._loss["ops"]:
            facts.update(_binary_frequency(lo, hi, third, std, self._loss.get("output_numel")))
        return facts

    def _send_loss(self) -> None:
        """The loss's facts to the engine, once, then its targets' once the first update's row
        brought them; from the owner thread (never raises)."""
        if self._loss is None or not self._started or threading.get_ident() != self._owner:
            return
        facts: Dict[str, Any] = {}
        if not self._loss_sent:
            self._loss_sent = True
            facts["loss"] = self._loss
        if self._target_facts:
            facts.update(self._target_facts)
            self._target_facts = {}  # (sent: an empty dict is not measured again)
        self._give_facts(facts, "the loss's facts")

    def _register(self) -> None:
        """Registers the model, once, inside the block: what is known of the optimizer by then
        goes with it."""
        meta, self._meta = self._meta, None
        if meta is not None:
            self._start(self._model.spec(self._optimizer), meta)

    def _wait(self) -> None:
        # Every step dispatched so far: the newest state's buffer, waited for.
        for ring in self._rings:
            ring.newest()

    # ---------------------------------------------------------------- the transformation

    def wrap(
        self,
        tx: Union[optax.GradientTransformation, optax.MultiSteps],
        *,
        learning_rate: Union[float, Callable[[Any], Any], None] = None,
        buffer: Optional[int] = None,
    ) -> Union[optax.GradientTransformationExtraArgs, optax.MultiSteps]:
        """``tx``, observing each update: the gradient norm of every watched parameter, the
        parameter norms on sampled steps, the loss (optax's ``value=`` extra argument, as
        ``reduce_on_plateau`` takes it) and the learning rate, written into a ring buffer in the
        transformation's state that the host reads about every 0.1 s (more often when the
        ring would fill first). The updates are ``tx``'s own, unchanged. Given the batch as the
        extra argument ``inputs=`` (``optimizer.update(model, grads, value=loss, inputs=x)``),
        the minimum, maximum, mean and spread of its first floating-point array too (the scale
        of the data, a NaN batch): what the PyTorch spoke reads at the model's input.

        ``learning_rate``: the rate or schedule ``tx`` was built with (a float or an optax
        schedule, evaluated at the step inside the compiled update), so that the diagnosis
        can weigh it; without it, the rate is read from an ``optax.inject_hyperparams`` state
        when ``tx`` has one.

        ``buffer``: the ring's rows, the most updates one compiled call may make (a
        ``lax.scan`` over batches) without losing any; by default as many as fit in 256 KiB,
        at least 16 and at most 256. Each update rewrites the whole ring once (the copy that a
        state not donated needs anyway).

        Gradient accumulation: ``optax.MultiSteps(dbg.wrap(tx), every_k_schedule=k)``, or
        ``dbg.wrap`` of the ``MultiSteps`` (or of its ``gradient_transformation()``), which
        watches the transformation inside it: one step per accumulated update, its gradient
        the accumulated one.
        """
        if watched(tx, by=self):
            return tx  # (another debugger's is wrapped again: each then reads its own ring)
        accumulating = _multi_steps(tx)
        if accumulating is not None:
            outer = _with_inner(
                accumulating, self.wrap(accumulating.inner_opt, learning_rate=learning_rate, buffer=buffer)
            )
            return (
                outer
                if isinstance(tx, optax.MultiSteps)
                else optax.with_extra_args_support(outer.gradient_transformation())
            )
        if not (hasattr(tx, "init") and hasattr(tx, "update")):
            raise ConfigError(f"wrap() takes an optax GradientTransformation, got {type(tx).__qualname__}")
        if (
            learning_rate is not None
            and not callable(learning_rate)
            and (isinstance(learning_rate, bool) or not isinstance(learning_rate, (int, float)))
        ):
            raise ConfigError(f"learning_rate must be a number or an optax schedule, got {learning_rate!r}")
        n = len(self._model.entries)
        inner = optax.with_extra_args_support(tx)
        # The weights sampled for the step size, only where the rate is not known (the engine
        # estimates the step from a known rate): on a small model they make the ring twice as
        # large. The row: head, gradients, parameters, the inputs' and the loss's targets'
        # statistics, the samples.
        step_weights = self._model.step_weights if learning_rate is None and not _holds_lr(inner) else []
        # The weights' samples, then the gradient's at the same elements.
        samples_width = 2 * SAMPLE_WEIGHTS * SAMPLE_SIZE if step_weights else 0
        width = RING_HEAD + 2 * n + 2 * INPUT_STATS + samples_width
        if buffer is None:
            rows = max(16, min(256, 2 ** int(math.log2(max(RING_BYTES // (4 * width), 1)))))
        else:
            rows = check_int("buffer", buffer, 1)
        _serializable()
        if not self._wrapped:
            self._wrapped = True
            self._optimizer = optimizer_kind(inner)
            self._register()
        model = self._model
        ring = _Ring(self, rows, width)
        key = next(_KEYS)
        _RINGS[key] = ring
        self._rings.append(ring)

        def init(params: Any) -> WatchState:
            buf = jnp.zeros((rows + 1, width), jnp.float32)
            buf = buf.at[:rows, 0].set(as_f32(-1))  # no step yet in any row
            buf = buf.at[rows, :2].set(as_f32(jnp.asarray([0, RING_MARKER])))
            return WatchState(inner.init(params), buf, key)

        def update(updates: Any, state: WatchState, params: Any = None, **extra: Any) -> Tuple[Any, WatchState]:
            targets = self._note_loss()
            new, inner_state = inner.update(updates, state.inner, params, **extra)
            buf = state.ring
            try:
                buf = observe(updates, buf, params, extra, inner_state, targets)
            except Exception as e:  # tracing our statistics failed: train on, unobserved
                warnings.warn(f"NeuralDBG cannot observe this update: {e}", NeuralDbgWarning, stacklevel=2)
            return new, WatchState(inner_state, buf, key)

        def observe(updates: Any, buf: Any, params: Any, extra: Dict[str, Any], after: Any, targets: Any) -> Any:
            buf = jnp.asarray(buf)
            count = as_i32(buf[rows, 0])
            leaves, where = model.gather(updates)
            value = extra.get("value")
            loss = jnp.mean(jnp.asarray(value).astype(jnp.float32)) if value is not None else jnp.float32(0)
            if callable(learning_rate):
                lr = jnp.asarray(learning_rate(count), jnp.float32).reshape(())
            elif learning_rate is None:
                # inject_hyperparams keeps the rate this update used in its new state.
                lr = _inner_lr(after)
            else:
                lr = jnp.float32(learning_rate)
            flags = (HAS_LOSS if value is not None else 0) | (HAS_LR if lr is not None else 0) | model.mode()
            batch = _first_float(extra.get("inputs"))
            if batch is not None:
                flags |= HAS_INPUTS
                inputs = _batch_stats(jax.lax.stop_gradient(batch))
            else:
                inputs = jnp.full((INPUT_STATS,), jnp.nan, jnp.float32)
            # The loss's targets, with the batch (`inputs=`): measured on sampled steps with the
            # parameters (the host reads the first update's), still a few microseconds a step.
            targets = _as_targets(targets) if batch is not None else None
            classes = (self._loss or {}).get("output_units") if self._targets_kind == "classes" else None
            if targets is not None and classes and classes >= 2 and jnp.issubdtype(targets.dtype, jnp.integer):
                self._classes_counted = True
                target_stats: Callable[[Any], Any] = functools.partial(_class_stats, classes=classes)
            else:
                target_stats = _batch_stats
            nothing = jnp.full((INPUT_STATS,), jnp.nan, jnp.float32)
            no_samples = jnp.full((samples_width,), jnp.nan, jnp.float32)
            if targets is not None:
                flags |= HAS_TARGETS
            grads = squares(leaves, where)
            if params is not None:
                flags |= HAS_WEIGHTS | (HAS_SAMPLES if step_weights else 0)
                sampled = self._sampled(count)
                p_leaves, p_where = model.gather(params)
                # One array, selected or out of the conditional: the squares, the targets' statistics, the samples.
                k = len(p_where)

                def measure(ls: List[Any], t: Any) -> Any:
                    return jnp.concatenate(
                        [
                            squares(ls, p_where),
                            nothing if t is None else target_stats(t),
                            _samples(ls, p_where, step_weights) if step_weights else no_samples[: samples_width // 2],
                            _samples(leaves, where, step_weights) if step_weights else no_samples[samples_width // 2 :],
                        ]
                    )

                def skip(ls: List[Any], t: Any) -> Any:
                    return jnp.concatenate([jnp.full((k,), -1.0, jnp.float32), nothing, no_samples])

                if sum(int(np.size(leaf)) for leaf in p_leaves) <= ALWAYS_MEASURED:
                    packed = jnp.where(sampled, measure(p_leaves, targets), skip(p_leaves, targets))
                else:
                    packed = jax.lax.cond(sampled, measure, skip, p_leaves, targets)
                weights, measured, samples = packed[:k], packed[k : k + INPUT_STATS], packed[k + INPUT_STATS :]
            else:
                weights = jnp.full((n,), -1.0, jnp.float32)
                measured = nothing if targets is None else target_stats(targets)
                samples = no_samples
            head = jnp.stack([as_f32(count), as_f32(flags), loss, lr if lr is not None else jnp.float32(0)])
            row = jnp.concatenate([head, grads, weights, inputs, measured, samples])
            # One select writes the row and the new count: nnx.jit does not donate the state, so
            # the buffer is copied anyway, and the select is that copy.
            return write_row(buf, count % rows, row, {0: as_f32(count + 1)})

        # Its debugger (weakly): `neuraldbg run` wraps it no more, this debugger not twice.
        init._neuraldbg_watched = weakref.ref(self)  # type: ignore[attr-defined]
        return optax.GradientTransformationExtraArgs(init, update)

    @property
    def halted(self) -> Optional[List[CausalHypothesis]]:
        """The hypotheses that halted training (``halt_on``), or None. Reading it takes in the
        steps the device has finished, without waiting for the others."""
        if self._active:
            for ring in self._rings:
                ring.newest(wait=False)
            self._drain()
        return self._halted

    def _title(self) -> str:
        return f"NeuralDBG report: {type(self.model).__name__}"

    def __repr__(self) -> str:
        state = "active" if self._active else ("finished" if self._started else "idle")
        return f"NeuralDbg({type(self.model).__name__}, jax, step={self.step}, {state})"
