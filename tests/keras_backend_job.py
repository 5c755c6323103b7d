"""Keras programs watched by ``NeuralDbgCallback`` on the backend ``KERAS_BACKEND`` names (run
in a subprocess by ``tests/test_keras_backends.py``: Keras fixes its backend at import). Prints
one JSON object: what the callback measured and, beside it, the ground truth the backend itself
computes (its own gradients: ``tf.GradientTape`` or ``torch.autograd``; the batches as numpy
sees them). ``python tests/keras_backend_job.py [jit]``: ``jit`` compiles the step with XLA
(``jit_compile=True``, TensorFlow's default on a GPU)."""

from __future__ import annotations

import json
import os
import sys
import tempfile
from typing import Any, Dict, List

import numpy as np

if os.environ.get("KERAS_BACKEND") == "tensorflow":
    import tensorflow as tf

    # Two logical CPUs, for a distribution strategy of two replicas (before TensorFlow starts).
    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)

import keras

import neuraldbg
from neuraldbg.keras import NeuralDbgCallback

JIT = "jit" in sys.argv[1:]


def data(n: int = 640, d: int = 16, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")
    return x, y


def grad_norms(model: Any, x: Any, y: Any) -> Dict[str, float]:
    """Per-layer gradient norms of the MSE of ``model`` on ``(x, y)``, by the backend's own
    automatic differentiation."""
    variables = model.trainable_variables
    backend = keras.backend.backend()
    if backend == "tensorflow":
        import tensorflow as tf

        with tf.GradientTape() as tape:
            loss = tf.reduce_mean((model(x, training=True) - y) ** 2)
        grads = [tf.convert_to_tensor(g).numpy() for g in tape.gradient(loss, [v.value for v in variables])]
    elif backend == "torch":
        import torch

        out = model(torch.as_tensor(x, device=variables[0].value.device), training=True)
        loss = ((out - torch.as_tensor(y, device=out.device)) ** 2).mean()
        grads = [g.detach().cpu().numpy() for g in torch.autograd.grad(loss, [v.value for v in variables])]
    else:
        raise SystemExit(f"no ground truth for the {backend} backend here")
    sums: Dict[str, float] = {}
    for v, g in zip(variables, grads):
        layer = v.path.split("/")[-2]
        sums[layer] = sums.get(layer, 0.0) + float(np.sum(np.asarray(g, np.float64) ** 2))
    return {k: float(np.sqrt(s)) for k, s in sums.items()}


def top(cb: Any) -> Dict[str, Any]:
    hyps = cb.dbg.explain_failure()
    if not hyps:
        return {}
    h = hyps[0]
    return {
        "failure": str(h.failure),
        "cause": str(h.cause),
        "layer": h.layer,
        "step": h.step,
        "confidence": h.confidence,
    }


def deep_sigmoid() -> Dict[str, Any]:
    """16 sigmoid layers under SGD: the gradients vanish towards the input."""
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((16,))]
        + [keras.layers.Dense(32, activation="sigmoid") for _ in range(16)]
        + [keras.layers.Dense(1)]
    )
    x, y = data()
    truth = grad_norms(model, x[:32], y[:32])  # the first batch, before any update
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb], verbose=0)
    dbg = cb.dbg
    order = [layer.name for layer in model.layers]
    return {
        "steps": dbg.step,
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "layers": dbg.layers,
        "order": order,
        "first_grad_norm": {n: float(dbg.history(n, "grad_norm")[1][0]) for n in order},
        "truth": truth,
        "input_scale": dbg.history(None, "input_scale")[1].tolist(),
        "input_truth": np.tile(np.abs(x).reshape(20, 32, 16).max(axis=(1, 2)), 2).tolist(),
        "top": top(cb),
    }


def nan_batch() -> Dict[str, Any]:
    """One NaN in batch 5, ``halt_on="non_finite"``."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=JIT)
    x, y = data()
    x[5 * 32 + 3, 4] = np.nan
    cb = NeuralDbgCallback(halt_on="non_finite", verbose=False)
    hist = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, callbacks=[cb], verbose=0)
    h = cb.dbg.explain_failure("non_finite")[0]
    return {
        "halted": cb.dbg.halted is not None,
        "epochs": len(hist.history["loss"]),
        "steps": cb.dbg.step,
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "step": h.step,
        "cause": str(h.cause),
        "confidence": h.confidence,
    }


def bounded_output(scaled: bool) -> Dict[str, Any]:
    """A sigmoid output fitted by MSE to targets around 3 (or to the same targets scaled into
    (0, 1)): named from the first batch's facts while the loss still falls."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 8)).astype("float32") * np.array([1, 2, 3, 4, 1, 1, 1, 0.5], "float32")
    y = (3.0 + 2.0 * x[:, :1] + np.sin(x[:, 1:2])).astype("float32")
    if scaled:
        y = (y - y.min()) / (y.max() - y.min() + 1.0)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False)
    hist = model.fit(x, y, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[cb])
    confirmed: List[str] = [str(h.cause) for h in cb.dbg.explain_failure() if h.confidence >= 0.5]
    return {"loss": hist.history["loss"], "top": top(cb), "confirmed": confirmed, "target_max": float(y[:32].max())}


class Counted(keras.callbacks.Callback):
    """The batches fit trained."""

    def __init__(self) -> None:
        super().__init__()
        self.batches = 0

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        self.batches += 1


def small_mlp() -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="tanh"), keras.layers.Dense(1)])


class Subclassed(keras.Model):
    """A subclassed model with its own ``train_step`` (the backend's autodiff), not built before
    fit: TensorFlow builds it in the first traced step."""

    def __init__(self) -> None:
        super().__init__()
        self.hidden = keras.layers.Dense(32, activation="tanh")
        self.out = keras.layers.Dense(1)
        self.tracker = keras.metrics.Mean(name="loss")

    @property
    def metrics(self) -> List[Any]:
        return [self.tracker]  # reset by fit at each epoch

    def call(self, x: Any, training: bool = False) -> Any:
        return self.out(self.hidden(x))

    def train_step(self, data: Any) -> Any:
        x, y = data
        if keras.backend.backend() == "tensorflow":
            import tensorflow as tf

            with tf.GradientTape() as tape:
                loss = keras.ops.mean((self(x, training=True) - y) ** 2)
            grads = tape.gradient(loss, self.trainable_variables)
        else:
            self.zero_grad()
            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
            loss.backward()
            grads = [v.value.grad for v in self.trainable_variables]
        self.optimizer.apply(grads, self.trainable_variables)
        self.tracker.update_state(loss)
        return {"loss": self.tracker.result()}


def loops() -> Dict[str, Any]:
    """Fit loops as Keras users write them: several steps per call, gradient accumulation, a
    loss-scaling optimizer, a subclassed model with its own train step."""
    x, y = data()
    out: Dict[str, Any] = {}

    model = small_mlp()
    truth = grad_norms(model, x[:32], y[:32])
    per_call = 1 if keras.backend.backend() == "torch" else 4  # PyTorch's fit takes 1 only
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", steps_per_execution=per_call, jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb], verbose=0)
    out["per_call"] = {
        "steps": cb.dbg.step,
        "iterations": int(keras.ops.convert_to_numpy(model.optimizer.iterations)),
        "losses": len(cb.dbg.history(None, "loss")[1]),
        "inputs": len(cb.dbg.history(None, "input_scale")[1]),
        "first": {n: float(cb.dbg.history(n, "grad_norm")[1][0]) for n in truth},
        "truth": truth,
    }

    model = small_mlp()
    truth = grad_norms(model, x[:64], y[:64])  # the first update's two batches
    opt = keras.optimizers.SGD(0.01, gradient_accumulation_steps=2)
    model.compile(optimizer=opt, loss="mse", jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
    out["accumulation"] = {
        "steps": cb.dbg.step,
        "iterations": int(keras.ops.convert_to_numpy(opt.iterations)),
        "first": {n: float(cb.dbg.history(n, "grad_norm")[1][0]) for n in truth},
        "truth": truth,
        "input_scale": [float(v) for v in cb.dbg.history(None, "input_scale")[1][:2]],
        "input_truth": [float(np.abs(x[:64]).max()), float(np.abs(x[64:128]).max())],
    }

    # A NaN in the first micro-batch of the second update, halt_on: named at that update, and
    # fit stops there.
    model = small_mlp()
    model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=2), loss="mse", jit_compile=JIT)
    xn = x.copy()
    xn[64:66] = np.nan
    counted = Counted()
    cb = NeuralDbgCallback(verbose=False, halt_on="data_anomaly")
    model.fit(xn, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb, counted], verbose=0)
    top = (cb.dbg.halted or [None])[0]
    out["accumulated_nan"] = {
        "batches": counted.batches,
        "halted": None if top is None else [top.failure, top.cause, top.step],
    }

    model = small_mlp()
    truth = grad_norms(model, x[:32], y[:32])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse", jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
    out["loss_scale"] = {
        "scale": float(keras.ops.convert_to_numpy(opt.dynamic_scale)),
        "first": {n: float(cb.dbg.history(n, "grad_norm")[1][0]) for n in truth},
        "truth": truth,
    }

    # Token ids, some repeated in a batch: on TensorFlow the embedding's gradient is sparse rows.
    ids = np.random.default_rng(1).integers(0, 50, size=(320, 12)).astype("int32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((12,), dtype="int32"),
            keras.layers.Embedding(50, 8),
            keras.layers.GlobalAveragePooling1D(),
            keras.layers.Dense(1),
        ]
    )
    truth = grad_norms(model, ids[:32], y[:32])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False)
    model.fit(ids, y[:320], batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
    out["embedding"] = {
        "steps": cb.dbg.step,
        "first": {n: float(cb.dbg.history(n, "grad_norm")[1][0]) for n in truth},
        "truth": truth,
    }

    keras.utils.set_random_seed(0)
    model = Subclassed()
    built = model.built
    model.compile(optimizer=keras.optimizers.SGD(0.01), jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False)
    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb], verbose=0)
    out["subclassed"] = {
        "built_before": built,
        "steps": cb.dbg.step,
        "layers": cb.dbg.layers,
        "names": [model.hidden.name, model.out.name],
        "loss": hist.history["loss"],
        "losses": cb.dbg.history(None, "loss")[1].tolist(),
        "wrapped": "train_step" in model.__dict__,
    }
    return out


def host_reads() -> Dict[str, Any]:
    """PyTorch: the times a train step reads a tensor on the host (``item``, ``bool``, ``cpu``,
    ``numpy``, ``tolist``: each a wait for a GPU), plain and watched, over the same fit; on the
    step's own thread (Keras reads the logs on a worker thread meanwhile)."""
    import threading

    import torch

    names = ("item", "__bool__", "cpu", "numpy", "tolist")
    originals = {n: getattr(torch.Tensor, n) for n in names}
    inside = [False]
    counts = [0]
    step_thread = threading.get_ident()

    def counting(name: str) -> Any:
        def read(self: Any, *a: Any, **k: Any) -> Any:
            if inside[0] and threading.get_ident() == step_thread:
                counts[0] += 1
            return originals[name](self, *a, **k)

        return read

    def fit(watched: bool) -> int:
        model = small_mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        inner = model.train_step

        def train_step(data: Any) -> Any:
            inside[0] = True
            try:
                return inner(data)
            finally:
                inside[0] = False

        model.train_step = train_step
        x, y = data()
        counts[0] = 0
        callbacks = [NeuralDbgCallback(verbose=False)] if watched else []
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=callbacks, verbose=0)
        return counts[0]

    for n in names:
        setattr(torch.Tensor, n, counting(n))
    try:
        return {"plain": fit(False), "watched": fit(True)}
    finally:
        for n, f in originals.items():
            setattr(torch.Tensor, n, f)


def interrupted(path: str) -> Dict[str, Any]:
    """Fits that raise: a callback of the user's at the third batch, then Ctrl-C in the fifth
    step (Keras calls no ``on_train_end`` then). What the watch left behind, and the fits after."""
    import io
    from contextlib import redirect_stdout

    x, y = data()
    model = small_mlp()
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=JIT)
    model.optimizer.build(model.trainable_variables)
    n_vars, n_opt = len(model.variables), len(model.optimizer.variables)

    class Raise(keras.callbacks.Callback):
        def __init__(self, error: BaseException, at: int) -> None:
            super().__init__()
            self.error, self.at = error, at

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == self.at:
                raise self.error

    out: Dict[str, Any] = {}
    for name, error, at in (("callback", RuntimeError("the user's"), 2), ("ctrl_c", KeyboardInterrupt(), 4)):
        cb = NeuralDbgCallback(trace=os.path.join(path, f"{name}.ndbg"))
        printed = io.StringIO()
        try:
            with redirect_stdout(printed):
                model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb, Raise(error, at)], verbose=0)
            raised = None
        except BaseException as e:  # (KeyboardInterrupt included)
            raised = e
        out[name] = {
            "same_error": raised is error,
            "steps": cb.dbg.step,
            "active": cb.dbg._active,
            "trace_steps": neuraldbg.load(os.path.join(path, f"{name}.ndbg")).step,
            "printed": printed.getvalue().splitlines()[:1],
            "wrapped": sorted(k for k in ("call", "compute_loss", "train_step") if k in model.__dict__),
            "variables": [len(model.variables), n_vars],
            "optimizer_variables": [len(model.optimizer.variables), n_opt],
        }
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)  # unwatched: the last debugger sees none of it
    out["after"] = {"steps": cb.dbg.step}
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=1, callbacks=[cb], verbose=0)
    out["watched_again"] = {"steps": cb.dbg.step}
    out["first_step"] = first_step_raises(path)
    return out


def first_step_raises(path: str) -> Dict[str, Any]:
    """A fit whose first training step raises (a layer that fails in training only, so the
    model builds): on JAX fit then holds the state and has emptied the variables, the rings'
    too. What the watch left behind, and what it said."""
    import warnings

    x, y = data()

    class FailsInTraining(keras.layers.Layer):
        def call(self, inputs: Any, training: Any = None) -> Any:
            if training:
                raise RuntimeError("fails in training")
            return inputs

    model = keras.Sequential(
        [keras.Input((x.shape[1],)), keras.layers.Dense(8), FailsInTraining(), keras.layers.Dense(1)]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", jit_compile=JIT)
    cb = NeuralDbgCallback(verbose=False, trace=os.path.join(path, "first.ndbg"))
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        try:
            model.fit(x, y, batch_size=32, epochs=1, callbacks=[cb], verbose=0)
            raised = ""
        except RuntimeError as e:
            raised = str(e)
    layers = [model, model.optimizer, *model.layers]
    return {
        "raised": raised,
        "active": cb.dbg._active,
        "trace_steps": neuraldbg.load(os.path.join(path, "first.ndbg")).step,
        "wrapped": sorted(
            k for o in layers for k in ("call", "compute_loss", "train_step", "apply") if k in o.__dict__
        ),
        "said": sorted({str(w.message) for w in said if "NeuralDBG" in str(w.message) or "trace" in str(w.message)}),
    }


def mirrored() -> Dict[str, Any]:
    """TensorFlow, ``MirroredStrategy`` over two replicas: each computes its half of the batch's
    gradient; the update applies their sum, the whole batch's gradient."""
    import tensorflow as tf

    x, y = data()
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = small_mlp()
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse", jit_compile=JIT)
    truth = grad_norms(model, x[:32], y[:32])
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
    return {
        "replicas": strategy.num_replicas_in_sync,
        "steps": cb.dbg.step,
        "first": {n: float(cb.dbg.history(n, "grad_norm")[1][0]) for n in truth},
        "truth": truth,
        "rows": {fn.__name__: int(box[2]) for fn, box in cb.dbg._emit.boxes.items()},
    }


if __name__ == "__main__":
    out = {
        "backend": keras.backend.backend(),
        "deep_sigmoid": deep_sigmoid(),
        "nan_batch": nan_batch(),
        "bounded_output": bounded_output(False),
        "bounded_output_scaled": bounded_output(True),
        "loops": loops(),
    }
    with tempfile.TemporaryDirectory() as tmp:
        out["interrupted"] = interrupted(tmp)
    if keras.backend.backend() == "torch":
        out["host_reads"] = host_reads()
    if keras.backend.backend() == "tensorflow" and not JIT:  # (XLA: plain fit fails on logical CPUs)
        out["mirrored"] = mirrored()
    print(json.dumps(out))
