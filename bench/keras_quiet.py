#!/usr/bin/env python3
"""Quiet failures under the Keras callback (Keras 3 on JAX): the top hypothesis of each program,
for BENCHMARKS.md's table of what the Keras spoke measures ("What the Keras and JAX spokes now
measure"). Each program fits a small MLP with ``NeuralDbgCallback``; the loss column is Keras's
own (first and last epoch's mean).

    .venv/bin/python bench/keras_quiet.py      # ~1 min on one CPU core

Programs: digits (scikit-learn's bundled 8x8 digits, /16) normalized and at 0..255 under SGD and
Adam, with ReLU and sigmoid layers, and with one NaN; a 5-class linear-teacher table under Adam
at 1e-3, 1e-5 and 1e-6; a regression with a linear output and with a sigmoid output on targets
around 3.
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import Any

os.environ.setdefault("KERAS_BACKEND", "jax")
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
warnings.simplefilter("ignore")

import keras  # noqa: E402
import numpy as np  # noqa: E402
from sklearn.datasets import load_digits  # noqa: E402

from neuraldbg.keras import NeuralDbgCallback  # noqa: E402


def mlp(d_in: int, out: int, act: str = "relu", out_act: Any = None) -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((d_in,)), keras.layers.Dense(64, activation=act), keras.layers.Dense(64, activation=act)]
        + [keras.layers.Dense(out, activation=out_act)]
    )


def run(name: str, model: Any, loss: Any, opt: Any, x: Any, y: Any, epochs: int) -> None:
    model.compile(optimizer=opt, loss=loss)
    cb = NeuralDbgCallback(verbose=False)
    h = model.fit(x, y, epochs=epochs, batch_size=32, verbose=0, callbacks=[cb])
    hyps = cb.dbg.explain_failure() if cb.dbg is not None else []
    top = f"{hyps[0].failure} <- {hyps[0].cause} {hyps[0].confidence:.2f}" if hyps else "(none)"
    loss_span = f"{h.history['loss'][0]:.3g} -> {h.history['loss'][-1]:.3g}"
    print(f"| {name} | {loss_span} | {top} |", flush=True)


def main() -> int:
    ce = keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    digits = load_digits()
    x, y = (digits.data / 16.0).astype("float32"), digits.target
    rng = np.random.default_rng(0)
    xt = rng.normal(size=(2048, 20)).astype("float32")
    yt = np.argmax(xt @ rng.normal(size=(20, 5)) + 0.5 * rng.normal(size=(2048, 5)), 1)
    xr = rng.normal(size=(2048, 10)).astype("float32")
    yr = (np.sin(xr[:, :3]).sum(1) + 0.3 * xr[:, 3] ** 2).astype("float32")
    nan = x.copy()
    nan[5, 3] = np.nan
    print("| program | loss (Keras) | top hypothesis |")
    print("|---|---|---|")
    run("digits, SGD 0.05", mlp(64, 10), ce, keras.optimizers.SGD(0.05), x, y, 4)
    run("digits at 0..255, SGD 0.05", mlp(64, 10), ce, keras.optimizers.SGD(0.05), x * 255, y, 4)
    run("digits at 0..255, sigmoid, Adam", mlp(64, 10, "sigmoid"), ce, keras.optimizers.Adam(1e-3), x * 255, y, 4)
    run("digits with one NaN, SGD 0.05", mlp(64, 10), ce, keras.optimizers.SGD(0.05), nan, y, 4)
    run("table, Adam 1e-3", mlp(20, 5), ce, keras.optimizers.Adam(1e-3), xt, yt, 5)
    run("table, Adam 1e-5", mlp(20, 5), ce, keras.optimizers.Adam(1e-5), xt, yt, 5)
    run("table, Adam 1e-6", mlp(20, 5), ce, keras.optimizers.Adam(1e-6), xt, yt, 5)
    run("regression, linear output", mlp(10, 1), "mse", keras.optimizers.Adam(1e-3), xr, yr, 5)
    run(
        "regression, sigmoid output, targets ~3",
        mlp(10, 1, out_act="sigmoid"),
        "mse",
        keras.optimizers.Adam(1e-3),
        xr,
        yr * 3,
        5,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
