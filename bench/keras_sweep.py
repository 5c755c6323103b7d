"""Keras programs as users write them, each fitted unwatched and watched from the same seed on the
backend ``KERAS_BACKEND`` names: does the callback leave training as it was, and does it count
every update?

``KERAS_BACKEND=tensorflow .venv/bin/python bench/keras_sweep.py [jit] [PROGRAM ...]`` prints one
JSON line per program: the largest difference between the final weights of the two fits (0.0:
identical to the bit) and between their logged losses, the weights each ended with (a variable of
ours left behind would show), the ``NeuralDbgWarning`` messages, wrappers left on the model, and
the watched fit's ``dbg.step`` beside the updates ``optimizer.iterations`` counted. ``jit``
compiles the steps (``jit_compile=True``). TensorFlow runs with deterministic ops. Not a test:
the faults it found are tests now (BENCHMARKS.md, twenty-first session).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import traceback
import warnings
from typing import Any, Callable, Dict, List, Optional, Tuple

import numpy as np

os.environ.setdefault("TF_DETERMINISTIC_OPS", "1")
import keras

from neuraldbg.errors import NeuralDbgWarning
from neuraldbg.keras import NeuralDbgCallback

BACKEND = keras.backend.backend()
if BACKEND == "tensorflow":
    import tensorflow as tf

    tf.config.experimental.enable_op_determinism()

JIT = "jit" in sys.argv[1:]
Program = Callable[[List[Any], str], Tuple[Any, Any]]
PROGRAMS: Dict[str, Program] = {}


def program(f: Program) -> Program:
    PROGRAMS[f.__name__] = f
    return f


def xy(n: int = 256, d: int = 8, classes: int = 0) -> Tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, d)).astype("float32")
    if classes:
        return x, (np.abs(x[:, 0] * 3).astype(int) % classes).astype("int32")
    return x, (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")


def mlp(out: int = 1, act: Optional[str] = None) -> Any:
    return keras.Sequential(
        [keras.Input((8,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(out, activation=act)]
    )


@program
def dataset_validation_checkpoints(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x, y = xy()
    m = mlp()
    m.compile("adam", "mse", jit_compile=JIT)
    user = [keras.callbacks.EarlyStopping(patience=5), keras.callbacks.ModelCheckpoint(os.path.join(tmp, "m.keras"))]
    data: Dict[str, Any] = {"x": x, "y": y, "batch_size": 32, "validation_data": (x[:64], y[:64])}
    if BACKEND == "tensorflow":
        data = {
            "x": tf.data.Dataset.from_tensor_slices((x, y)).batch(32),
            "validation_data": tf.data.Dataset.from_tensor_slices((x[:64], y[:64])).batch(32),
        }
    h = m.fit(**data, epochs=2, callbacks=user + cbs, verbose=0)
    keras.saving.load_model(os.path.join(tmp, "m.keras"))
    return m, h


@program
def two_inputs_two_outputs(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x, y = xy()
    a, b = keras.Input((8,), name="a"), keras.Input((4,), name="b")
    h = keras.layers.Concatenate()([keras.layers.Dense(8, activation="tanh")(a), b])
    m = keras.Model(
        {"a": a, "b": b},
        {
            "reg": keras.layers.Dense(1, name="reg")(h),
            "cls": keras.layers.Dense(3, activation="softmax", name="cls")(h),
        },
    )
    m.compile(
        "adam",
        loss={"reg": "mse", "cls": "sparse_categorical_crossentropy"},
        loss_weights={"reg": 1.0, "cls": 0.5},
        jit_compile=JIT,
    )
    classes = (np.abs(x[:, 0]) * 2).astype("int32") % 3
    return m, m.fit(
        {"a": x, "b": x[:, :4]}, {"reg": y, "cls": classes}, batch_size=32, epochs=2, callbacks=cbs, verbose=0
    )


@program
def class_and_sample_weights(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x, y = xy(classes=3)
    m = mlp(3, "softmax")
    m.compile("sgd", "sparse_categorical_crossentropy", metrics=["accuracy"], jit_compile=JIT)
    m.fit(x, y, batch_size=32, epochs=1, class_weight={0: 1.0, 1: 2.0, 2: 0.5}, callbacks=cbs, verbose=0)
    return m, m.fit(
        x,
        y,
        batch_size=32,
        epochs=1,
        sample_weight=np.linspace(0.1, 1, 256).astype("float32"),
        callbacks=cbs,
        verbose=0,
    )


@program
def conv_batchnorm_dropout(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    rng = np.random.default_rng(1)
    x = rng.normal(size=(128, 12, 12, 1)).astype("float32")
    y = (x.mean(axis=(1, 2, 3)) > 0).astype("int32")
    layers = keras.layers
    m = keras.Sequential(
        [
            keras.Input((12, 12, 1)),
            layers.Conv2D(4, 3, activation="relu"),
            layers.BatchNormalization(),
            layers.MaxPooling2D(),
            layers.Dropout(0.2, seed=1),
            layers.Flatten(),
            layers.Dense(2, activation="softmax"),
        ]
    )
    m.compile("adam", "sparse_categorical_crossentropy", jit_compile=JIT)
    return m, m.fit(x, y, batch_size=16, epochs=2, callbacks=cbs, verbose=0)


@program
def lstm(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x = np.random.default_rng(2).normal(size=(96, 7, 3)).astype("float32")
    m = keras.Sequential([keras.Input((7, 3)), keras.layers.LSTM(8), keras.layers.Dense(1)])
    m.compile("rmsprop", "mse", jit_compile=JIT)
    return m, m.fit(x, x[:, :, 0].sum(axis=1, keepdims=True), batch_size=16, epochs=2, callbacks=cbs, verbose=0)


@program
def tied_frozen_schedule(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x, y = xy()
    inp = keras.Input((8,))
    shared, frozen = keras.layers.Dense(8, activation="relu", name="shared"), keras.layers.Dense(8, name="frozen")
    frozen.trainable = False
    m = keras.Model(inp, keras.layers.Dense(1)(shared(shared(frozen(inp)))))
    m.compile(
        keras.optimizers.SGD(keras.optimizers.schedules.ExponentialDecay(0.01, 4, 0.5), momentum=0.9),
        "mse",
        jit_compile=JIT,
    )
    return m, m.fit(x, y, batch_size=32, epochs=2, callbacks=cbs, verbose=0)


@program
def initial_epoch_then_evaluate(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x, y = xy()
    m = mlp()
    m.compile("adam", "mse", jit_compile=JIT)
    h = m.fit(x, y, batch_size=64, epochs=3, initial_epoch=1, callbacks=cbs, verbose=0)
    m.evaluate(x, y, verbose=0)
    m.predict(x, verbose=0)
    return m, h


@program
def mixed_precision(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    keras.mixed_precision.set_global_policy("mixed_float16")
    try:
        x, y = xy()
        m = mlp()
        m.compile("adam", "mse", jit_compile=JIT)
        return m, m.fit(x, y, batch_size=32, epochs=2, callbacks=cbs, verbose=0)
    finally:
        keras.mixed_precision.set_global_policy("float32")


@program
def fit_on_a_thread(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x, y = xy()
    m = mlp()
    m.compile("adam", "mse", jit_compile=JIT)
    box: Dict[str, Any] = {}
    t = threading.Thread(target=lambda: box.update(h=m.fit(x, y, batch_size=32, epochs=2, callbacks=cbs, verbose=0)))
    t.start()
    t.join()
    return m, box["h"]


@program
def a_callback_that_raises(cbs: List[Any], tmp: str) -> Tuple[Any, Any]:
    x, y = xy()
    m = mlp()
    m.compile("adam", "mse", jit_compile=JIT)

    class Boom(keras.callbacks.Callback):
        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            if batch == 2:
                raise RuntimeError("the user's")

    try:
        m.fit(x, y, batch_size=32, epochs=1, callbacks=[*cbs, Boom()], verbose=0)
    except RuntimeError:
        pass
    return m, m.fit(x, y, batch_size=32, epochs=1, verbose=0)  # unwatched: the watched one must be over


def run(name: str, watched: bool) -> Dict[str, Any]:
    keras.utils.set_random_seed(0)
    cbs = [NeuralDbgCallback(verbose=False)] if watched else []
    iterations: List[int] = []

    class Count(keras.callbacks.Callback):  # the updates of the watched fit, as Keras counts them
        def on_train_begin(self, logs: Any = None) -> None:
            iterations.append(int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)))

        def on_train_end(self, logs: Any = None) -> None:
            iterations.append(int(keras.ops.convert_to_numpy(self.model.optimizer.iterations)))

    with tempfile.TemporaryDirectory() as tmp, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        m, h = PROGRAMS[name]([*cbs, Count()] if watched else cbs, tmp)
    dbg = cbs[0].dbg if cbs else None
    return {
        "weights": [np.asarray(keras.ops.convert_to_numpy(v.value)) for v in m.weights],
        "loss": h.history.get("loss", []),
        "warnings": [str(w.message)[:200] for w in caught if issubclass(w.category, NeuralDbgWarning)],
        "left": [k for k in ("call", "compute_loss", "train_step") if k in m.__dict__],
        "steps": None if dbg is None else dbg.step,
        "updates": iterations[-1] - iterations[-2] if len(iterations) >= 2 else None,
    }


def main() -> None:
    only = [a for a in sys.argv[1:] if a != "jit"]
    for name in PROGRAMS:
        if only and name not in only:
            continue
        try:
            plain, watched = run(name, False), run(name, True)
            same = len(plain["weights"]) == len(watched["weights"])
            out: Dict[str, Any] = {
                "weights": [len(plain["weights"]), len(watched["weights"])],
                "weights_diff": max(
                    (float(np.max(np.abs(a - b))) for a, b in zip(plain["weights"], watched["weights"]) if a.size),
                    default=0.0,
                )
                if same
                else None,
                "loss_diff": max((abs(a - b) for a, b in zip(plain["loss"], watched["loss"])), default=0.0),
                "warnings": watched["warnings"],
                "left": watched["left"],
                "steps": watched["steps"],
                "updates": watched["updates"],
            }
        except Exception as e:
            out = {"error": "".join(traceback.format_exception(e))[-1500:]}
        print(name, json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
