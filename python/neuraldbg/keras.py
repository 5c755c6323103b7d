"""NeuralDBG for Keras 3 ``model.fit``, on any backend: one callback.

::

    from neuraldbg.keras import NeuralDbgCallback

    cb = NeuralDbgCallback()                       # halt_on=, trace=, report=, any NeuralDbg option
    model.fit(x, y, epochs=5, callbacks=[cb])
    for h in cb.dbg.explain_failure():
        print(h)

Gradients are read where the optimizer receives them: the callback wraps ``model.optimizer``'s
``apply`` for the run, and each call computes every trainable variable's gradient norm (and the
variables' norms on sampled steps) with ``keras.ops`` inside the compiled train step. On JAX they
go into a ring buffer the step carries as an optimizer variable, and the activation statistics of
the forward pass into a second one, a non-trainable variable of the model; the host reads both
from the fit loop's state every few batches (no host callback: one takes every call off JAX's
fast dispatch path). On TensorFlow into ring variables of their own, read between batches
(:class:`_Mailbox`: a host call cannot be compiled by XLA); on the eager PyTorch backend kept
on the device and read between batches (:class:`_Deferred`). That is also where a custom
``train_step`` that calls ``self.optimizer.apply(grads, ...)`` (or ``stateless_apply``, or
``apply_gradients``) is seen. Variables are named by their layer: ``dense_2.kernel`` belongs to
layer ``dense_2``.
The loss is the fit loop's: the per-batch value is recovered from the running mean Keras logs.
What the compiled loss does with the output (and the weight penalties Keras adds to it) reaches
the engine as facts when fit starts.
Keras is not a dependency of neuraldbg.
"""

from __future__ import annotations

import functools
import os
import threading
import warnings
import weakref
from typing import Any, Callable, Dict, Iterable, List, Optional, Set, Tuple, Union

import numpy as np

from ._loop import MAX_FEATURES
from ._measure import update_stride, update_weights
from ._spoke import (
    ALWAYS_MEASURED,
    HAS_INPUTS,
    HAS_LR,
    HAS_WEIGHTS,
    INPUT_STATS,
    RING_BYTES,
    RING_HEAD,
    RING_MARKER,
    ParamEntry,
    Record,
    RingReader,
    Spoke,
    model_spec,
    spec_order,
)
from .errors import ConfigError, ModelError, NeuralDbgError, NeuralDbgWarning
from .types import CausalHypothesis

try:
    import keras
    from keras import ops
    from keras.src.backend import in_stateless_scope
except ImportError as _e:  # pragma: no cover - depends on the environment
    raise ImportError("neuraldbg.keras needs Keras 3: pip install keras") from _e

__all__ = ["KerasDbg", "NeuralDbgCallback"]

TRACE_NAME = "neuraldbg.ndbg"
REPORT_NAME = "neuraldbg.html"

# Keras activation names as the engine knows their kinds (PyTorch's class names).
_ACTIVATIONS = {
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
    "relu": "ReLU",
    "relu6": "ReLU6",
    "softsign": "Softsign",
    "hard_sigmoid": "Hardsigmoid",
    "leaky_relu": "LeakyReLU",
    "elu": "ELU",
    "selu": "SELU",
    "gelu": "GELU",
    "silu": "SiLU",
    "swish": "SiLU",
    "mish": "Mish",
    "softplus": "Softplus",
    "softmax": "Softmax",
    "log_softmax": "LogSoftmax",
    "hard_silu": "Hardswish",
    "hard_swish": "Hardswish",
}


def _engine_op(kind: str) -> str:
    """An activation's kind as the engine names the operation that made an output."""
    return {"ReLU": "Relu", "ReLU6": "Relu6"}.get(kind, kind)


def _activation_kind(layer: Any) -> Optional[str]:
    """The kind of the activation a layer applies to its output (``Dense(activation=...)``,
    ``Activation(...)``, ``ReLU()``), or None."""
    fn = getattr(layer, "activation", None)
    if fn is None:
        return {"ReLU": "ReLU", "LeakyReLU": "LeakyReLU", "ELU": "ELU", "Softmax": "Softmax"}.get(type(layer).__name__)
    fn_name = getattr(fn, "__name__", None)
    return _ACTIVATIONS.get(str(fn_name)) if fn_name else None


# Keras losses as the engine's loss facts: the operations each applies to the model's output,
# named as the engine names them (PyTorch's autograd names, `LossSpec.ops`), for logits and for
# probabilities (`from_logits=False`: the loss divides the output by its sum over the classes,
# then takes its log).
_CROSS_ENTROPY = (["NllLoss", "LogSoftmax"], ["Mean", "Neg", "Sum", "Mul", "Log", "Div"])
_LOSS_OPS = {
    "categorical_crossentropy": _CROSS_ENTROPY,
    "sparse_categorical_crossentropy": _CROSS_ENTROPY,
    "binary_crossentropy": (["BinaryCrossEntropyWithLogits"], ["BinaryCrossEntropy", "Log"]),
    "mean_squared_error": (["MseLoss"], ["MseLoss"]),
    "mean_absolute_error": (["L1Loss"], ["L1Loss"]),
    "huber": (["HuberLoss"], ["HuberLoss"]),
}
# Weight penalties a layer can carry (`kernel_regularizer=L2(...)`): Keras adds them to the loss.
_REGULARIZERS = (
    "kernel_regularizer",
    "bias_regularizer",
    "recurrent_regularizer",
    "depthwise_regularizer",
    "pointwise_regularizer",
)


# Layers that pass their input's values on (or drop some, during training): the output's
# activation is that of the layer before them.
_PASS_THROUGH = {
    "Dropout",
    "SpatialDropout1D",
    "SpatialDropout2D",
    "SpatialDropout3D",
    "GaussianNoise",
    "GaussianDropout",
    "AlphaDropout",
    "Reshape",
    "Flatten",
    "Permute",
    "Identity",
    "ActivityRegularization",
}


def _output_layer(tensor: Any) -> Any:
    """The layer that made a Sequential or functional model's output tensor, past layers that
    only pass values on (None where Keras does not say)."""
    try:
        layer = tensor._keras_history.operation
        for _ in range(16):
            if type(layer).__name__ not in _PASS_THROUGH:
                return layer
            node = layer._inbound_nodes[0]
            layer = node.input_tensors[0]._keras_history.operation
    except Exception:  # pragma: no cover - a graph Keras does not expose: no fact
        return None
    return None


def _compiled_loss(model: Any) -> Tuple[Optional[str], Dict[str, Any]]:
    """The name of the compiled loss's function (``sparse_categorical_crossentropy``) and its
    keyword arguments (``from_logits``)."""
    loss = getattr(model, "loss", None)
    if isinstance(loss, str):
        loss = keras.losses.get(loss)
    fn = getattr(loss, "fn", loss)
    return getattr(fn, "__name__", None), getattr(loss, "_fn_kwargs", None) or {}


def _loss_facts(model: Any) -> Optional[Dict[str, Any]]:
    """The compiled loss and the model's output as facts for the engine (`LossSpec`): the
    operations the loss applies, the output's activation and units, and how many weights carry
    a penalty Keras adds to the loss. None for a loss it does not know (a custom function,
    several outputs)."""
    name, kwargs = _compiled_loss(model)
    outputs = getattr(model, "outputs", None)  # (None for a subclassed model)
    if name not in _LOSS_OPS or (outputs is not None and len(outputs) != 1):
        return None
    facts: Dict[str, Any] = {"ops": list(_LOSS_OPS[name][0 if kwargs.get("from_logits") else 1])}
    producer = _output_layer(outputs[0]) if outputs else None
    if producer is not None:  # (a subclassed model's output layer is not known)
        kind = _activation_kind(producer) or "Linear"
        facts["output_op"] = _engine_op(kind)
    units = outputs[0].shape[-1] if outputs else None
    if isinstance(units, int):
        facts["output_units"] = units

    def penalties(layer: Any) -> int:
        own = sum(getattr(layer, r, None) is not None for r in _REGULARIZERS)
        return own + sum(penalties(child) for child in _children(layer))

    penalized = penalties(model)
    if penalized:
        facts["penalized_params"] = penalized
    return facts


def _children(layer: Any) -> List[Any]:
    try:
        return list(layer._flatten_layers(include_self=False, recursive=False))
    except Exception:  # pragma: no cover - very old Keras 3
        return list(getattr(layer, "layers", []))


class _Model:
    """The model's trainable variables, each owned by the innermost layer that holds it, named
    ``layer_path.variable_name``; layers in the order Keras lists them (a functional or
    Sequential model's topological order; a subclassed model's attribute order)."""

    def __init__(self, model: Any) -> None:
        self.entries: List[ParamEntry] = []
        self.variables: List[Any] = []
        self.extra: List[Tuple[Tuple[str, ...], str, float]] = []
        # The layer whose output each activation module (by its name) is.
        self.activation_layers: Dict[str, Any] = {}
        # Numeric attributes of modules the engine reads (the share a dropout layer zeroes).
        self.attrs: Dict[Tuple[str, ...], List[List[Any]]] = {}
        seen: Dict[int, int] = {}
        counter = [0]

        def walk(layer: Any, path: Tuple[str, ...]) -> None:
            rank = float(counter[0])
            counter[0] += 1
            for child in _children(layer):
                walk(child, path + (str(child.name),))
            for v in getattr(layer, "trainable_weights", []):
                if id(v) in seen:
                    continue
                seen[id(v)] = len(self.entries)
                leaf = str(getattr(v, "name", "w")).split("/")[-1]
                self.entries.append(ParamEntry(path, leaf, tuple(v.shape), type(layer).__name__, rank))
                self.variables.append(v)
            rate = getattr(layer, "rate", None)
            if path and "Dropout" in type(layer).__name__ and isinstance(rate, (int, float)):
                self.extra.append((path, "Dropout", rank))
                self.attrs[path] = [["p", float(rate)]]
            act = _activation_kind(layer) if path else None
            if act is not None:
                owns = any(e.layer == path for e in self.entries)
                # The activation's output is the layer's: it comes right after the layer's
                # own transform in the forward order.
                where = path + ("activation",) if owns else path
                self.extra.append((where, act, rank + 0.5))
                self.activation_layers[".".join(where)] = layer

        walk(model, ())
        if not self.entries:
            raise ModelError(f"{type(model).__qualname__} has no trainable variable to watch")
        order = spec_order(self.entries)
        self.entries = [self.entries[i] for i in order]
        self.variables = [self.variables[i] for i in order]
        self.index = {id(v): j for j, v in enumerate(self.variables)}
        self.root_kind = type(model).__name__

    def spec(self, optimizer: Optional[str]) -> Dict[str, Any]:
        return model_spec(self.entries, self.root_kind, optimizer, self.extra, framework="keras", attrs=self.attrs)


def _activation_stats(y: Any, probe: Dict[str, Any]) -> Any:
    """The engine's activation row for one output (absmax, saturated share, dead share, mean
    slope, samples per unit; NaN where the probe asks nothing), with ``keras.ops``, features
    last. The same statistics as the PyTorch collector's ``activation_group``."""
    y = ops.cast(y, "float32")
    shape = tuple(int(d) for d in y.shape)
    units = shape[-1] if shape else 1
    numel = int(np.prod(shape)) if shape else 1
    flat = ops.reshape(y, (-1,))
    nan = ops.convert_to_tensor(float("nan"), dtype="float32")
    if probe.get("death"):
        per_unit = ops.max(ops.reshape(y, (-1, units)), axis=0)
        absmax = ops.max(ops.abs(per_unit))
        dead = ops.mean(ops.cast(ops.equal(per_unit, 0.0), "float32"))
    else:
        absmax = ops.max(ops.abs(flat))
        dead = nan
    sat = probe.get("saturation")
    saturated = nan
    if sat is not None:
        center, half = float(sat[0]), float(sat[1])
        saturated = ops.mean(ops.cast(ops.greater(ops.abs(flat - center), half), "float32"))
    kind = probe.get("slope")
    sq = ops.mean(ops.square(flat))
    slope = {
        "tanh": lambda: 1.0 - sq,
        "sigmoid": lambda: ops.mean(flat) - sq,
        "softsign": lambda: 1.0 - 2.0 * ops.mean(ops.abs(flat)) + sq,
    }.get(str(kind), lambda: nan)()
    samples = ops.convert_to_tensor(numel / max(units, 1), dtype="float32")
    return ops.stack([ops.cast(v, "float32") for v in (absmax, saturated, dead, slope, samples)])


def _first_float(x: Any) -> Any:
    """The model's first floating-point input tensor (of a tensor, or a list or dict of them),
    None when it has none (token ids only)."""
    try:
        for v in keras.tree.flatten(x):
            dtype = getattr(v, "dtype", None)
            if dtype is not None and "float" in keras.backend.standardize_dtype(dtype) and len(v.shape) >= 1:
                return v
    except Exception:  # an input structure Keras cannot flatten: not measured
        return None
    return None


def _pooled_inputs(before: Any, last: Any, j: Any, xp: Any) -> Any:
    """The ``min, max, mean, std`` of ``j + 1`` equal micro-batches of one update (gradient
    accumulation) from those of the first ``j`` (``before``) and of the last (``last``); a NaN
    in either stays (``xp``: numpy, or jax.numpy in the compiled step)."""
    mean = (before[2] * j + last[2]) / (j + 1)
    squares = ((before[3] ** 2 + before[2] ** 2) * j + last[3] ** 2 + last[2] ** 2) / (j + 1)
    spread = xp.sqrt(xp.maximum(squares - mean**2, 0.0))
    return xp.stack([xp.minimum(before[0], last[0]), xp.maximum(before[1], last[1]), mean, spread])


def _input_stats(x: Any) -> Any:
    """``min, max, mean, std`` of an input batch (float32; NaN when ``x`` is None), the
    PyTorch collector's ``input_stats``."""
    if x is None:
        return ops.full((INPUT_STATS,), float("nan"), "float32")
    x = ops.cast(x, "float32")
    return ops.stack([ops.min(x), ops.max(x), ops.mean(x), ops.std(x)])


# Losses whose targets are values to regress (their range and variance are facts of the run).
_REGRESSION_OPS = {"MseLoss", "L1Loss", "HuberLoss"}
# The first batch's facts: targets' min, max, variance; output's min, max and elements; the
# entropy of the class indices' frequencies (or of a binary cross-entropy's 0/1 targets) and its
# standard error; the output's spread across the batch; the most
# labels present in one sample (a binary cross-entropy's); then per feature.
_FACTS_HEAD = 10


def _table_features(model: Any) -> int:
    """Features of the model's input when it is a table of 2 to :data:`MAX_FEATURES` (a
    Sequential or functional model whose first input is ``(batch, features)``), else 0."""
    try:
        shape = tuple(model.inputs[0].shape)
    except Exception:  # a subclassed model does not say before it runs
        return 0
    f = shape[-1] if len(shape) == 2 else None
    return f if isinstance(f, int) and 2 <= f <= MAX_FEATURES else 0


def _class_entropy(y: Any, y_pred: Any) -> Any:
    """The entropy (nats) of how often each class occurs among class-index targets ``y``, over
    the output's units (indices outside them not counted), and its standard error as an
    estimate from this batch, as a ``(2,)`` float32: the loss of a model that predicts those
    frequencies and nothing of the input."""
    units = y_pred.shape[-1]
    if not isinstance(units, int) or units < 2:
        return ops.full((2,), float("nan"), "float32")
    try:
        idx = ops.cast(ops.reshape(y, (-1,)), "int32")
        kept = ops.cast(ops.logical_and(idx >= 0, idx < units), "float32")
        counts = ops.sum(ops.one_hot(ops.clip(idx, 0, units - 1), units) * ops.expand_dims(kept, 1), axis=0)
        return _entropy_and_error(counts / ops.maximum(ops.sum(counts), 1.0), ops.sum(counts))
    except Exception:  # pragma: no cover - a backend without these ops: this fact only is lost
        return ops.full((2,), float("nan"), "float32")


def _one_hot_entropy(y: Any) -> Any:
    """:func:`_class_entropy` of one-hot targets ``y`` (a categorical cross-entropy's, classes
    along the last axis), where every row is one 1 and zeros (NaN for smoothed labels)."""
    try:
        t = ops.cast(y, "float32")
        rows = ops.reshape(t, (-1, t.shape[-1]))
        counts = ops.sum(rows, axis=0)
        out = _entropy_and_error(counts / ops.maximum(ops.sum(counts), 1.0), ops.sum(counts))
        hard = ops.logical_and(
            ops.all(ops.logical_or(ops.equal(rows, 0.0), ops.equal(rows, 1.0))),
            ops.all(ops.equal(ops.sum(rows, 1), 1.0)),
        )
        return ops.where(hard, out, float("nan"))
    except Exception:  # pragma: no cover - a backend without these ops: this fact only is lost
        return ops.full((2,), float("nan"), "float32")


def _binary_entropy(y: Any) -> Any:
    """A binary cross-entropy's counterpart of :func:`_class_entropy`: the entropy of how often
    a target is 1, over all of the batch's targets, and its standard error, where every target
    is 0 or 1 (NaN for soft targets)."""
    try:
        t = ops.cast(y, "float32")
        p = ops.mean(t)
        out = _entropy_and_error(ops.stack([p, 1.0 - p]), ops.cast(ops.size(t), "float32"))
        hard = ops.all(ops.logical_or(ops.equal(t, 0.0), ops.equal(t, 1.0)))
        return ops.where(hard, out, float("nan"))
    except Exception:  # pragma: no cover - a backend without these ops: this fact only is lost
        return ops.full((2,), float("nan"), "float32")


def _entropy_and_error(p: Any, n: Any) -> Any:
    """The entropy of frequencies ``p`` measured on ``n`` samples and its standard error (the
    delta method: the variance of ``-ln p`` over the samples, over ``n``), as a ``(2,)``."""
    logs = ops.where(p > 0, ops.log(ops.where(p > 0, p, 1.0)), 0.0)
    h = -ops.sum(p * logs)
    second = ops.sum(p * logs * logs)
    se = ops.sqrt(ops.maximum(second - h * h, 0.0) / ops.maximum(n, 1.0))
    return ops.stack([h, se])


def _batch_spread(y_pred: Any) -> Any:
    """How far the output varies across the batch, as a ``(1,)`` float32: the largest range
    over the batch of any one output element, over the output's largest magnitude (0 when
    every sample got the same output; NaN for fewer than 2 samples)."""
    n = y_pred.shape[0] if len(y_pred.shape) else None
    if not isinstance(n, int) or n < 2:
        return ops.full((1,), float("nan"), "float32")
    try:
        flat = ops.reshape(ops.cast(y_pred, "float32"), (n, -1))
        spread = ops.max(ops.max(flat, axis=0) - ops.min(flat, axis=0))
        scale = ops.max(ops.abs(flat))
        return ops.reshape(ops.where(scale > 0, spread / ops.where(scale > 0, scale, 1.0), 0.0), (1,))
    except Exception:  # pragma: no cover - a backend without these ops: this fact only is lost
        return ops.full((1,), float("nan"), "float32")


def _first_batch_stats(x: Any, y: Any, y_pred: Any, features: int, targets: str = "", weighted: bool = False) -> Any:
    """The first batch's facts as one float32 vector (NaN where not measured): the targets'
    min, max and variance, the output's min and max and its number of elements, the entropy
    of the targets' class frequencies and its standard error (``targets``: ``"indices"``, a
    sparse cross-entropy's; ``"one_hot"``, a categorical cross-entropy's; ``"labels"``, a
    binary cross-entropy's), the output's spread across the batch, the most targets >= 0.5 in
    one sample (a binary cross-entropy's ``labels``), and the largest magnitude of each of
    ``features`` columns of the input table ``x``. Under sample weights (``class_weight``) no
    frequencies: the weighted loss of a constant guess is not their entropy."""
    nan = ops.full((1,), float("nan"), "float32")

    def three(t: Any) -> List[Any]:
        if t is None or not hasattr(t, "shape"):
            return [nan, nan, nan]
        t = ops.cast(t, "float32")
        return [ops.reshape(ops.min(t), (1,)), ops.reshape(ops.max(t), (1,)), ops.reshape(ops.var(t), (1,))]

    parts = three(y) + three(y_pred)[:2]
    parts.append(ops.reshape(ops.cast(ops.size(y_pred), "float32"), (1,)) if hasattr(y_pred, "shape") else nan)
    labels = targets == "labels"
    counted = "" if weighted or not hasattr(y, "shape") else targets
    if counted == "indices" and hasattr(y_pred, "shape"):
        parts.append(_class_entropy(y, y_pred))
    elif counted == "one_hot":
        parts.append(_one_hot_entropy(y))
    elif counted == "labels":
        parts.append(_binary_entropy(y))
    else:
        parts.append(ops.full((2,), float("nan"), "float32"))
    parts.append(_batch_spread(y_pred) if hasattr(y_pred, "shape") else nan)
    if labels and hasattr(y, "shape") and len(y.shape) >= 2:
        present = ops.sum(ops.cast(ops.greater_equal(ops.cast(y, "float32"), 0.5), "float32"), axis=-1)
        parts.append(ops.reshape(ops.max(present), (1,)))
    else:
        parts.append(nan)
    if features:
        xf = _first_float(x)
        if xf is not None and len(xf.shape) == 2 and xf.shape[-1] == features:
            parts.append(ops.max(ops.abs(ops.cast(xf, "float32")), axis=0))
        else:
            parts.append(ops.full((features,), float("nan"), "float32"))
    return ops.concatenate(parts)


def _sum_of_squares(g: Any) -> Any:
    """A gradient's sum of squares (float32). A TensorFlow ``IndexedSlices`` (an embedding's
    gradient) by its rows, those of a repeated index added together first."""
    if hasattr(g, "indices") and hasattr(g, "values") and hasattr(g, "dense_shape"):
        import tensorflow as tf

        unique, position = tf.unique(g.indices)
        g = tf.math.unsorted_segment_sum(g.values, position, tf.shape(unique)[0])
    # |g| * |g|, not square(g): XLA would merge that with the optimizer's own square of the
    # gradient and then write it to memory instead of fusing it into the update. |g| written
    # twice: one |g| used twice compiles to 5 more kernels (`bench/jax_kernels.py keras`).
    return ops.sum(ops.abs(ops.cast(g, "float32")) * ops.abs(ops.cast(g, "float32")))


def _wrap_call(obj: Any, make: Callable[[Any], Callable[..., Any]], name: str = "call") -> None:
    """Replaces ``obj.<name>`` for the run (an instance attribute, removed by
    :func:`_unwrap_call`); a wrapper left by an earlier run that raised is replaced, not
    stacked."""
    current = obj.__dict__.get(name)
    inner = getattr(current, "_neuraldbg_inner", None) or getattr(obj, name)
    wrapper = make(inner)
    wrapper._neuraldbg_inner = inner  # type: ignore[attr-defined]
    wrapper._neuraldbg_kept = current if current is not None and not hasattr(current, "_neuraldbg_inner") else None  # type: ignore[attr-defined]
    object.__setattr__(obj, name, wrapper)


def _unwrap_call(obj: Any, name: str = "call") -> None:
    current = obj.__dict__.get(name)
    if current is None or not hasattr(current, "_neuraldbg_inner"):
        return
    kept = current._neuraldbg_kept
    if kept is None:
        object.__delattr__(obj, name)
    else:
        object.__setattr__(obj, name, kept)


# The model's methods replaced for a run on JAX, which leave its rings out of what the model
# saves, loads, gives and is given as its weights.
_HIDING = ("save_own_variables", "load_own_variables", "get_weights", "set_weights")


def _distributed() -> bool:
    """Whether a Keras distribution (``keras.distribution.set_distribution``) is in force."""
    try:
        return keras.distribution.distribution() is not None
    except Exception:  # a Keras without distributions
        return False


def _replicas(model: Any) -> int:
    """The replicas a TensorFlow distribution strategy runs the step on (1 elsewhere)."""
    if keras.backend.backend() != "tensorflow":
        return 1
    try:
        n = int(model.distribute_strategy.num_replicas_in_sync)
    except Exception:  # pragma: no cover - no strategy to ask
        return 1
    return max(n, 1)


def _watched_optimizer(opt: Any) -> Any:
    """The optimizer that applies the updates: ``LossScaleOptimizer`` unwrapped."""
    while isinstance(opt, keras.optimizers.LossScaleOptimizer):
        opt = opt.inner_optimizer
    return opt


def _symbolic(x: Any) -> bool:
    return isinstance(x, keras.KerasTensor)


def _unpack(row: np.ndarray, sizes: Tuple[int, ...]) -> List[np.ndarray]:
    """The arrays a step packed end to end into ``row`` (float32, of these flattened sizes)."""
    ends = np.cumsum(sizes)
    return [row[end - size : end] for size, end in zip(sizes, ends)]


def _emitter(backend: str, per_call: int) -> Callable[..., Any]:
    """How a compiled train step hands arrays to a host function, per Keras backend. Returns
    an acknowledgement to fold into the step's result where the backend would otherwise prune
    the call (JAX), else None. On TensorFlow a :class:`_Mailbox`, eagerly (PyTorch) a
    :class:`_Deferred`: both read between batches."""
    if backend == "jax":
        import jax
        import jax.numpy as jnp

        def host(fn: Callable[..., None], sizes: Tuple[int, ...], packed: Any) -> np.ndarray:
            fn(*_unpack(np.asarray(packed, dtype=np.float32), sizes))
            return np.zeros((), np.float32)

        def emit_jax(fn: Callable[..., None], *args: Any) -> Any:
            # One packed vector in a pure callback: an effect (debug/io callback) would take the
            # whole train step, with every variable as an argument, off JAX's fast dispatch.
            flat = [jnp.ravel(jax.lax.stop_gradient(jnp.asarray(a))) for a in args]
            flat = [
                jax.lax.bitcast_convert_type(f, jnp.float32) if f.dtype == jnp.int32 else f.astype(jnp.float32)
                for f in flat
            ]
            sizes = tuple(int(f.shape[0]) for f in flat)
            return jax.pure_callback(
                functools.partial(host, fn, sizes), jax.ShapeDtypeStruct((), jnp.float32), jnp.concatenate(flat)
            )

        return emit_jax
    if backend == "tensorflow":
        return _Mailbox(per_call)

    deferred = _Deferred()
    if backend == "torch":
        import torch

        # Under jit_compile=True (torch.compile): a graph break, never traced into.
        deferred.keep = torch.compiler.disable(deferred.keep)
    return deferred


class _Deferred:
    """How an eager step (PyTorch) hands arrays to the host: each call's arrays are kept where
    they are (copies, on the device) and handed over when the host reads between batches
    (:meth:`read`, in call order): no copy to the host, so no wait for the device, in the step."""

    # Calls kept between two reads: the host reads once the steps since its last read fill half
    # of them (``KerasDbg._read_every``), as for the mailbox's rings.
    rows = 64

    def __init__(self) -> None:
        self.calls: List[Tuple[Callable[..., None], Tuple[Any, ...]]] = []
        self.keep: Callable[..., None] = self._keep
        self.once_kept: Set[Any] = set()

    def __call__(self, fn: Callable[..., None], *args: Any) -> None:
        self.keep(fn, *args)

    def once(self, fn: Callable[..., None], make: Callable[[], Tuple[Any, ...]]) -> None:
        """A call the first time only: ``make()`` (the arrays) is not computed again."""
        if fn not in self.once_kept:
            self.once_kept.add(fn)
            self.keep(fn, *make())

    def _keep(self, fn: Callable[..., None], *args: Any) -> None:
        kept = tuple(a if isinstance(a, np.ndarray) else ops.copy(ops.stop_gradient(a)) for a in args)
        self.calls.append((fn, kept))

    def read(self) -> None:
        calls, self.calls = self.calls, []
        for fn, args in calls:
            fn(*(ops.convert_to_numpy(a) for a in args))


class _Mailbox:
    """How a TensorFlow train step hands arrays to the host: each call site's arrays go into a
    ring variable of its own, written in the step (as JAX's rings are), and the host reads the
    rows between batches (:meth:`read`, in the order the boxes were opened: a forward pass
    before the update it follows). No host call in the step: ``tf.numpy_function`` cannot be
    compiled by XLA (``jit_compile=True``, TensorFlow's default on a GPU) and would stop the
    user's ``fit``. Integer arrays travel as the bits of float32 (as on JAX)."""

    # Rows per call site: the host reads once the steps since its last read fill half of them
    # (``KerasDbg._read_every``); more calls than rows between two reads would lose the oldest.
    ROWS = 64

    def __init__(self, per_call: int = 1) -> None:
        self.rows = max(self.ROWS, 4 * per_call)
        # fn -> [ring variable, sizes, next count to read]
        self.boxes: Dict[Any, List[Any]] = {}

    def open(self, fn: Callable[..., None], sizes: Tuple[int, ...]) -> None:
        """A box for ``fn``'s arrays (of these flattened sizes), made before the step is traced:
        a ``tf.function`` takes no variable made by a later trace than its first. Its ring has
        one row per call (``count % rows``) and, last, the count of calls (int32 bits)."""
        import tensorflow as tf

        with tf.init_scope():
            ring = tf.Variable(tf.zeros((self.rows + 1, sum(sizes)), tf.float32), trainable=False)
        self.boxes[fn] = [ring, tuple(sizes), 0]

    def __call__(self, fn: Callable[..., None], *args: Any) -> None:
        import tensorflow as tf

        flat = [tf.reshape(tf.stop_gradient(tf.convert_to_tensor(a)), [-1]) for a in args]
        flat = [tf.bitcast(f, tf.float32) if f.dtype == tf.int32 else tf.cast(f, tf.float32) for f in flat]
        sizes = tuple(int(f.shape[0]) for f in flat)
        box = self.boxes.get(fn)
        if box is None or box[1] != sizes:
            raise ModelError(f"no box of sizes {sizes} for {getattr(fn, '__name__', fn)}")
        replica = tf.distribute.get_replica_context()
        # Under a strategy of several replicas the first writes: the others hold the same
        # update (and forward passes of their own shards).
        if replica is not None and tf.get_static_value(replica.replica_id_in_sync_group) not in (0, None):
            return
        ring = box[0]
        n = tf.bitcast(ring[self.rows, 0], tf.int32)
        count = tf.pad(tf.reshape(tf.bitcast(n + 1, tf.float32), (1,)), [[0, sum(sizes) - 1]])
        # This call's row and the count, in one update of the variable.
        ring.scatter_nd_update(tf.stack([[n % self.rows], [self.rows]]), tf.stack([tf.concat(flat, 0), count]))

    def once(self, fn: Callable[..., None], make: Callable[[], Tuple[Any, ...]]) -> None:
        """A call while ``fn``'s box holds no row yet: ``make()`` (the arrays) is computed under
        a ``tf.cond``, so that the steps after the first compute nothing for it."""
        import tensorflow as tf

        box = self.boxes.get(fn)
        if box is None:
            raise ModelError(f"no box for {getattr(fn, '__name__', fn)}")
        n = tf.bitcast(box[0][self.rows, 0], tf.int32)

        def first() -> Any:
            self(fn, *make())
            return tf.constant(0)

        tf.cond(tf.equal(n, 0), first, lambda: tf.constant(0))

    def read(self) -> None:
        """The rows written since the last read, to their host functions (the main thread,
        between calls of the train function)."""
        for fn, box in list(self.boxes.items()):
            ring, sizes, start = box
            buf = ring.numpy()
            n = int(buf[self.rows, :1].view(np.int32)[0])
            if n <= start:
                continue
            first = max(start, n - self.rows)
            if first > start:  # not when read every few batches; said if it happens
                warnings.warn(
                    f"NeuralDBG missed {first - start} calls of {getattr(fn, '__name__', fn)}: more ran between "
                    f"two reads than its ring holds ({self.rows} rows)",
                    NeuralDbgWarning,
                    stacklevel=3,
                )
            for j in range(first, n):
                fn(*_unpack(buf[j % self.rows], sizes))
            box[2] = n


class KerasDbg(Spoke):
    """The debugger of one ``fit`` run (``NeuralDbgCallback.dbg``): the members of the PyTorch
    ``NeuralDbg`` (``events``, ``explain_failure()``, ``history()``, ``save_report()``, ...)."""

    _loss_apart = True

    def __init__(self, model: Any, *, activations: bool = True, **options: Any) -> None:
        super().__init__(**options)
        if not isinstance(activations, bool):
            raise ConfigError(f"activations must be True or False, got {activations!r}")
        self._measure_activations = activations
        self.model = model
        self._model = _Model(model)
        # The optimizer whose updates are watched: a LossScaleOptimizer's inner one (it gets the
        # unscaled gradients, and only on the steps it applies).
        self._optimizer = _watched_optimizer(model.optimizer)
        # Keras's gradient accumulation: one step per this many batches (micro-batches).
        accumulate = getattr(self._optimizer, "gradient_accumulation_steps", None)
        self._accumulate = accumulate if isinstance(accumulate, int) and accumulate > 1 else 1
        # Off JAX each micro-batch hands its update's numbers over, the last one complete: a step
        # goes to the engine once the next one shows up (on JAX the ring's row is complete first).
        self._last_wins = self._accumulate > 1 and keras.backend.backend() != "jax"
        self._original: Any = None
        self._base = 0
        # Running-mean bookkeeping of the logged loss, per epoch: (last batch, its mean).
        self._last_mean: Optional[Tuple[int, float]] = None
        self._epoch_base = 0
        self._epoch_batches = 0
        self._wrapped_layers: List[Any] = []
        self._lock = threading.Lock()
        per_call = getattr(model, "steps_per_execution", 1)
        self._per_call = per_call if isinstance(per_call, int) and per_call > 0 else 1
        self._emit = _emitter(keras.backend.backend(), self._per_call)
        # Eager backends: the calls of the optimizer's apply observed so far (batches).
        self._applies = 0
        # TensorFlow: the replicas of the model's distribution strategy (1 without one).
        self._replicas = _replicas(model)
        self._collecting: Optional[Dict[int, Any]] = None
        self._forwards = 0
        # The input statistics of the update's micro-batches so far (gradient accumulation).
        self._pass_inputs: Optional[np.ndarray] = None
        # A subclassed model's output activation, read from its forward passes (`_note_output`):
        # whether it is still unknown, the kind found until given to the engine.
        self._output_unknown = False
        self._output_op: Optional[str] = None
        # (output, layer) of the layers with an activation called in this forward pass.
        self._made: Optional[List[Tuple[Any, Any]]] = None
        # JAX: the ring buffer the train step writes each update's numbers into (an optimizer
        # variable for the run), its place in the optimizer's variables, and its reader.
        self._ring_var: Any = None
        self._ring_index = -1
        self._ring: Optional[RingReader] = None
        # JAX: the activation ring (a non-trainable model variable for the run) and its reader;
        # the probes measured, by row.
        # JAX: the rings are read every this many batches (batches met so far); the steps
        # whose loss the fit loop has handed over.
        self._read_every = 1
        self._batches = 0
        self._losses = 0
        self._loss_seen = threading.Condition()
        self._act_var: Any = None
        self._act_index = -1
        # JAX: the first batch's facts, ``[written (1 or 0), facts]``, a small non-trainable
        # variable of the model beside the activation ring, and its place.
        self._facts_var: Any = None
        self._facts_index = -1
        self._act_ring: Optional[RingReader] = None
        self._act_probes: Dict[int, Dict[str, Any]] = {}
        # How far the first updates move the weights, measured on the host between batches:
        # the batches begun, and the weights' samples after the last measured update (their count).
        self._begun = 0
        self._samples: Optional[Tuple[int, List[Any]]] = None
        # The first batch's facts (targets, output, the input table's features), measured where
        # the loss is computed: whether the loss regresses values, the table's features, and
        # (off JAX) whether they were sent.
        self._regression = False
        self._binary = False
        # What the targets' class frequencies are counted from (see `_first_batch_stats`):
        # "indices" (a sparse categorical cross-entropy's: the targets' range is then the
        # classes'), "one_hot", "labels" (a binary cross-entropy's), or "" (none).
        self._counted = ""
        self._features = 0
        self._facts_sent = False

    def start(self) -> None:
        opt = self._optimizer
        meta = {"keras": keras.__version__, "backend": keras.backend.backend(), "model": type(self.model).__qualname__}
        spec = self._model.spec(type(opt).__name__ if opt is not None else None)
        try:
            spec["loss"] = _loss_facts(self.model)
        except Exception:  # pragma: no cover - facts are optional
            spec["loss"] = None
        self._spec_modules = spec["modules"]
        loss = spec.get("loss")
        self._output_unknown = bool(loss) and "output_op" not in loss
        self._regression = bool(loss) and any(op in _REGRESSION_OPS for op in loss["ops"])
        self._binary = bool(loss) and any(op.startswith("BinaryCrossEntropy") for op in loss["ops"])
        name = _compiled_loss(self.model)[0] if loss else None
        counted = {"sparse_categorical_crossentropy": "indices", "categorical_crossentropy": "one_hot"}
        self._counted = counted.get(name or "", "labels" if self._binary else "")
        self._features = _table_features(self.model)
        self._start(spec, meta)
        self._base = int(ops.convert_to_numpy(opt.iterations)) if opt is not None else 0
        outer = self.model.optimizer
        if outer is not None and not outer.built:
            # TensorFlow's fit builds it in the first traced update: the variables it would make
            # there, made now (the update reads its accumulated gradients).
            outer.build(self.model.trainable_variables)
        if opt is not None:
            current = opt.__dict__.get("apply")
            # A wrapper left by a run that raised out of fit is replaced, not stacked.
            original = getattr(current, "_neuraldbg_inner", None) or opt.apply
            self._original = current if current is not None and not hasattr(current, "_neuraldbg_inner") else None

            def apply(grads: Any, trainable_variables: Any = None) -> Any:
                if self._active and self._replicas == 1:
                    try:
                        self._observe(grads, trainable_variables)
                    except Exception as e:  # our statistics failed to build: train on, unobserved
                        warnings.warn(f"NeuralDBG cannot observe this update: {e}", NeuralDbgWarning, stacklevel=2)
                return original(grads, trainable_variables)

            apply._neuraldbg_inner = original  # type: ignore[attr-defined]
            # An instance attribute: `stateless_apply` and `apply_gradients` call `self.apply`.
            object.__setattr__(opt, "apply", apply)
            if self._replicas > 1:
                _wrap_call(opt, self._summed_call, "_all_reduce_sum_gradients")
            if keras.backend.backend() == "jax":
                self._add_ring(opt)
        if self._measure_activations:
            self._watch_forward()
        if isinstance(self._emit, _Mailbox):
            # What the step hands over, in the order the host takes it: the forward pass, the
            # first batch's facts, the update.
            if self._measure_activations:
                self._emit.open(self._receive_activations, (1 + INPUT_STATS + 5 * len(self._probes),))
            self._emit.open(self._receive_first_batch, (_FACTS_HEAD + self._features,))
            n = len(self._model.entries)
            self._emit.open(self._receive, (1, n, n, 1))
        rows = self._ring.rows if self._ring is not None else getattr(self._emit, "rows", 0)
        if rows:
            # Each read covers the batches since the last one: at most half the ring's rows.
            self._read_every = max(1, min(16, rows // (2 * self._per_call)))

    def _add_ring(self, opt: Any) -> None:
        """On JAX, the update's numbers go into a ring buffer that the train step carries as an
        optimizer variable, read by the host from the fit loop's state after each batch: no host
        callback in the compiled step (one takes every call off JAX's fast dispatch path)."""
        outer = self.model.optimizer
        owners = [opt] if outer is opt else [opt, outer]
        for v in opt.variables:  # left by a run that raised out of fit
            if getattr(v, "_neuraldbg_ring", False):
                opt._untrack_variable(v)
        for o in owners:
            for name in ("save_own_variables", "load_own_variables"):
                o.__dict__.pop(name, None)
        n = len(self._model.entries)
        width = RING_HEAD + 2 * n
        rows = self._ring_rows(width)
        init = np.zeros((rows + 1, width), np.float32)
        init[:rows, 0] = np.array([-1], np.int32).view(np.float32)[0]
        # The last row: updates made, the marker, and the optimizer's update count when fit
        # began: the step reads it from its state rather than as a constant, so that the next
        # watched fit of this model runs the same compiled step.
        init[rows, :3] = np.array([0, RING_MARKER, self._base], np.int32).view(np.float32)
        var = opt.add_variable((rows + 1, width), initializer="zeros", dtype="float32", name="neuraldbg_ring")
        var.assign(init)
        var._neuraldbg_ring = True
        self._ring_var = var

        # A checkpoint saved during the run holds the optimizers' own variables, not the ring
        # (a LossScaleOptimizer lists its inner optimizer's variables with its own).
        for o in owners:
            self._hide_from_checkpoints(o, var)
        self._ring_index = next(i for i, v in enumerate(outer.variables) if v is var)
        self._ring = RingReader(self, rows, width)

    @staticmethod
    def _hide_from_checkpoints(opt: Any, var: Any) -> None:
        def others() -> List[Any]:
            return [v for v in opt.variables if v is not var]

        def save_own_variables(store: Any) -> None:
            for i, v in enumerate(others()):
                store[str(i)] = v.numpy()

        def load_own_variables(store: Any) -> None:
            for i, v in enumerate(others()):
                if str(i) in store:
                    v.assign(store[str(i)])

        object.__setattr__(opt, "save_own_variables", save_own_variables)
        object.__setattr__(opt, "load_own_variables", load_own_variables)

    def _remove_ring(self) -> None:
        var, self._ring_var = self._ring_var, None
        opt = self._optimizer
        if var is not None and opt is not None:
            opt._untrack_variable(var)
            for o in {id(opt): opt, id(self.model.optimizer): self.model.optimizer}.values():
                for name in ("save_own_variables", "load_own_variables"):
                    o.__dict__.pop(name, None)
        act, self._act_var = self._act_var, None
        facts, self._facts_var = self._facts_var, None
        if act is not None:
            model = self.model
            model._non_trainable_variables[:] = [
                v for v in model._non_trainable_variables if v is not act and v is not facts
            ]
            for name in _HIDING:
                model.__dict__.pop(name, None)

    def _read_ring(self, wait: bool) -> None:
        """The rings of the newest state: the fit loop's (JAX keeps the state out of the variables
        during an epoch), else the variables' own values. The activation ring goes first: an
        update's gradients are taken in only once its forward pass's activations are, so that
        a step never reaches the engine without them."""
        ring = self._ring
        if ring is None:
            return
        state = getattr(self.model, "_jax_state", None)
        if not isinstance(state, dict) or getattr(self.model, "_jax_state_synced", True):
            state = None
        act = self._act_ring
        if act is not None:
            buf = self._newest(state, "non_trainable_variables", self._act_index, self._act_var)
            if buf is not None:
                act.add(buf)
            act.pump(wait=len(act.pending) if wait else 0)
        if self._facts_var is not None and not self._facts_sent:
            buf = self._newest(state, "non_trainable_variables", self._facts_index, self._facts_var)
            if buf is not None and (wait or buf.is_ready()):
                v = np.asarray(buf)
                if v[0] == 1.0:
                    self._facts_sent = True
                    self._amend_first_batch(v[1:])
                elif act is not None and act.next > 0:
                    # The first step ran without writing them (a train_step that does not call
                    # compute_loss): not looked for again.
                    self._facts_sent = True
        buf = self._newest(state, "optimizer_variables", self._ring_index, self._ring_var)
        if buf is not None and (act is None or not act.pending):
            ring.add(buf)
        ring.pump(wait=len(ring.pending) if wait else 0)

    @staticmethod
    def _newest(state: Optional[Dict[str, Any]], key: str, index: int, var: Any) -> Any:
        buf = None
        if state is not None:
            values = state.get(key)
            if values is not None and len(values) > index:
                buf = values[index]
        if buf is None and var is not None:
            try:
                buf = var.value
            except Exception:  # purged by fit, which held the state when its step raised
                buf = None
        return buf if buf is not None and hasattr(buf, "is_ready") else None

    def _wait(self) -> None:
        self._read_ring(wait=True)
        self._read_host()

    def _read_host(self) -> None:
        """Off JAX (the owner thread, between batches): what the steps since the last read
        handed over (the mailbox's rows, the eager step's kept arrays), the first batch's facts
        among them."""
        read = getattr(self._emit, "read", None)
        if read is not None:
            try:
                read()
            except Exception as e:  # pragma: no cover - a measure, never a reason to stop
                warnings.warn(f"NeuralDBG could not read the train step's numbers: {e}", NeuralDbgWarning, stacklevel=2)

    def _watch_forward(self) -> None:
        """The statistics of each training forward pass (``training=True``), computed in the
        compiled step: those of the model's input batch (every pass) and of its activations
        (sampled passes). On JAX they go into a second ring buffer, a non-trainable variable of
        the model for the run (Keras returns those from the forward pass, out of the gradient's
        trace); elsewhere one callback per pass. Layers are wrapped for the run; a model whose
        ``call`` takes no ``training`` argument is not measured (its training passes cannot be
        told from evaluation)."""
        names = [m["name"] for m in self._spec_modules]
        rows = []
        for row, probe in enumerate(self._probes):
            layer = self._model.activation_layers.get(names[probe["module"]])
            if layer is not None:
                rows.append((row, probe, layer))
        self._act_probes = {row: probe for row, probe, _ in rows}
        for row, _, layer in rows:
            _wrap_call(layer, functools.partial(self._layer_call, row=row, layer=layer))
            self._wrapped_layers.append(layer)
        if self._output_unknown:  # the other layers with an activation: which one makes the output
            probed = {id(layer) for _, _, layer in rows}
            for layer in {id(v): v for v in self._model.activation_layers.values()}.values():
                if id(layer) not in probed:
                    _wrap_call(layer, functools.partial(self._made_call, layer=layer))
                    self._wrapped_layers.append(layer)
        if keras.backend.backend() == "jax":
            self._add_activation_ring()

        def model_call(inner: Any) -> Callable[..., Any]:
            def noting(*args: Any, **kwargs: Any) -> Any:
                """The call, noting which layer made its output while that is unknown (any
                pass: a subclassed model's ``call`` may take no ``training`` argument)."""
                if not (self._output_unknown and self._active and self._made is None):
                    return inner(*args, **kwargs)
                self._made = []
                try:
                    out = inner(*args, **kwargs)
                finally:
                    made, self._made = self._made, None
                self._note_output(out, made)
                return out

            def call(*args: Any, **kwargs: Any) -> Any:
                if kwargs.get("training") is not True or not self._active or self._collecting is not None:
                    return noting(*args, **kwargs)
                self._collecting = {}
                try:
                    out = noting(*args, **kwargs)
                finally:
                    collected, self._collecting = self._collecting, None
                try:
                    if not _symbolic(out):
                        x = _first_float(args[0] if args else kwargs.get("inputs"))
                        if self._act_var is not None:
                            if in_stateless_scope():  # the fit loop's step: its state carries the ring
                                self._write_activations(collected, x)
                        else:
                            measured = ops.full((1,), 0.0 if x is None else 1.0, "float32")
                            row = ops.concatenate([measured, _input_stats(x), self._activation_table(collected)])
                            ack = self._emit(self._receive_activations, row)
                            if ack is not None and hasattr(out, "dtype"):
                                # Adds exactly 0: the acknowledgement keeps the call in the step.
                                out = out + ops.cast(ack, out.dtype) * 0
                except Exception as e:  # our statistics failed to build: train on, unmeasured
                    warnings.warn(f"NeuralDBG cannot measure the forward pass: {e}", NeuralDbgWarning, stacklevel=2)
                return out

            return call

        _wrap_call(self.model, model_call)
        self._wrapped_layers.append(self.model)
        _wrap_call(self.model, self._loss_call, "compute_loss")

    def _note_output(self, out: Any, made: List[Tuple[Any, Any]]) -> None:
        """A subclassed model's output activation (its compiled loss's facts could not say it):
        that of the layer whose call returned the model's output, the same object. Given to the
        engine from the owner thread (never raises)."""
        if not self._output_unknown or self._output_op is not None:
            return
        layer = next((layer for value, layer in made if value is out), None)
        kind = _activation_kind(layer) if layer is not None else None
        if kind is None and not _symbolic(out):
            self._output_unknown = False  # made by no activation we know: nothing to claim
        if kind is not None:
            self._output_op = _engine_op(kind)
            self._give_output()

    def _give_output(self) -> None:
        if self._output_op is not None and self._output_unknown and threading.get_ident() == self._owner:
            self._output_unknown = False
            self._give_facts({"output_op": self._output_op}, "the output's activation")

    def _loss_call(self, inner: Any) -> Callable[..., Any]:
        """``model.compute_loss`` for the run: in a training step, the first batch's facts
        (:func:`_first_batch_stats`) from its ``x``, ``y`` and ``y_pred``."""

        def compute_loss(*args: Any, **kwargs: Any) -> Any:
            loss = inner(*args, **kwargs)
            if kwargs.get("training") is True and self._active:
                named = dict(zip(("x", "y", "y_pred", "sample_weight"), args))
                named.update({k: kwargs[k] for k in ("x", "y", "y_pred", "sample_weight") if k in kwargs})
                try:
                    if not _symbolic(named.get("y_pred")):
                        weighted = named.get("sample_weight") is not None
                        self._first_batch(named.get("x"), named.get("y"), named.get("y_pred"), weighted)
                except Exception as e:  # our statistics failed to build: train on, without them
                    self._facts_sent = True
                    warnings.warn(f"NeuralDBG cannot read the first batch: {e}", NeuralDbgWarning, stacklevel=2)
            return loss

        return compute_loss

    def _first_batch(self, x: Any, y: Any, y_pred: Any, weighted: bool = False) -> None:
        """On JAX, traced in the training step: the facts go into their variable on the first
        training step (later steps keep it; the host reads it once). Elsewhere the step hands
        them over once (the emitter's ``once``: eagerly, the first step only; a traced
        TensorFlow step, while its box is empty)."""
        if self._act_var is None:
            once = getattr(self._emit, "once", None)  # (none on JAX: there the facts need their variable)
            if once is not None and not self._facts_sent:
                once(
                    self._receive_first_batch,
                    lambda: (_first_batch_stats(x, y, y_pred, self._features, self._counted, weighted),),
                )
            return
        if not in_stateless_scope() or self._facts_var is None:
            return
        import jax
        import jax.numpy as jnp

        old = jnp.asarray(self._facts_var.value)

        def measure() -> Any:
            stats = jnp.asarray(_first_batch_stats(x, y, y_pred, self._features, self._counted, weighted), jnp.float32)
            return jax.lax.stop_gradient(jnp.concatenate([jnp.ones((1,), jnp.float32), stats]))

        # Once: the first training step's (later steps keep what it wrote).
        self._facts_var.assign(jnp.where(old[0] == 1.0, old, measure()))

    def _receive_first_batch(self, v: Any) -> None:
        """The host side of the first batch's facts (the owner thread: the eager step, or the
        mailbox's reading between batches); later batches' are not taken."""
        if not self._facts_sent:
            self._facts_sent = True
            self._amend_first_batch(np.asarray(v))

    def _amend_first_batch(self, v: np.ndarray) -> None:
        """The first batch's facts to the engine (the owner thread; never raises): the targets'
        range and variance for a loss that regresses values (the range also for a binary
        cross-entropy, whose targets must be probabilities), the output's range and its spread
        across the batch, the table's feature scales (None where not finite)."""

        def span(lo: float, hi: float) -> Optional[List[float]]:
            return [float(lo), float(hi)] if np.isfinite(lo) and np.isfinite(hi) and lo <= hi else None

        v = np.asarray(v, dtype=np.float64).reshape(-1)
        facts: Dict[str, Any] = {}
        if self._regression or self._binary:
            facts["target_range"] = span(v[0], v[1])
        if self._regression and np.isfinite(v[2]) and v[2] >= 0:
            facts["target_var"] = float(v[2])
        facts["output_range"] = span(v[3], v[4])
        if self._counted == "indices":
            facts["class_range"] = span(v[0], v[1])
        if self._counted:
            if np.isfinite(v[5]) and v[5] >= 1:
                facts["output_numel"] = int(v[5])
            if np.isfinite(v[6]) and v[6] >= 0:
                facts["class_entropy"] = float(v[6])
                if np.isfinite(v[7]) and v[7] >= 0:
                    facts["class_entropy_se"] = float(v[7])
        if np.isfinite(v[8]) and v[8] >= 0:
            facts["output_batch_spread"] = float(v[8])
        if self._binary and np.isfinite(v[9]) and v[9] >= 0:
            facts["labels_per_sample"] = int(v[9])
        scales = v[_FACTS_HEAD:]
        if len(scales) and not np.isnan(scales).all():
            facts["input_feature_scales"] = [float(a) if np.isfinite(a) else None for a in scales]
        self._give_facts({k: f for k, f in facts.items() if f is not None}, "the first batch's facts")

    def _layer_call(self, inner: Any, *, row: int, layer: Any) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            collecting = self._collecting
            if collecting is not None and hasattr(out, "shape") and not _symbolic(out):
                collecting[row] = out
            if self._made is not None:
                self._made.append((out, layer))
            return out

        return call

    def _made_call(self, inner: Any, *, layer: Any) -> Callable[..., Any]:
        """A layer with an activation but no probe, while the model's output layer is unknown:
        its output is noted (`_note_output`)."""

        def call(*args: Any, **kwargs: Any) -> Any:
            out = inner(*args, **kwargs)
            if self._made is not None:
                self._made.append((out, layer))
            return out

        return call

    def _activation_table(self, outputs: Dict[int, Any]) -> Any:
        """The engine's activation rows of one forward pass, one per probe (NaN where a probe's
        layer gave no output we can measure: a tuple, a sparse tensor)."""
        blank = ops.full((5,), float("nan"), dtype="float32")
        table = []
        for r in range(len(self._probes)):
            out, probe = outputs.get(r), self._act_probes.get(r)
            stats = None
            if out is not None and probe is not None:
                try:
                    stats = _activation_stats(out, probe)
                except Exception:
                    stats = None
            table.append(blank if stats is None else stats)
        return ops.concatenate(table) if table else ops.zeros((0,), dtype="float32")

    def _add_activation_ring(self) -> None:
        """JAX: the ring the forward pass writes its statistics into, a non-trainable variable of
        the model for the run (rows ``[forward, flags, 4 of the input, 5 per probe]``, the last
        row the number of training forward passes and :data:`RING_MARKER`). A checkpoint saved during the
        run holds the model's own variables only."""
        model = self.model
        for v in list(model._non_trainable_variables):  # left by a run that raised out of fit
            if getattr(v, "_neuraldbg_ring", False):
                model._non_trainable_variables.remove(v)
        for name in _HIDING:
            model.__dict__.pop(name, None)
        width = 2 + INPUT_STATS + 5 * len(self._probes)
        rows = self._ring_rows(width)
        init = np.zeros((rows + 1, width), np.float32)
        init[:rows, 0] = np.array([-1], np.int32).view(np.float32)[0]
        init[rows, :3] = np.array([0, RING_MARKER, 0], np.int32).view(np.float32)
        var = keras.Variable(init, trainable=False, dtype="float32", name="neuraldbg_activations")
        var._neuraldbg_ring = True
        model._non_trainable_variables.append(var)
        self._act_var = var
        # The first batch's facts: a variable of their own (written once; riding in the ring's
        # rows, they cost a second write of the ring at every step).
        facts = keras.Variable(
            np.zeros(1 + _FACTS_HEAD + self._features, np.float32),
            trainable=False,
            dtype="float32",
            name="neuraldbg_first_batch",
        )
        facts._neuraldbg_ring = True
        model._non_trainable_variables.append(facts)
        self._facts_var = facts
        ours = (var, facts)

        def own() -> List[Any]:
            return [
                v for v in model._trainable_variables + model._non_trainable_variables if all(v is not o for o in ours)
            ]

        def save_own_variables(store: Any) -> None:
            for i, v in enumerate(own()):
                store[str(i)] = v

        def load_own_variables(store: Any) -> None:
            for i, v in enumerate(own()):
                if str(i) in store:
                    v.assign(store[str(i)])

        def weights() -> List[Any]:
            return [v for v in model.weights if all(v is not o for o in ours)]

        # ``get_weights``/``set_weights`` as the model's own, ours left out: a callback that
        # keeps the best weights (``EarlyStopping(restore_best_weights=True)``) restores a list
        # taken during the run after it (and must not rewind the rings during it).
        def get_weights() -> List[Any]:
            return [v.numpy() for v in weights()]

        def set_weights(values: Any) -> None:
            mine = weights()
            if len(mine) != len(values):
                raise ValueError(
                    f"You called `set_weights(weights)` on layer '{model.name}' with a weight list of length "
                    f"{len(values)}, but the layer was expecting {len(mine)} weights."
                )
            for v, value in zip(mine, values):
                v.assign(value)  # (which says a shape that does not match)

        for name, fn in (
            ("save_own_variables", save_own_variables),
            ("load_own_variables", load_own_variables),
            ("get_weights", get_weights),
            ("set_weights", set_weights),
        ):
            object.__setattr__(model, name, fn)
        self._act_index = next(i for i, v in enumerate(model.non_trainable_variables) if v is var)
        self._facts_index = next(i for i, v in enumerate(model.non_trainable_variables) if v is facts)
        self._act_ring = RingReader(self, rows, width, post=self._post_activations)

    def _ring_rows(self, width: int) -> int:
        # At least two executions of steps_per_execution steps between two reads.
        return max(16, 2 * self._per_call, min(256, 2 ** int(np.log2(max(RING_BYTES // (4 * width), 1)))))

    def _trace_key(self) -> Optional[Tuple[Any, ...]]:
        """JAX: what the train step traced for this run holds as constants (the options and the
        probes it measures, the rings' shapes); two runs with the same key can run the same
        compiled step, since everything else they differ in is in its state. None on other
        backends, where the step is traced for each run."""
        if self._ring is None:
            return None
        act = self._act_ring
        return (
            self._ring.rows,
            self._ring.width,
            None if act is None else (act.rows, act.width),
            self._features,
            self._dense_steps,
            self._weight_every,
            self._accumulate,
            tuple(sorted((row, repr(sorted(probe.items()))) for row, probe in self._act_probes.items())),
        )

    def _write_activations(self, outputs: Dict[int, Any], x: Any) -> None:
        """JAX, traced in the training forward pass: the pass's row of the activation ring, its
        input batch's statistics (every pass) and its activations (sampled passes only; other
        passes write NaN)."""
        import jax
        import jax.numpy as jnp

        var = self._act_var
        rows = self._act_ring.rows if self._act_ring is not None else 1
        buf = jnp.asarray(var.value)
        # Training forward passes so far (one per micro-batch with accumulation) and their step.
        passes = jax.lax.bitcast_convert_type(buf[rows, 2], jnp.int32)
        count = passes // self._accumulate
        outs = {r: jax.lax.stop_gradient(o) for r, o in outputs.items()}
        table = jnp.asarray(self._activation_table(outs), jnp.float32)
        if self._probes:
            table = jnp.where(self._sampled(count), table, jnp.nan)

        def bits(i: Any) -> Any:
            return jax.lax.bitcast_convert_type(jnp.asarray(i, jnp.int32), jnp.float32)

        flags = 0 if x is None else HAS_INPUTS
        stats = jax.lax.stop_gradient(jnp.asarray(_input_stats(x), jnp.float32))
        if self._accumulate > 1:
            # The micro-batches of one update share its row: their inputs pooled.
            j = passes % self._accumulate
            stats = jnp.where(j > 0, _pooled_inputs(buf[count % rows, 2 : 2 + INPUT_STATS], stats, j, jnp), stats)
        row = jnp.concatenate([jnp.stack([bits(count), bits(flags)]), stats, table])
        buf = jax.lax.dynamic_update_index_in_dim(buf, row, count % rows, 0)
        # A step's row is complete on its last micro-batch (the activations are that pass's).
        buf = buf.at[rows, 0].set(bits((passes + 1) // self._accumulate))
        var.assign(buf.at[rows, 2].set(bits(passes + 1)))

    def _post_activations(self, steps: np.ndarray, flags: np.ndarray, rows: np.ndarray) -> None:
        """Training forward passes' rows of the activation ring (``[count, flags, input
        statistics, activation rows]``): each paired with the optimizer update that follows it,
        by count."""
        records = (
            self._forward(s, bool(f & HAS_INPUTS), row[2:]) for s, f, row in zip(steps.tolist(), flags.tolist(), rows)
        )
        self._post(*[r for r in records if r is not None])

    def _receive_activations(self, row: Any) -> None:
        """The host side of a training forward pass (any thread; ``[input measured (1 or 0),
        input statistics, activation rows]``): paired with the optimizer update that follows
        it, by count. Never raises."""
        try:
            step, j = divmod(self._forwards, self._accumulate)  # (micro-batches: the update they make)
            self._forwards += 1
            v = np.array(row, dtype=np.float32)
            if self._accumulate > 1:
                if j > 0 and self._pass_inputs is not None:
                    v[1 : 1 + INPUT_STATS] = _pooled_inputs(self._pass_inputs, v[1 : 1 + INPUT_STATS], j, np)
                self._pass_inputs = v[1 : 1 + INPUT_STATS].copy()
            record = self._forward(step, bool(v[0] == 1.0), v[1:])
            if record is not None:
                self._post(record)
        except Exception as e:  # pragma: no cover - defensive
            warnings.warn(f"NeuralDBG dropped a forward pass: {e}", NeuralDbgWarning, stacklevel=2)

    def _forward(self, step: int, has_inputs: bool, v: np.ndarray) -> Optional[Record]:
        """A forward pass's record: its input statistics (each step) and activation rows
        (sampled steps), parts of ``v`` (a copy of the device's); None when it has neither."""
        inputs = v[:INPUT_STATS] if has_inputs else None
        acts = v[INPUT_STATS : INPUT_STATS + 5 * len(self._probes)] if self._probes and self._sampled(step) else None
        return None if inputs is None and acts is None else Record(step, inputs=inputs, activations=acts)

    def stop(self) -> None:
        try:
            self._measure_updates()
            self._read_ring(wait=True)
            self._read_host()
        except Exception as e:  # the steps read so far are kept; the watch still ends
            warnings.warn(f"NeuralDBG could not read the last steps: {e}", NeuralDbgWarning, stacklevel=2)
        finally:
            self._remove_ring()
        for layer in self._wrapped_layers:
            _unwrap_call(layer)
        _unwrap_call(self.model, "compute_loss")
        if self._optimizer is not None:
            _unwrap_call(self._optimizer, "_all_reduce_sum_gradients")
        self._wrapped_layers = []
        opt = self._optimizer
        if opt is not None and hasattr(opt.__dict__.get("apply"), "_neuraldbg_inner"):
            if self._original is None:
                object.__delattr__(opt, "apply")
            else:
                object.__setattr__(opt, "apply", self._original)
        self._finish()

    def _summed_call(self, inner: Any) -> Callable[..., Any]:
        """TensorFlow under a strategy of several replicas (each replica's gradient is its
        shard's share): the optimizer's sum of them over the replicas for the run, where the
        update is observed, as it will be applied (accumulated, clipped)."""
        by_value = {id(v.value): v for v in self._model.variables}

        def all_reduce(grads_and_vars: Any) -> Any:
            summed = inner(grads_and_vars)
            if self._active:
                try:
                    pairs = list(summed)
                    self._observe([g for g, _ in pairs], [by_value.get(id(v)) for _, v in pairs], applied=True)
                except Exception as e:  # our statistics failed to build: train on, unobserved
                    warnings.warn(f"NeuralDBG cannot observe this update: {e}", NeuralDbgWarning, stacklevel=2)
            return summed

        return all_reduce

    def _observe(self, grads: Any, variables: Any, applied: bool = False) -> None:
        """Traced inside the train step: the statistics of this update, sent to the host
        (``applied``: the gradients as the update applies them, already accumulated and
        unscaled)."""
        opt = self._optimizer
        grads = list(grads)
        if variables is None:
            variables = list(opt._trainable_variables)
        else:
            variables = list(variables)
        where = [-1] * len(self._model.entries)
        for k, v in enumerate(variables):
            j = self._model.index.get(id(v))
            if j is not None and k < len(grads) and grads[k] is not None:
                where[j] = k
        scale = None if applied else getattr(opt, "loss_scale_factor", None)
        k = self._accumulate
        if k > 1 and not applied:
            # The gradient the update will apply: this micro-batch's and the accumulated ones, averaged.
            acc = [opt._accumulated_gradients[opt._get_variable_index(v)] for v in variables]
            grads = [
                None if g is None else (ops.cast(g, "float32") + ops.cast(a, "float32")) / k for g, a in zip(grads, acc)
            ]
        sq = [None if g is None else _sum_of_squares(g) for g in grads]
        missing = ops.convert_to_tensor(-1.0, dtype="float32")
        gn = ops.stack([ops.sqrt(sq[k]) if k >= 0 else missing for k in where])
        if scale is not None:
            gn = ops.where(gn >= 0, gn / scale, gn)
        values = self._model.variables

        def norms() -> Any:
            return ops.stack([ops.sqrt(ops.sum(ops.square(ops.cast(v, "float32")))) for v in values])

        def skip() -> Any:
            return ops.full((len(values),), -1.0, dtype="float32")

        lr = ops.cast(opt.learning_rate, "float32")
        if isinstance(self._emit, _Deferred):
            # Eager: the update count kept on the host (reading the variable, or branching on
            # it, would wait for the device at every step). Each call of apply is a batch; with
            # accumulation, k of them one update (``iterations``), the last one's row complete.
            step = self._applies // k
            self._applies += 1
            wn = norms() if self._sampled(step) else skip()
            self._emit(self._receive, np.asarray(self._base + step, np.int32), gn, wn, lr)
            return
        step = ops.convert_to_tensor(opt.iterations)
        base = self._ring_base() if self._ring_var is not None else self._base
        sampled = self._sampled(step - base)
        if sum(int(np.prod(v.shape)) for v in values) <= ALWAYS_MEASURED:
            wn = ops.where(sampled, norms(), skip())
        else:
            wn = ops.cond(sampled, norms, skip)
        step32 = ops.cast(step, "int32")
        if self._ring_var is not None:
            # Updates made once this one is: with accumulation, a row is complete on the last micro-batch.
            done = ops.cast(ops.floor_divide(opt._iterations + 1, k), "int32") if k > 1 else step32 + 1
            self._write_ring(step32 - base, done - base, gn, wn, lr)
            return
        ack = self._emit(self._receive, step32, gn, wn, lr)
        if ack is not None:
            # Adds exactly 0 (the host answers 0): keeps the call in the step.
            opt.iterations.assign_add(ops.cast(ack, opt.iterations.dtype))

    def _ring_base(self) -> Any:
        """JAX, traced in the train step: the optimizer's update count when fit began, from the
        ring's last row (int32)."""
        import jax
        import jax.numpy as jnp

        rows = self._ring.rows if self._ring is not None else 1
        return jax.lax.bitcast_convert_type(jnp.asarray(self._ring_var.value)[rows, 2], jnp.int32)

    def _write_ring(self, step: Any, done: Any, gn: Any, wn: Any, lr: Any) -> None:
        """JAX, traced in the train step: this update's row into the ring variable."""
        import jax
        import jax.numpy as jnp

        rows = self._ring.rows if self._ring is not None else 1

        def bits(i: Any) -> Any:
            return jax.lax.bitcast_convert_type(jnp.asarray(i, jnp.int32), jnp.float32)

        head = jnp.stack([bits(step), bits(HAS_LR | HAS_WEIGHTS), jnp.float32(0), jnp.asarray(lr, jnp.float32)])
        row = jnp.concatenate([head, jnp.asarray(gn, jnp.float32), jnp.asarray(wn, jnp.float32)])
        buf = jnp.asarray(self._ring_var.value)
        buf = jax.lax.dynamic_update_index_in_dim(buf, jax.lax.stop_gradient(row), step % rows, 0)
        self._ring_var.assign(buf.at[rows, 0].set(bits(done)))

    def _receive(self, step: Any, gn: Any, wn: Any, lr: Any) -> None:
        """The host side (any thread). Never raises."""
        try:
            a = np.asarray(step)
            s = int(a.view(np.int32).reshape(-1)[0] if a.dtype == np.float32 else a.reshape(-1)[0]) - self._base
            self._post(
                Record(
                    s,
                    grads=np.array(gn, dtype=np.float32),
                    weights=np.array(wn, dtype=np.float32) if self._sampled(s) else None,
                    lr=float(np.asarray(lr).reshape(-1)[0]),
                )
            )
        except Exception as e:  # pragma: no cover - defensive
            warnings.warn(f"NeuralDBG dropped an update: {e}", NeuralDbgWarning, stacklevel=2)

    # ------------------------------------------------------------ the fit loop's loss

    def batch_end(self, batch: int, logs: Optional[Dict[str, Any]]) -> None:
        """After a batch (a Keras worker thread: the callback is ``async_safe``, so reading the
        logs waits there, not in the training loop): the epoch's running mean of the loss,
        turned into the batch's own loss in step order by :meth:`_loss_of`."""
        batch = int(batch)
        with self._lock:
            self._epoch_batches = max(self._epoch_batches, batch + 1)
        mean = None if not logs else logs.get("loss")
        k = self._accumulate
        last = self._epoch_base + batch  # the last batch (micro-batch) of this call
        first = max(last - self._per_call + 1, self._epoch_base)
        # The steps whose last micro-batch is among this call's batches; with steps_per_execution
        # the earlier ones get no loss value, the last one the mean of the batches since the last.
        ends = [s for s in range(first // k, last // k + 1) if first <= (s + 1) * k - 1 <= last]
        for s in ends[:-1]:
            self._post(Record(s, has_loss=True))
        if ends:
            r = Record(ends[-1], has_loss=True)
            if isinstance(mean, (int, float, np.floating)):
                r.mean = (batch, float(mean))
            self._post(r)
            with self._loss_seen:
                self._losses = max(self._losses, ends[-1] + 1)
                self._loss_seen.notify_all()

    def _step_facts(self, r: Record) -> Optional[Dict[str, float]]:
        """The share of the gradient's norm the optimizer's own clipping keeps (``clip_ratio``):
        Keras clips inside ``apply``, after the norms here were read, by the global norm
        (``global_clipnorm``) or each variable's (``clipnorm``)."""
        opt = self._optimizer
        if opt is None or r.grads is None:
            return None
        gcn, cn = getattr(opt, "global_clipnorm", None), getattr(opt, "clipnorm", None)
        if not gcn and not cn:
            return None
        g = np.nan_to_num(np.asarray(r.grads, dtype=np.float64), nan=0.0)
        total = float(np.sqrt(np.sum(g * g)))
        if not (total > 0.0 and np.isfinite(total)):
            return None
        if gcn:
            return {"clip_ratio": min(1.0, float(gcn) / total)}
        return {"clip_ratio": float(np.sqrt(np.sum(np.minimum(g, float(cn or 0.0)) ** 2))) / total}

    def _loss_of(self, r: Record) -> Optional[float]:
        """The batch's loss from the epoch's running mean ``m_k`` after batch ``k``:
        ``(k+1) m_k - (j+1) m_j`` over the ``k - j`` batches since the last mean ``m_j`` (one
        batch, or the batches of one execution with ``steps_per_execution``, whose mean goes
        to the last of them). Keras weights its mean by batch size: a smaller last batch of an
        epoch is approximated."""
        if r.mean is None:
            return None
        batch, m = r.mean
        last_batch, last_mean = (
            self._last_mean if self._last_mean is not None and self._last_mean[0] < batch else (-1, 0.0)
        )
        self._last_mean = (batch, m)
        if not np.isfinite(m) or not np.isfinite(last_mean):
            return m
        return ((batch + 1) * m - (last_batch + 1) * last_mean) / (batch - last_batch)

    def _measure_updates(self) -> None:
        """Between batches on the first ``dense_steps`` updates (the main thread, before a
        batch, at the end of an epoch and of fit): how far the update just made moved each
        weight, ``|W_after - W_before| / |W_before|`` on a strided sample of it (the weights
        and samples the PyTorch collector takes: ``update_weights``, ``update_stride``), from the values the fit loop holds before and after it (on
        JAX, waiting for the device: on these updates only). Nothing inside the compiled step.
        With gradient accumulation, between the batches that end one update and begin the next;
        not with ``steps_per_execution`` (the fit loop then runs several updates between two
        batch calls)."""
        if self._per_call != 1 or self._begun % self._accumulate or not self._active:
            return
        done = self._begun // self._accumulate  # updates made: every batch begun has ended by now
        if done > self._dense_steps or (self._samples is not None and self._samples[0] == done):
            return
        try:
            now = self._weight_samples()
        except Exception:  # pragma: no cover - a measure, never a reason to stop
            now = None
        before, self._samples = self._samples, None if now is None else (done, now)
        if before is None or now is None or before[0] != done - 1:
            return
        ratios = np.full(len(self._model.entries), np.nan, np.float32)
        for j, (b, a) in enumerate(zip(before[1], now)):
            if b is None or a is None:
                continue
            size = float(np.linalg.norm(b))
            moved = float(np.linalg.norm(a - b))
            ratios[j] = moved / size if size > 0 else (np.inf if moved > 0 else np.nan)
        self._post(Record(done - 1, measures={"update_ratio": ratios}))

    def _weight_samples(self) -> List[Any]:
        """Per watched parameter, a strided sample of its current value (float64, on the host)
        if it is one of the measured weights, else None."""
        values = self._model.variables
        chosen = update_weights([len(v.shape) >= 2 for v in values])
        state = getattr(self.model, "_jax_state", None)
        held = None
        if isinstance(state, dict) and not getattr(self.model, "_jax_state_synced", True):
            held = state.get("trainable_variables")
        order = {id(v): i for i, v in enumerate(self.model.trainable_variables)}
        out: List[Any] = [None] * len(values)
        for j in chosen:
            v = values[j]
            i = order.get(id(v))
            x = held[i] if held is not None and i is not None and i < len(held) else v.value
            flat = ops.reshape(x, (-1,))
            out[j] = np.asarray(ops.convert_to_numpy(flat[:: update_stride(int(np.prod(v.shape)))]), np.float64)
        return out

    def batch_begin(self, batch: int) -> None:
        """Before a batch (the main thread): the steps delivered so far go to the engine (and a
        confirmed ``halt_on`` failure stops fit). The rings (JAX) and the mailbox (TensorFlow)
        are read every ``_read_every`` batches, on JAX waiting for the device; with ``halt_on``
        or ``on_failure`` every batch, and the previous batch's loss is waited for too, so that
        a failure stops fit after the next batch at most."""
        self._measure_updates()
        self._give_output()
        self._begun += 1
        self._batches += 1
        urgent = self._halt is not None or self._on_failure is not None
        if not urgent and self._batches % self._read_every:
            return
        self._read_ring(wait=True)
        self._read_host()
        if urgent:
            # Keras hands the logs to the callback on a worker thread: the loss of the batch
            # just trained comes from there (a bound on the wait, should that thread be stuck).
            want = self.updates_before(batch)
            with self._loss_seen:
                self._loss_seen.wait_for(lambda: self._losses >= want, timeout=10.0)
        self._drain()

    def updates_before(self, batch: int) -> int:
        """The updates the batches of this fit before ``batch`` (of the current epoch) made:
        counted on the host, without waiting for the device."""
        return (self._epoch_base + int(batch)) // self._accumulate

    def epoch_end(self) -> None:
        self._measure_updates()
        # Keras has finished this epoch's batch-end calls (it waits for them first).
        self._epoch_base += self._epoch_batches
        self._epoch_batches = 0
        self._read_ring(wait=False)
        self._read_host()
        self._drain()

    def _title(self) -> str:
        return f"NeuralDBG report: {type(self.model).__name__}"

    def __repr__(self) -> str:
        state = "active" if self._active else ("finished" if self._started else "idle")
        return f"KerasDbg({type(self.model).__name__}, step={self.step}, {state})"


# The callbacks whose fit is running (see _guard_fit).
_IN_FIT: weakref.WeakSet[NeuralDbgCallback] = weakref.WeakSet()


def _guard_fit() -> None:
    """Makes ``keras.Model.fit`` end the watch of a fit it leaves by an exception (a callback
    of the user's that raises, Ctrl-C, an error in the step): Keras then calls no
    ``on_train_end``, and the wrappers would stay on the model, observe its next fits and
    leave no trace or report. Installed once, by the first callback made (which is before the
    fit it is given to begins); a fit without one only passes through. The exception is
    re-raised unchanged."""
    fit = keras.Model.fit
    if getattr(fit, "_neuraldbg_guard", False):
        return

    @functools.wraps(fit)
    def guarded_fit(self: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fit(self, *args, **kwargs)
        except BaseException as e:
            for cb in [c for c in _IN_FIT if c._fit_model is self]:
                cb._end(error=e)
            raise

    guarded_fit._neuraldbg_guard = True  # type: ignore[attr-defined]
    keras.Model.fit = guarded_fit


class NeuralDbgCallback(keras.callbacks.Callback):
    """Watches ``model.fit`` and explains why training failed: one line in ``callbacks=``.

    ``callback.dbg`` is the run's debugger (``events``, ``explain_failure()``, ``history()``,
    ``save_report()``...); ``dbg.step`` equals the number of batches trained. At the end of
    ``fit`` the diagnosis is printed (``verbose``), and the trace and report are written; also
    when ``fit`` raises (Ctrl-C, a callback's error), with the steps trained until then, the
    model left as it was.

    Args:
        trace: a path for the trace, or None (default): none is written.
        report: a path for the HTML report, or None (default).
        halt_on: stop training when a failure is confirmed (``True``, a confidence, failure
            names): sets ``model.stop_training``, so ``fit`` ends after the batch that follows
            the failing one (each step is then read before the next batch, waiting for the
            device: a synchronisation per step).
        on_failure: called with newly confirmed hypotheses.
        verbose: print the diagnosis when ``fit`` ends.
        activations: measure the activations of ``Dense(activation=...)``/``Activation``
            layers in each training forward pass (default True; False saves their statistics
            and their host callback per step, and the diagnosis then rests on the gradients).
        **options: any option of the debugger (thresholds, ``weight_every``, ``dense_steps``,
            engine settings).
    """

    def __init__(
        self,
        *,
        trace: Union[str, os.PathLike[str], None] = None,
        report: Union[str, os.PathLike[str], None] = None,
        halt_on: Union[bool, float, str, Iterable[str], None] = None,
        on_failure: Optional[Callable[[List[CausalHypothesis]], Any]] = None,
        verbose: bool = True,
        **options: Any,
    ) -> None:
        super().__init__()
        self.options: Dict[str, Any] = dict(
            trace=trace, report=report, halt_on=halt_on, on_failure=on_failure, **options
        )
        self.verbose = verbose
        self.dbg: Optional[KerasDbg] = None
        self._fit_model: Any = None
        # Checked here, so that a bad option fails at construction rather than inside fit.
        check = dict(self.options)
        activations = check.pop("activations", True)
        if not isinstance(activations, bool):
            raise ConfigError(f"activations must be True or False, got {activations!r}")
        Spoke(**check)
        _guard_fit()

    def on_train_begin(self, logs: Optional[Dict[str, Any]] = None) -> None:
        model = self.model
        if getattr(model, "optimizer", None) is None:
            raise NeuralDbgError("NeuralDbgCallback needs a compiled model (model.compile(optimizer=...))")
        self.dbg = None
        if any(c._fit_model is model for c in _IN_FIT):
            warnings.warn(
                "NeuralDBG: another NeuralDbgCallback watches this fit already; this one does not",
                NeuralDbgWarning,
                stacklevel=2,
            )
            return
        self._fit_model = model
        _IN_FIT.add(self)
        if not getattr(model, "built", True) and keras.backend.backend() == "tensorflow":
            # TensorFlow's fit builds a model it was not given built (a subclassed one) in its
            # first traced step: the watch begins there, before that step's own computation.
            _wrap_call(model, self._build_then_watch, "train_step")
            model.make_train_function(force=True)
            return
        dbg = self._begin()
        if dbg is None:
            return
        # fit made its train function before this hook. On JAX the rings added for the run change
        # the step's state, so the function traces the wrapped optimizer at its first call, or
        # reuses what it compiled for an earlier watched fit of the same key (the next fit
        # compiles nothing new); made again, it would compile once more for every fit. Elsewhere
        # (and for a step traced with other constants) it is made again; so is a function made
        # under a Keras distribution for the model's variables before the rings (it fixed the
        # shardings of the step's outputs then, one per variable).
        key = dbg._trace_key()
        function = model.train_function
        made_for = getattr(function, "_neuraldbg_key", None if _distributed() else key)
        if key is None or function is None or made_for != key:
            model.make_train_function(force=True)
            function = model.train_function
        if key is not None and function is not None:
            function._neuraldbg_key = key

    def _begin(self) -> Optional[KerasDbg]:
        """The debugger of this fit, started; None (with a warning, fit goes on unwatched) for
        a model with nothing to watch."""
        model = self.model
        try:
            dbg = KerasDbg(model, **self.options)
        except ModelError as e:
            warnings.warn(f"NeuralDBG cannot watch this fit: {e}", NeuralDbgWarning, stacklevel=3)
            return None
        dbg._on_halt = lambda hyps: setattr(model, "stop_training", True)
        dbg.start()
        self.dbg = dbg
        return dbg

    def _build_then_watch(self, inner: Any) -> Callable[..., Any]:
        """TensorFlow, a model built by its first traced step: ``train_step`` for the run. At
        that trace, the model is built from the batch (as Keras builds it when it can) and
        watched from this step on, the batch counted as begun."""

        def train_step(data: Any) -> Any:
            if self.dbg is None and "train_step" in self.model.__dict__:
                import tensorflow as tf

                try:
                    with tf.init_scope():  # out of the traced step: variables and the engine are eager
                        self.model._symbolic_build(data_batch=data)
                        dbg = self._begin()
                        if dbg is not None:
                            dbg.batch_begin(0)
                except Exception as e:  # never the user's fit: it builds and trains unwatched
                    warnings.warn(f"NeuralDBG cannot watch this fit: {e}", NeuralDbgWarning, stacklevel=2)
                _unwrap_call(self.model, "train_step")
            return inner(data)

        return train_step

    # Keras then runs on_train_batch_end on a worker thread and keeps dispatching steps
    # asynchronously; the engine is fed from on_train_batch_begin, on the main thread.
    async_safe = True

    def on_train_batch_begin(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.dbg is not None:
            self.dbg.batch_begin(batch)

    def on_train_batch_end(self, batch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.dbg is not None:
            self.dbg.batch_end(batch, logs)

    def on_epoch_end(self, epoch: int, logs: Optional[Dict[str, Any]] = None) -> None:
        if self.dbg is not None:
            self.dbg.epoch_end()

    def on_train_end(self, logs: Optional[Dict[str, Any]] = None) -> None:
        self._end()

    def _end(self, error: Optional[BaseException] = None) -> None:
        """The watch of this fit ends: the model unwrapped, the steps read, the trace and report
        written, the diagnosis printed. After ``error`` (fit raised it) nothing here may replace
        it: a failure is a warning."""
        model = self._fit_model
        _IN_FIT.discard(self)
        self._fit_model = None
        if model is None:
            return
        try:
            _unwrap_call(model, "train_step")
            dbg = self.dbg
            if dbg is None:
                return
            dbg.stop()
            if dbg._trace_key() is None or _distributed():
                # The next fit traces a train function without the wrapper (on JAX the step's
                # state, without the rings, tells the two apart; not under a distribution,
                # where the function fixed its outputs' shardings, the rings' included).
                model.train_function = None
            if self.verbose:
                confirmed = [h for h in dbg.explain_failure() if h.confidence >= 0.5]
                raised = f" before fit raised {type(error).__name__}" if error is not None else ""
                lines = [f"NeuralDBG: {dbg.step} steps observed{raised}"]
                lines += [f"  {h}" for h in confirmed[:5]] if confirmed else ["no failure detected"]
                print("\n".join(lines))
        except Exception as e:
            if error is None:
                raise
            warnings.warn(
                f"NeuralDBG could not end the watch of the fit that raised: {e}", NeuralDbgWarning, stacklevel=3
            )
