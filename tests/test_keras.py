"""neuraldbg.keras: ``NeuralDbgCallback`` in ``model.fit`` on the JAX backend (the other
backends: ``tests/test_keras_backends.py``).

Ground truth comes from JAX itself: per-layer gradient norms of the model's own loss by
``jax.grad`` through ``model.stateless_call``, and the loss Keras logs per epoch.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Dict, List

import numpy as np
import pytest

os.environ["KERAS_BACKEND"] = "jax"  # this module's backend (read by Keras on first import)
jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
keras = pytest.importorskip("keras")
if keras.backend.backend() != "jax":  # pragma: no cover - Keras imported earlier elsewhere
    pytest.skip("Keras was imported with another backend in this process", allow_module_level=True)

import neuraldbg  # noqa: E402
from neuraldbg import ConfigError  # noqa: E402
from neuraldbg.keras import NeuralDbgCallback  # noqa: E402


def data(n: int = 640, d: int = 16, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, d)).astype("float32")
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype("float32")
    return x, y


def sigmoid_mlp(depth: int) -> Any:
    keras.utils.set_random_seed(0)
    return keras.Sequential(
        [keras.Input((16,))]
        + [keras.layers.Dense(32, activation="sigmoid") for _ in range(depth)]
        + [keras.layers.Dense(1)]
    )


def grad_norms(model: Any, x: Any, y: Any) -> Dict[str, float]:
    """Per-layer gradient norms of the MSE of ``model`` on ``(x, y)`` by ``jax.grad``."""
    tv = [v.value for v in model.trainable_variables]
    ntv = [v.value for v in model.non_trainable_variables]

    def loss(tv: Any) -> Any:
        out, _ = model.stateless_call(tv, ntv, x)
        return jnp.mean((out - y) ** 2)

    sums: Dict[str, float] = {}
    for v, g in zip(model.trainable_variables, jax.grad(loss)(tv)):
        layer = v.path.split("/")[-2]
        sums[layer] = sums.get(layer, 0.0) + float(np.sum(np.asarray(g, np.float64) ** 2))
    return {k: float(np.sqrt(s)) for k, s in sums.items()}


def test_deep_sigmoid_vanishing_named_at_the_right_layer_every_batch_a_step() -> None:
    model = sigmoid_mlp(16)
    x, y = data()
    truth = grad_norms(model, x[:32], y[:32])  # the first batch, before any update
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb], verbose=0)
    dbg = cb.dbg
    assert dbg is not None
    assert dbg.step == 2 * 20  # every batch is one step
    order = [layer.name for layer in model.layers]
    assert dbg.layers == order
    for name in order:
        np.testing.assert_allclose(dbg.history(name, "grad_norm")[1][0], truth[name], rtol=1e-3)
    # Along the backward pass (output first), the first layer whose gradient is below 1e-6.
    vanished = [n for n in reversed(order) if truth[n] < 1e-6]
    assert len(vanished) >= 3
    h = dbg.explain_failure()[0]
    assert str(h.failure) == "vanishing_gradients"
    assert h.confidence >= 0.5
    assert h.layer == vanished[0]
    assert h.step == 0
    assert str(h.cause) == "saturating_activation"  # measured: the sigmoids' mean slope


def test_healthy_run_no_alarm_and_loss_matches_keras() -> None:
    keras.utils.set_random_seed(1)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = data()
    cb = NeuralDbgCallback(verbose=False)
    hist = model.fit(x, y, batch_size=64, epochs=3, callbacks=[cb], verbose=0)
    dbg = cb.dbg
    assert dbg.step == 30
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5]
    steps, loss = dbg.history(None, "loss")
    assert list(steps) == list(range(30))
    # Keras logs each epoch's mean batch loss (equal batches here): the per-batch losses the
    # callback recovered average to it.
    np.testing.assert_allclose(loss.reshape(3, 10).mean(axis=1), hist.history["loss"], rtol=1e-5)
    _, lr = dbg.history(None, "lr")
    np.testing.assert_allclose(lr, 1e-3, rtol=1e-6)
    assert dbg.history(model.layers[0].name, "weight_norm")[1].size >= 10  # dense_steps 10, then every 10th
    assert dbg.history(model.layers[0].name + ".activation", "dead_fraction")[1].size >= 10
    # Without activation measurement: the same gradients, no activation series.
    keras.utils.set_random_seed(1)
    again = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1)])
    again.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    quiet = NeuralDbgCallback(verbose=False, activations=False)
    again.fit(x, y, batch_size=64, epochs=1, callbacks=[quiet], verbose=0)
    assert quiet.dbg.step == 10
    assert quiet.dbg.history(again.layers[0].name + ".activation", "dead_fraction")[1].size == 0
    assert "call" not in again.layers[0].__dict__


def test_a_fit_under_a_keras_distribution_is_watched_and_the_next_fits_run() -> None:
    """``keras.distribution.set_distribution``: fit's train function fixes the shardings of its
    outputs, one per variable, when it is made (before the callback adds its rings). The
    watched fits observe every batch with JAX's gradients, and a fit after them, watched or
    not, runs (before: the first watched fit raised a pytree mismatch of ``out_shardings``;
    once made again, the next unwatched fit raised it)."""
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=jax.devices()))
    try:
        keras.utils.set_random_seed(2)
        model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
        x, y = data(256)
        truth = grad_norms(model, x[:32], y[:32])
        cb = NeuralDbgCallback(verbose=False)
        model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb], verbose=0)
        assert cb.dbg.step == 16
        for layer, norm in truth.items():
            assert cb.dbg.history(layer, "grad_norm")[1][0] == pytest.approx(norm, rel=1e-4)
        again = NeuralDbgCallback(verbose=False)
        model.fit(x, y, batch_size=32, epochs=1, callbacks=[again], verbose=0)
        assert again.dbg.step == 8
        hist = model.fit(x, y, batch_size=32, epochs=1, verbose=0)
        assert np.isfinite(hist.history["loss"][0])
    finally:
        keras.distribution.set_distribution(None)


@pytest.mark.parametrize("order", ["ours first", "early stopping first"])
def test_early_stopping_that_restores_the_best_weights_runs_with_the_watch(order: str) -> None:
    """``EarlyStopping(restore_best_weights=True)`` keeps ``model.get_weights()`` of its best
    epoch and sets them back at the end of fit: the weights restored are the model's own, the
    epoch's, and every batch trained is a step, whichever callback Keras calls first (before:
    after ours, its list held our rings too and ``set_weights`` raised out of fit)."""
    keras.utils.set_random_seed(3)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = data(256)

    class Kept(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.epochs: List[List[np.ndarray]] = []
            self.batches = 0

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            self.batches += 1

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.epochs.append([np.array(v.value) for v in self.model.trainable_variables])

    kept = Kept()
    # The first epoch is the best: no later one improves the loss by 10.
    stop = keras.callbacks.EarlyStopping(monitor="loss", patience=0, min_delta=10.0, restore_best_weights=True)
    cb = NeuralDbgCallback(verbose=False)
    callbacks = [cb, stop] if order == "ours first" else [stop, cb]
    model.fit(x, y, batch_size=32, epochs=5, callbacks=[kept, *callbacks], verbose=0)
    assert len(kept.epochs) == 2 and kept.batches == 16
    assert cb.dbg.step == 16
    assert len(model.get_weights()) == 4
    for restored, best in zip(model.trainable_variables, kept.epochs[0]):
        np.testing.assert_array_equal(np.asarray(restored.value), best)


def test_a_second_callback_in_the_same_fit_says_so_and_the_first_watches() -> None:
    """Two ``NeuralDbgCallback`` in one fit (before: the first observed no step, silently)."""
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="relu"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
    x, y = data(256)
    first, second = NeuralDbgCallback(verbose=False), NeuralDbgCallback(verbose=False)
    with pytest.warns(neuraldbg.NeuralDbgWarning, match="another NeuralDbgCallback watches this fit"):
        model.fit(x, y, batch_size=32, epochs=1, callbacks=[first, second], verbose=0)
    assert first.dbg.step == 8 and second.dbg is None


def test_activations_in_the_ring_match_keras_own_outputs(tmp_path: Any) -> None:
    """On JAX the activation statistics travel in a ring the forward pass writes (no host
    callback): every sampled step arrives, and its numbers are those of the layers' outputs
    Keras itself computes on the same batch (a sub-model; the learning rate is 0, so the
    weights of every step are the initial ones). A checkpoint saved during fit holds the
    model's own variables, not the ring."""
    keras.utils.set_random_seed(6)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="sigmoid", name="sig"),
            keras.layers.Dense(16, activation="relu", name="rel"),
            keras.layers.Dense(8, name="lin"),
            keras.layers.Activation("tanh", name="th"),
            keras.layers.Dense(1, name="head"),
        ]
    )
    model.compile(optimizer=keras.optimizers.SGD(0.0), loss="mse")
    x, y = data()
    x *= 4.0  # some sigmoid and tanh units saturate, some ReLU units die in a batch
    cb = NeuralDbgCallback(verbose=False, dense_steps=3, weight_every=4)
    path = tmp_path / "ckpt.keras"
    ckpt = keras.callbacks.ModelCheckpoint(path)
    model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb, ckpt], verbose=0)
    dbg = cb.dbg
    assert dbg.step == 40
    loaded = keras.saving.load_model(path)
    assert len(loaded.weights) == len(model.weights)  # the ring was neither saved nor left behind
    for a, b in zip(loaded.weights, model.weights):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    assert dbg._act_ring is not None and dbg._act_ring.missed == 0  # the ring path, not a callback
    assert "neuraldbg_activations" not in [v.name for v in model.non_trainable_variables]
    sampled = [s for s in range(40) if s < 3 or s % 4 == 0]
    probe = keras.Model(model.inputs, [model.get_layer(n).output for n in ("sig", "rel", "th")])
    seen = {"sat": 0.0, "dead": 0.0}
    for module, k, sat in (("sig.activation", 0, (0.5, 0.49)), ("rel.activation", 1, None), ("th", 2, (0.0, 0.98))):
        steps, absmax = dbg.history(module, "activation_absmax")
        assert list(steps) == sampled
        _, saturated = dbg.history(module, "saturated_fraction")
        _, dead = dbg.history(module, "dead_fraction")
        for i, s in enumerate(sampled):
            batch = x[(s % 20) * 32 : (s % 20 + 1) * 32]
            out = np.asarray(probe([batch])[k], np.float64)
            np.testing.assert_allclose(absmax[i], np.abs(out).max(), rtol=1e-5)
            if sat is None:
                truth = float(np.mean(out.max(axis=0) == 0.0))
                np.testing.assert_allclose(dead[i], truth, atol=1e-6)
                seen["dead"] = max(seen["dead"], truth)
            else:
                truth = float(np.mean(np.abs(out - sat[0]) > sat[1]))
                np.testing.assert_allclose(saturated[i], truth, atol=1e-6)
                seen["sat"] = max(seen["sat"], truth)
    assert seen["sat"] > 0 and seen["dead"] > 0  # the shares were not trivially zero


def test_functional_validation_and_user_callbacks(tmp_path: Any) -> None:
    keras.utils.set_random_seed(2)
    inp = keras.Input((16,))
    h = keras.layers.Dense(32, activation="tanh", name="enc")(inp)
    h = keras.layers.Dense(16, name="mid")(h)
    h = keras.layers.Activation("relu", name="act")(h)
    out = keras.layers.Dense(1, name="head")(h)
    model = keras.Model(inp, out)
    model.compile(optimizer="adam", loss="mse", metrics=["mae"])
    x, y = data()
    from keras_backend_job import Counted

    counter = Counted()
    trace = tmp_path / "keras.ndbg"
    report = tmp_path / "keras.html"
    cb = NeuralDbgCallback(trace=trace, report=report, verbose=False)
    model.fit(
        x[:512],
        y[:512],
        batch_size=32,
        epochs=2,
        validation_data=(x[512:], y[512:]),
        callbacks=[counter, cb],
        verbose=0,
    )
    dbg = cb.dbg
    assert dbg.step == counter.batches == 32
    assert dbg.layers == ["enc", "mid", "head"]
    # Validation passes are no training step and no activation sample of one.
    run = neuraldbg.load(trace)
    assert run.step == dbg.step == 32  # completed steps, like the live dbg.step
    assert [str(h) for h in run.explain_failure()] == [str(h) for h in dbg.explain_failure()]
    assert report.read_text().startswith("<!DOCTYPE html>")
    assert dbg.history("act", "dead_fraction")[1].size >= 10
    # The model is left as it was: a second fit without the callback trains unobserved.
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)
    assert "apply" not in model.optimizer.__dict__
    assert not {"call", "compute_loss"} & set(model.__dict__)
    assert not [v for v in model.non_trainable_variables if v.name.startswith("neuraldbg")]


def test_a_fit_that_raises_ends_its_watch(tmp_path: Any) -> None:
    """A callback of the user's raising, then Ctrl-C: Keras calls no ``on_train_end``; the
    watch ends where fit is left (the checks: ``tests/test_keras_backends.py``)."""
    from keras_backend_job import interrupted
    from test_keras_backends import assert_interrupted

    assert_interrupted(interrupted(str(tmp_path)))


def test_ring_buffer_leaves_no_trace_in_the_optimizer_or_a_checkpoint(tmp_path: Any) -> None:
    """On JAX the numbers travel in a ring buffer the train step carries as an optimizer variable
    for the run: every batch arrives (more batches than the ring has rows, with
    steps_per_execution), a checkpoint saved during fit loads into a fresh model with the
    optimizer's own state, and the optimizer ends as it began."""
    keras.utils.set_random_seed(5)

    def make() -> Any:
        m = keras.Sequential([keras.Input((16,)), keras.layers.Dense(8, activation="tanh"), keras.layers.Dense(1)])
        m.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse", steps_per_execution=4)
        return m

    model = make()
    x, y = data(1280)
    model.fit(x[:64], y[:64], batch_size=32, epochs=1, verbose=0)  # builds the optimizer
    before = [v.name for v in model.optimizer.variables]
    path = tmp_path / "ckpt.keras"
    cb = NeuralDbgCallback(verbose=False, activations=False)
    ckpt = keras.callbacks.ModelCheckpoint(path)
    model.fit(x, y, batch_size=8, epochs=2, shuffle=False, callbacks=[cb, ckpt], verbose=0)
    dbg = cb.dbg
    assert dbg._ring is not None and dbg._ring.rows < 320 and dbg._ring.missed == 0
    assert dbg.step == 2 * 160
    assert list(dbg.history(dbg.layers[0], "grad_norm")[0]) == list(range(320))
    assert [v.name for v in model.optimizer.variables] == before
    assert not {"apply", "save_own_variables", "load_own_variables"} & set(model.optimizer.__dict__)
    loaded = keras.saving.load_model(path)
    assert len(loaded.optimizer.variables) == len(before)
    np.testing.assert_allclose(loaded.optimizer.variables[-1].numpy(), model.optimizer.variables[-1].numpy(), rtol=1e-6)


def test_watched_fits_compile_the_train_step_once() -> None:
    """On JAX the rings change the train step's state, so the first watched fit traces the step
    once (as Keras does for any new state) and later watched fits with the same options run
    that compiled step again, each with its own steps (the update count at its start is in the
    ring, not in the step); a plain fit in between runs the plain step it had, and other options
    trace anew. Traces are counted by Keras's own call of ``train_step``."""
    traces = [0]

    class Counted(keras.Sequential):
        def train_step(self, *args: Any) -> Any:
            traces[0] += 1
            return super().train_step(*args)

    keras.utils.set_random_seed(7)
    model = Counted([keras.Input((16,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = data(320)
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert traces[0] == 1

    def watched(weight_every: int) -> Any:
        truth = grad_norms(model, x[:32], y[:32])  # the first batch of this fit
        cb = NeuralDbgCallback(verbose=False, dense_steps=2, weight_every=weight_every)
        model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
        dbg = cb.dbg
        assert dbg.step == 10
        for name in dbg.layers:
            steps, norms = dbg.history(name, "grad_norm")
            assert list(steps) == list(range(10))
            np.testing.assert_allclose(norms[0], truth[name], rtol=1e-3)
        sampled = [s for s in range(10) if s < 2 or s % weight_every == 0]
        assert list(dbg.history(dbg.layers[0], "weight_norm")[0]) == sampled
        return dbg

    watched(3)
    assert traces[0] == 2
    watched(3)
    assert traces[0] == 2
    model.fit(x, y, batch_size=32, epochs=1, verbose=0)
    assert traces[0] == 2
    watched(3)
    assert traces[0] == 2
    watched(4)  # another constant in the step: traced anew
    assert traces[0] == 3
    assert int(model.optimizer.iterations.numpy()) == 60


@pytest.mark.parametrize("small", [True, False])
def test_parameter_norms_on_sampled_steps_with_no_conditional_in_a_small_models_step(
    small: bool, monkeypatch: Any
) -> None:
    """A small model's step measures its parameters at every step and keeps the sampled steps'
    by a select; a large one's (here: the threshold set to 0) under a conditional, which on a
    GPU waits for the device at every step. Either way the sampled steps get the norms of the
    weights each update began from, replayed with ``train_on_batch``."""
    import neuraldbg.keras as nk

    conds: List[int] = []
    for owner in (keras.ops, jax.lax):

        def spy(*args: Any, _real: Any = owner.cond, **kwargs: Any) -> Any:
            conds.append(1)
            return _real(*args, **kwargs)

        monkeypatch.setattr(owner, "cond", spy)
    if not small:
        monkeypatch.setattr(nk, "ALWAYS_MEASURED", 0)
    model = sigmoid_mlp(2)
    twin = keras.models.clone_model(model)
    twin.set_weights(model.get_weights())
    for m in (model, twin):
        m.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")
    x, y = data(320)
    cb = NeuralDbgCallback(verbose=False, dense_steps=2, weight_every=3)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
    assert (len(conds) > 0) != small
    truth: List[Dict[str, float]] = []
    for i in range(10):
        truth.append(
            {
                layer.name: float(np.sqrt(sum(np.sum(np.asarray(w, np.float64) ** 2) for w in layer.weights)))
                for layer in twin.layers
            }
        )
        twin.train_on_batch(x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])
    sampled = [s for s in range(10) if s < 2 or s % 3 == 0]
    for layer in cb.dbg.layers:
        steps, norms = cb.dbg.history(layer, "weight_norm")
        assert list(steps) == sampled
        np.testing.assert_allclose(norms, [truth[s][layer] for s in sampled], rtol=1e-5)


def test_custom_train_step_subclassed_model() -> None:
    class Net(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.a = keras.layers.Dense(16, activation="tanh")
            self.b = keras.layers.Dense(1)

        def call(self, x: Any, training: bool = False) -> Any:
            return self.b(self.a(x))

        def train_step(self, state: Any, data: Any) -> Any:
            tv, ntv, ov, mv = state
            x, y = data

            def loss_fn(tv: Any) -> Any:
                pred, nt = self.stateless_call(tv, ntv, x, training=True)
                return jnp.mean((pred - y) ** 2), nt

            (loss, ntv2), grads = jax.value_and_grad(loss_fn, has_aux=True)(tv)
            tv2, ov2 = self.optimizer.stateless_apply(ov, grads, tv)
            logs = {"loss": loss}
            return logs, (tv2, ntv2, ov2, mv)

    keras.utils.set_random_seed(3)
    model = Net()
    model.compile(optimizer=keras.optimizers.SGD(0.05))
    x, y = data(320)
    model(x[:2])
    truth = grad_norms(model, x[:32], y[:32])
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
    dbg = cb.dbg
    assert dbg.step == 10
    assert dbg.layers == [model.a.name, model.b.name]
    first = dbg.layers[0]
    np.testing.assert_allclose(dbg.history(first, "grad_norm")[1][0], truth[first], rtol=1e-3)


def test_nan_batch_and_halt_on_stops_fit() -> None:
    keras.utils.set_random_seed(4)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(16, activation="tanh"), keras.layers.Dense(1)])
    model.compile(optimizer=keras.optimizers.SGD(0.01), loss="mse")
    x, y = data()
    x[5 * 32 + 3, 4] = np.nan  # batch 5
    cb = NeuralDbgCallback(halt_on="non_finite", verbose=False)
    hist = model.fit(x, y, batch_size=32, epochs=3, shuffle=False, callbacks=[cb], verbose=0)
    dbg = cb.dbg
    h = dbg.explain_failure("non_finite")[0]
    assert h.confidence >= 0.5 and h.step == 5
    assert str(h.cause) == "bad_input_data"  # the forward pass measured the NaN in batch 5
    assert "inspect the batch of step 5: assert np.isfinite(x).all() in the data pipeline" in h.remedies
    # Keras' terms (the NaN check names each backend's, PyTorch's among them).
    assert not [r for h in dbg.explain_failure() for r in h.remedies if "torch" in r and "on PyTorch" not in r]
    assert dbg.halted is not None
    # Stopped after the next batch: the step of batch 5 is read (waiting for the device and for
    # its loss) before batch 6 starts, and Keras looks at stop_training after each batch.
    assert len(hist.history["loss"]) == 1
    assert dbg.step == 7 == int(model.optimizer.iterations.numpy())


class Moved(keras.callbacks.Callback):
    """How far each batch's update moved each trainable variable relative to its size, read
    from the variables around the batch (inf where it was all zeros)."""

    def __init__(self) -> None:
        super().__init__()
        self.moved: List[List[float]] = []

    def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
        self.before = [np.array(v.numpy(), dtype=np.float64) for v in self.model.trainable_variables]

    def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
        after = [np.array(v.numpy(), dtype=np.float64) for v in self.model.trainable_variables]
        self.moved.append(
            [
                np.linalg.norm(a - b) / np.linalg.norm(b) if np.linalg.norm(b) > 0 else np.inf
                for a, b in zip(after, self.before)
            ]
        )


def test_update_ratio_is_how_far_each_update_moved_each_weight() -> None:
    """On the first ``dense_steps`` updates (the ones the engine reads) each weight's
    ``update_ratio`` is |W_after - W_before| / |W_before| around the batch (biases are not
    measured, as in PyTorch), here under Adam at 1e-6, whose steps move the weights by ~1e-5
    of their size: the diagnosis says so from the measure. Across an epoch's end too (its
    10th batch is the 10th update); not sent on later steps."""
    rng = np.random.default_rng(3)
    x = rng.normal(size=(640, 20)).astype("float32")
    y = (x @ rng.normal(size=(20, 5))).argmax(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [
            keras.Input((20,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(5),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-6), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    cb, truth = NeuralDbgCallback(verbose=False), Moved()

    class Spy(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            assert cb.dbg is not None
            cb.dbg._engine = Measures(cb.dbg._engine)

    model.fit(x, y, epochs=6, batch_size=64, shuffle=False, verbose=0, callbacks=[cb, Spy(), truth])
    dbg = cb.dbg
    assert dbg is not None and dbg.step == 60
    seen = dbg._engine.seen
    kernels = [len(v.shape) >= 2 for v in model.trainable_variables]
    for i in range(60):
        if i < 10:
            assert seen.get(i) is not None, f"step {i}: no update ratio on a dense step"
            got = seen[i]["update_ratio"]
            for k, kernel in enumerate(kernels):
                if kernel:
                    np.testing.assert_allclose(
                        got[k], truth.moved[i][k], rtol=1e-3, err_msg=f"variable {k} at step {i}"
                    )
                    assert 1e-6 < got[k] < 1e-4
                else:
                    assert np.isnan(got[k])
        else:
            assert seen.get(i) is None, f"step {i}: update ratio after the dense steps"
    top = dbg.explain_failure()[0]
    assert (str(top.failure), str(top.cause)) == ("loss_plateau", "learning_rate_too_low"), top
    assert "of their size (measured, lr 1.00e-6)" in top.description, top.description


class Measures:
    """The engine, with the ``measures`` each step brought kept by step."""

    def __init__(self, engine: Any) -> None:
        self.__dict__["engine"] = engine
        self.__dict__["seen"] = {}

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def observe(self, step: int, *args: Any, **kwargs: Any) -> Any:
        self.seen[step] = kwargs.get("measures")
        return self.engine.observe(step, *args, **kwargs)


class Amends:
    """The engine, with the first-batch facts it was given kept."""

    def __init__(self, engine: Any) -> None:
        self.__dict__["engine"] = engine
        self.__dict__["facts"] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def amend_first_batch(self, facts_json: str) -> bool:
        self.facts.append(json.loads(facts_json))
        return self.engine.amend_first_batch(facts_json)


def test_a_bounded_output_regressing_targets_beyond_its_range_is_named_from_the_first_batch(tmp_path: Any) -> None:
    """A sigmoid output (0..1) fitted by MSE to targets around 3 (spread 2): the first training
    batch's targets, output and feature scales reach the engine from the compiled step (the
    model was registered when fit began), as numpy computes them on that batch, and the
    mismatch is named while the loss still falls; the trace replays to the same diagnosis. The
    same model on targets scaled into (0, 1) is quiet."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 8)).astype("float32") * np.array([1, 2, 3, 4, 1, 1, 1, 0.5], "float32")
    y = (3.0 + 2.0 * x[:, :1] + np.sin(x[:, 1:2])).astype("float32")

    def fit(targets: Any, trace: Any = None) -> Any:
        keras.utils.set_random_seed(0)
        model = keras.Sequential(
            [keras.Input((8,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
        )
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        cb = NeuralDbgCallback(verbose=False, trace=trace)

        class Spy(keras.callbacks.Callback):
            def on_train_begin(self, logs: Any = None) -> None:
                assert cb.dbg is not None
                cb.dbg._engine = Amends(cb.dbg._engine)

        history = model.fit(x, targets, batch_size=32, epochs=4, shuffle=False, verbose=0, callbacks=[cb, Spy()])
        return cb.dbg, history.history["loss"]

    trace = tmp_path / "run.ndbg"
    dbg, losses = fit(y, trace)
    assert losses[-1] < losses[0]  # still falling
    (facts,) = dbg._engine.facts
    first = y[:32]
    np.testing.assert_allclose(facts["target_range"], [first.min(), first.max()], rtol=1e-6)
    np.testing.assert_allclose(facts["target_var"], first.var(), rtol=1e-5)
    assert 0.0 <= facts["output_range"][0] <= facts["output_range"][1] <= 1.0
    np.testing.assert_allclose(facts["input_feature_scales"], np.abs(x[:32]).max(axis=0), rtol=1e-6)
    assert facts["target_range"][1] > 4  # far beyond what a sigmoid reaches
    top = dbg.explain_failure()[0]
    assert str(top.cause) == "output_loss_mismatch" and top.confidence >= 0.5, top
    assert [str(h) for h in neuraldbg.load(trace).explain_failure()] == [str(h) for h in dbg.explain_failure()]
    quiet, _ = fit((y - y.min()) / (y.max() - y.min() + 1.0))
    assert not [h for h in quiet.explain_failure() if h.confidence >= 0.5]


def raw_pixel_classifier(scale: float) -> Any:
    """Five classes of 16 features read as pixels (integers 0..255) times ``scale``, through a
    sigmoid layer, 10 epochs of 20 batches in order; returns the inputs, the history and the
    callback."""
    rng = np.random.default_rng(0)
    x = rng.integers(0, 256, size=(640, 16)).astype("float32") * scale
    y = ((x / (255.0 * scale) - 0.5) @ rng.normal(size=(16, 5))).argmax(1)
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((16,)), keras.layers.Dense(32, activation="sigmoid"), keras.layers.Dense(5)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-2), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    cb = NeuralDbgCallback(verbose=False)
    history = model.fit(x, y, batch_size=32, epochs=10, shuffle=False, callbacks=[cb], verbose=0)
    return x, history.history["loss"], cb


def test_each_input_batch_is_measured_and_raw_pixels_are_named_bad_input_data() -> None:
    """The forward pass measures its input batch (every step, like the PyTorch collector), so
    inputs left at 0..255 are named as the cause of the sigmoids they saturate, where the same
    data scaled to [0, 1] trains better and raises nothing."""
    x, raw_loss, cb = raw_pixel_classifier(1.0)
    _, scaled_loss, quiet = raw_pixel_classifier(1.0 / 255.0)
    assert raw_loss[-1] > 1.2 * scaled_loss[-1]  # what the scale did to the run (Keras' own loss)
    dbg = cb.dbg
    assert dbg is not None and quiet.dbg is not None
    steps, scale = dbg.history(None, "input_scale")
    truth = np.abs(x).reshape(20, 32, 16).max(axis=(1, 2))
    assert list(steps) == list(range(200))
    np.testing.assert_allclose(scale, np.tile(truth, 10))
    top = dbg.explain_failure()[0]
    assert (str(top.failure), str(top.cause)) == ("saturated_activations", "bad_input_data")
    assert top.confidence >= 0.5 and top.step == 0
    assert not [h for h in quiet.dbg.explain_failure() if h.confidence >= 0.5]


def test_token_ids_are_not_taken_for_an_input_batch() -> None:
    """Integer inputs (token ids up to 49) are not a batch of values on a raw scale: nothing
    is measured, nothing is said about the data."""
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 50, size=(320, 8))
    y = rng.normal(size=(320, 1)).astype("float32")
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8,), dtype="int32"), keras.layers.Embedding(50, 8), keras.layers.Flatten(), keras.layers.Dense(1)]
    )
    model.compile(optimizer="adam", loss="mse")
    cb = NeuralDbgCallback(verbose=False)
    model.fit(ids, y, batch_size=32, epochs=2, callbacks=[cb], verbose=0)
    dbg = cb.dbg
    assert dbg is not None and dbg.step == 20
    assert np.isnan(dbg.history(None, "input_scale")[1]).all()
    assert not [e for e in dbg.events if str(e.event_type) == "data_anomaly"]
    assert all(str(h.cause) != "bad_input_data" for h in dbg.explain_failure())


def test_gradient_accumulation_one_step_per_update() -> None:
    """Keras's ``gradient_accumulation_steps=4``: one step per optimizer update (what
    ``optimizer.iterations`` counts), observed with the gradient the update applies, the mean of
    its four micro-batches' (here: the gradient of the loss over those 128 samples); the step's
    loss is the mean of its micro-batches' losses."""
    model = sigmoid_mlp(3)
    x, y = data()
    truth = grad_norms(model, x[:128], y[:128])  # the first update's four batches of 32
    model.compile(optimizer=keras.optimizers.SGD(0.01, gradient_accumulation_steps=4), loss="mse")
    cb, moved = NeuralDbgCallback(verbose=False), Moved()

    class Spy(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            assert cb.dbg is not None
            cb.dbg._engine = Measures(cb.dbg._engine)

    hist = model.fit(x, y, batch_size=32, epochs=2, shuffle=False, callbacks=[cb, Spy(), moved], verbose=0)
    dbg = cb.dbg
    assert dbg.step == 10 == int(np.asarray(model.optimizer.iterations))  # 40 batches
    # How far each update moved the kernels: measured around the batch that applies it (the
    # other three of its batches only accumulate).
    seen = dbg._engine.seen
    kernels = [len(v.shape) >= 2 for v in model.trainable_variables]
    for step in range(10):
        ratios = seen[step]["update_ratio"]
        around = moved.moved[4 * step + 3]
        assert all(moved.moved[4 * step][k] == 0.0 for k, kernel in enumerate(kernels) if kernel)  # accumulating
        for k, kernel in enumerate(kernels):
            if kernel:
                np.testing.assert_allclose(ratios[k], around[k], rtol=1e-3, err_msg=f"update {step}")
    for name in dbg.layers:
        steps, norms = dbg.history(name, "grad_norm")
        assert list(steps) == list(range(10))
        np.testing.assert_allclose(norms[0], truth[name], rtol=1e-3)
    _, loss = dbg.history(None, "loss")
    np.testing.assert_allclose(loss.reshape(2, 5).mean(axis=1), hist.history["loss"], rtol=1e-5)
    # The activations of each step arrive too (those of its last micro-batch); its inputs are
    # the four micro-batches' together (before: the last one's).
    assert list(dbg.history(dbg.layers[0] + ".activation", "activation_absmax")[0]) == list(range(10))
    scale = float(np.abs(x[:128]).max())
    assert scale > float(np.abs(x[96:128]).max())  # (the first update's last micro-batch alone says less)
    assert dbg.history(None, "input_scale")[1][0] == pytest.approx(scale, rel=1e-6)


def test_loss_scale_optimizer_watches_the_inner_updates_unscaled() -> None:
    """``LossScaleOptimizer``: the inner optimizer's updates are watched, with the gradients
    unscaled (the loss is scaled by 2**15 in the step)."""
    model = sigmoid_mlp(2)
    x, y = data()
    truth = grad_norms(model, x[:32], y[:32])
    opt = keras.optimizers.LossScaleOptimizer(keras.optimizers.SGD(0.01))
    model.compile(optimizer=opt, loss="mse")
    cb = NeuralDbgCallback(verbose=False)
    model.fit(x, y, batch_size=32, epochs=1, shuffle=False, callbacks=[cb], verbose=0)
    dbg = cb.dbg
    assert float(opt.dynamic_scale.numpy()) > 1000.0  # the loss was scaled
    assert dbg.step == 20 == int(opt.iterations.numpy())
    for name in dbg.layers:
        np.testing.assert_allclose(dbg.history(name, "grad_norm")[1][0], truth[name], rtol=1e-3)
    _, lr = dbg.history(None, "lr")
    np.testing.assert_allclose(lr, 0.01, rtol=1e-6)
    assert not {"apply", "save_own_variables", "load_own_variables"} & (
        set(opt.__dict__) | set(opt.inner_optimizer.__dict__)
    )
    assert not [v for v in opt.variables if "neuraldbg" in v.name]


def test_bad_options_are_clear_errors() -> None:
    with pytest.raises(ConfigError, match="unknown option"):
        NeuralDbgCallback(no_such_option=1)
    with pytest.raises(ConfigError, match="halt_on"):
        NeuralDbgCallback(halt_on="no_such_failure")
    with pytest.raises(ConfigError, match="activations"):
        NeuralDbgCallback(activations="yes")
    model = keras.Sequential([keras.Input((4,)), keras.layers.Dense(1)])
    with pytest.raises(Exception, match="compile"):
        model.fit(np.zeros((4, 4)), np.zeros((4, 1)), callbacks=[NeuralDbgCallback()], verbose=0)


def classify(out_act: Any, loss: Any, regularizer: Any = None) -> Any:
    """A 5-class MLP fitted 3 epochs under ``loss``; returns the weight penalty Keras adds to
    the loss at the first weights (``model.losses``), the history and the callback."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 5))).argmax(1)
    keras.utils.set_random_seed(0)
    dense = dict(kernel_regularizer=regularizer)
    model = keras.Sequential(
        [
            keras.Input((16,)),
            keras.layers.Dense(32, activation="relu", **dense),
            keras.layers.Dense(32, activation="relu", **dense),
            keras.layers.Dense(5, activation=out_act, **dense),
        ]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    penalty = float(sum(np.asarray(v) for v in model.losses))
    cb = NeuralDbgCallback()
    history = model.fit(x, y, epochs=3, batch_size=32, verbose=0, callbacks=[cb])
    return penalty, history.history, cb


@pytest.mark.parametrize(
    ("out_act", "from_logits", "mismatch"),
    [("softmax", True, True), ("softmax", False, False), (None, False, True), (None, True, False)],
)
def test_an_output_that_does_not_fit_the_compiled_loss_is_named(
    out_act: Any, from_logits: bool, mismatch: bool
) -> None:
    """The compiled loss reaches the engine as facts (the operations it applies, the output's
    activation): a softmax output under a loss ``from_logits=True`` (which applies its own
    softmax) and a linear output under one that takes the log of probabilities are output/loss
    mismatches from the first step; the two pairings Keras documents are quiet. Ground truth:
    Keras' own loss ends higher under each mismatch than under the matched pairing."""
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
    _, history, cb = classify(out_act, loss)
    hyps = cb.dbg.explain_failure()
    matched = classify("softmax" if from_logits is False else None, loss)[1]
    if mismatch:
        assert history["loss"][-1] > matched["loss"][-1] + 0.1, (history["loss"], matched["loss"])
        top = hyps[0]
        assert str(top.cause) == "output_loss_mismatch" and top.confidence >= 0.5, hyps
        assert not any("torch" in r or "NLLLoss" in r or "(dim=" in r for r in top.remedies), top.remedies
        if out_act == "softmax":  # said in Keras' terms
            assert "a cross-entropy with from_logits=True expects raw logits" in top.description, top
            assert "CrossEntropyLoss" not in top.description
    else:
        assert all(h.confidence < 0.5 for h in hyps), hyps


@pytest.mark.parametrize("l2", [0.1, 1e-5])
def test_a_weight_penalty_keras_adds_to_the_loss_is_over_regularization(l2: float) -> None:
    """``kernel_regularizer=L2(l2)`` on each Dense: Keras adds the penalty to the loss it
    logs, and the callback tells the engine how many weights carry one. At 0.1 the penalty is
    most of the loss (Keras' own ``model.losses`` at the first weights against the first epoch's
    logged loss) and the finding is over-regularization; at 1e-5 there is none."""
    penalty, history, cb = classify("softmax", "sparse_categorical_crossentropy", keras.regularizers.L2(l2))
    hyps = cb.dbg.explain_failure()
    named = [h for h in hyps if str(h.cause) == "over_regularization"]
    if l2 == 0.1:
        assert penalty > 0.5 * history["loss"][0], (penalty, history["loss"][0])
        assert named and named[0] is hyps[0] and hyps[0].confidence >= 0.5, hyps
        assert "penalty on 3 parameter tensors" in hyps[0].description, hyps[0].description
    else:
        assert named == [] and all(h.confidence < 0.5 for h in hyps), hyps


def test_the_output_activation_is_read_past_dropout_and_not_guessed_in_a_subclassed_model() -> None:
    """The output's activation is the one of the layer that made the output, past layers that
    only pass values on (a trailing Dropout); a subclassed model's output layer is not known
    (its layers are listed in attribute order), so no activation is claimed for it."""
    from neuraldbg.keras import _loss_facts

    seq = keras.Sequential([keras.Input((4,)), keras.layers.Dense(3, activation="softmax"), keras.layers.Dropout(0.1)])
    seq.compile(loss="categorical_crossentropy")
    assert _loss_facts(seq) == {
        "ops": ["Mean", "Neg", "Sum", "Mul", "Log", "Div"],
        "output_op": "Softmax",
        "output_units": 3,
    }

    class Subclassed(keras.Model):
        def __init__(self) -> None:
            super().__init__()
            self.out = keras.layers.Dense(3, activation="softmax")
            self.drop = keras.layers.Dropout(0.1)  # listed last, never the output

        def call(self, x: Any) -> Any:
            return self.out(x)

    sub = Subclassed()
    sub(np.zeros((1, 4), "float32"))
    sub.compile(loss="sparse_categorical_crossentropy")
    facts = _loss_facts(sub)
    assert facts is not None and "output_op" not in facts


@pytest.mark.parametrize("order", ["by class", "shuffled"])
def test_the_first_batchs_classes_reach_the_engine(order: str) -> None:
    """Sparse labels: the first batch's class range and the output's size reach the engine as
    numpy computes them (the facts by which the engine tells batches in class order, a sorted
    ``tf.data`` pipeline without ``.shuffle()``; the rule itself is tested on PyTorch in
    ``test_quiet_evidence.py``)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 20)).astype("float32")
    y = (x @ rng.normal(size=(20, 5))).argmax(1)
    if order == "by class":
        by = np.argsort(y, kind="stable")
        x, y = x[by], y[by]
    keras.utils.set_random_seed(0)
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(16, activation="relu"), keras.layers.Dense(5)])
    model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = NeuralDbgCallback(verbose=False)

    class Spy(keras.callbacks.Callback):
        def on_train_begin(self, logs: Any = None) -> None:
            cb.dbg._engine = Amends(cb.dbg._engine)

    model.fit(x, y, batch_size=64, epochs=1, shuffle=False, verbose=0, callbacks=[cb, Spy()])
    (facts,) = cb.dbg._engine.facts
    assert facts["class_range"] == [float(y[:64].min()), float(y[:64].max())]
    assert (facts["class_range"][0] == facts["class_range"][1]) == (order == "by class")
    assert facts["output_numel"] == 64 * 5
    assert "target_range" not in facts, "class indices are no regression target"


def five_classes() -> Any:
    """1,024 rows of 20 features, labelled by which of 5 random directions scores highest."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 20)).astype("float32")
    return x, (x @ rng.normal(size=(20, 5))).argmax(1)


def five_class_mlp(*after_hidden: Any) -> Any:
    """Two ReLU layers of 64 and 5 logits; ``after_hidden`` puts one layer after each hidden one."""
    keras.utils.set_random_seed(0)
    layers: List[Any] = [keras.Input((20,))]
    for i in range(2):
        layers.append(keras.layers.Dense(64, activation="relu"))
        layers.extend(after_hidden[i : i + 1])
    return keras.Sequential(layers + [keras.layers.Dense(5)])


@pytest.mark.parametrize("rate", [0.9, 0.1])
def test_dropout_whose_rate_is_a_keep_probability_is_named(rate: float) -> None:
    # Dropout(0.9) where TensorFlow 1's keep_prob=0.9 was meant: the loss stays at its chance
    # level, ln 5, while the same network with Dropout(0.1) learns.
    x, y = five_classes()
    model = five_class_mlp(keras.layers.Dropout(rate), keras.layers.Dropout(rate))
    model.compile(
        optimizer=keras.optimizers.Adam(5e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    cb = NeuralDbgCallback()
    losses = model.fit(x, y, batch_size=64, epochs=8, verbose=0, callbacks=[cb]).history["loss"]
    found = cb.dbg.explain_failure()
    if rate == 0.1:
        assert losses[-1] < 0.5, losses
        assert not any(h.confidence >= 0.5 for h in found), found
        return
    assert losses[-1] > 1.2, losses
    top = found[0]
    assert top.confidence >= 0.5 and top.cause == "over_regularization", top
    names = [layer.name for layer in model.layers if isinstance(layer, keras.layers.Dropout)]
    assert f"dropout zeroes 90% of the units at every training step (`{names[0]}`, `{names[1]}`)" in top.description
    assert top.remedies[0].startswith("lower Dropout's rate: it is the share of units dropped, not kept"), top.remedies


def test_labels_permuted_away_from_their_inputs_are_named_with_their_classes_entropy() -> None:
    # The labels of 4,096 rows permuted apart from them: the loss sits where predicting how often
    # each class occurs puts it, and the first batch's classes give that level.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 20)).astype("float32")
    y = (x @ rng.normal(size=(20, 5))).argmax(1)[rng.permutation(4096)]
    model = five_class_mlp()
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    cb = NeuralDbgCallback()
    losses = model.fit(x, y, batch_size=64, epochs=2, shuffle=False, verbose=0, callbacks=[cb]).history["loss"]
    p = np.bincount(y[:64], minlength=5) / 64  # (the first batch: no shuffling)
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    assert losses[-1] > 0.95 * entropy, (losses, entropy)
    top = cb.dbg.explain_failure()[0]
    assert top.cause == "bad_input_data" and top.confidence >= 0.5, top
    assert "look unrelated to their inputs" in top.description, top.description
    said = float(top.description.split("it: ")[1].split(",")[0])
    assert said == pytest.approx(entropy, abs=1e-3), (said, entropy)
    assert any("shuffle x and y together" in r for r in top.remedies), top.remedies


@pytest.mark.parametrize("mistake", ["batch_mean", "fixed"])
def test_a_layer_that_averages_over_the_batch_is_why_the_output_ignores_its_input(mistake: str) -> None:
    # A Lambda meant to average features averages over axis 0, the batch: every sample gets the
    # batch's mean input, and the model can learn only how often each class occurs.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 20)).astype("float32")
    y = (x @ rng.normal(size=(20, 5))).argmax(1)
    keras.utils.set_random_seed(0)
    layers = [keras.Input((20,))]
    if mistake == "batch_mean":
        layers.append(keras.layers.Lambda(lambda t: t * 0 + keras.ops.mean(t, axis=0, keepdims=True)))
    layers += [keras.layers.Dense(64, activation="relu"), keras.layers.Dense(5)]
    model = keras.Sequential(layers)
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    cb = NeuralDbgCallback()
    losses = model.fit(x, y, batch_size=64, epochs=2, verbose=0, callbacks=[cb]).history["loss"]
    found = cb.dbg.explain_failure()
    # Ground truth from the model itself: its output on four different samples.
    out = np.asarray(model(x[:4]))
    if mistake == "fixed":
        assert np.ptp(out, axis=0).max() > 0.01 and losses[-1] < 0.8 * losses[0], (out, losses)
        assert not [h for h in found if h.cause == "output_ignores_input"], found[:2]
        return
    assert np.ptp(out, axis=0).max() == 0.0, out
    p = np.bincount(y, minlength=5) / len(y)
    assert losses[-1] > 0.95 * float(-(p * np.log(p)).sum()), losses
    top = found[0]
    assert top.cause == "output_ignores_input" and top.confidence >= 0.7, found[:2]
    assert "the same for every sample of the batch" in top.description
    assert any("model.predict(x[:4])" in r for r in top.remedies), top.remedies


def test_features_cast_to_integers_are_the_datas_not_dying_relu_units() -> None:
    # Standardized features divided down and cast to integers: every value is 0. With Keras's
    # zero biases every ReLU unit of the first layer then outputs 0 for every sample.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 20)).astype("float32")
    y = (x @ rng.normal(size=(20, 5))).argmax(1)
    x = (x / 10).astype("int32").astype("float32")
    assert not x.any()  # ground truth: the cast left nothing
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(5)])
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3), loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True)
    )
    cb = NeuralDbgCallback()
    model.fit(x, y, batch_size=64, epochs=1, verbose=0, callbacks=[cb])
    found = cb.dbg.explain_failure()
    top = found[0]
    assert top.cause == "bad_input_data" and top.confidence >= 0.7, found[:2]
    assert "every input value of the first batch is 0" in top.description
    assert top.remedies[0].startswith("print the first few inputs"), top.remedies
    assert not [h for h in found if h.cause == "dying_relu" and h.confidence >= 0.5], found[:3]


@pytest.mark.parametrize("scale", [255.0, 1.0])
def test_binary_cross_entropy_targets_outside_zero_one_are_named(scale: float) -> None:
    # A segmentation mask saved as 0/255: the loss goes below zero, which a binary
    # cross-entropy of probabilities never does.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8, 8, 1)).astype("float32")
    y = (x > 0).astype("float32") * scale
    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((8, 8, 1)), keras.layers.Conv2D(8, 3, padding="same", activation="relu")]
        + [keras.layers.Conv2D(1, 3, padding="same")]
    )
    model.compile(optimizer="adam", loss=keras.losses.BinaryCrossentropy(from_logits=True))
    cb = NeuralDbgCallback()
    losses = model.fit(x, y, batch_size=32, epochs=2, verbose=0, callbacks=[cb]).history["loss"]
    found = cb.dbg.explain_failure()
    if scale == 1.0:
        assert min(losses) > 0
        assert not any(h.failure == "data_anomaly" for h in found), found
        return
    assert min(losses) < 0, losses
    top = found[0]
    assert (top.failure, top.cause, top.step) == ("data_anomaly", "bad_input_data", 0), top
    assert "the binary cross-entropy's targets span [0, 255]" in top.description


def _ten_classes_under(schedule: Any, shuffle: bool = False) -> Any:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 32)).astype("float32")
    y = (x @ rng.normal(size=(32, 10))).argmax(1)
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [
            keras.Input((32,)),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(128, activation="relu"),
            keras.layers.Dense(10),
        ]
    )
    model.compile(
        optimizer=keras.optimizers.SGD(schedule, momentum=0.9),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
    )
    cb = NeuralDbgCallback(verbose=False)
    hist = model.fit(x, y, batch_size=64, epochs=12, shuffle=shuffle, callbacks=[cb], verbose=0)
    return cb.dbg, hist.history["loss"]


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_decay_counted_in_epochs_given_to_a_per_update_schedule_freezes_the_loss(shuffle: bool) -> None:
    """``ExponentialDecay(0.1, decay_steps=30, decay_rate=0.1, staircase=True)`` meant as every
    30 epochs: Keras counts optimizer updates, so the rate is below a hundredth of its peak from
    update 90 (the schedule's own values, checked here) and the loss stops where it got to (each
    epoch's mean from the fit's history: flat from the 5th epoch, far above the same schedule
    counted in updates). The finding is the plateau the schedule froze, from update 90, with
    Keras' remedy (before: nothing at 0.5 or above), not a learning rate too high (the loss
    jumped at first under 0.1 with momentum: it then came down as the rate was cut). Shuffled,
    layers whose weights stop moving later (from update 231) follow from that plateau, in its
    chain and below it (before: "parameters the optimizer never updates" at 0.95 on top)."""
    decay = keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=30, decay_rate=0.1, staircase=True)
    lrs = [float(decay(step)) for step in range(384)]
    assert next(s for s, lr in enumerate(lrs) if lr < 1e-3) == 90
    dbg, losses = _ten_classes_under(decay, shuffle)
    assert max(losses[4:]) - min(losses[4:]) < 0.01 * losses[4]  # per-epoch means, 32 updates each
    _, trained = _ten_classes_under(
        keras.optimizers.schedules.ExponentialDecay(0.1, decay_steps=30 * 32, decay_rate=0.1, staircase=True)
    )
    assert trained[-1] < 0.5 * losses[-1]
    found = dbg.explain_failure()
    top = found[0]
    assert (str(top.failure), str(top.cause), top.step) == ("loss_plateau", "learning_rate_too_low", 90), found
    assert top.confidence >= 0.5, top
    assert "frozen: it was still falling" in top.description, top.description
    assert top.remedies[0].startswith("give the schedule decay_steps counted in optimizer updates"), top.remedies
    stalled = [h for h in found if str(h.failure) == "stalled_layer"]
    assert all(h.confidence < top.confidence for h in stalled), found
    if shuffle:
        assert stalled and any("a layer stopped training" in line for line in top.causal_chain), top.causal_chain


@pytest.mark.parametrize("clip", [1e-4, 1.0])
def test_gradients_clipped_far_below_their_norm_under_sgd_are_named(clip: float) -> None:
    # global_clipnorm=1e-4 (a value meant for something else): every SGD step is cut ~10,000x.
    x, y = five_classes()
    model = five_class_mlp()
    # Ground truth by jax.grad: the first batch's gradient, before any update, against the clip.
    tv = [v.value for v in model.trainable_variables]

    def loss(tv: Any) -> Any:
        logits, _ = model.stateless_call(tv, [], x[:64])
        return jnp.mean(-jnp.take_along_axis(jax.nn.log_softmax(logits), y[:64, None], axis=1))

    first = float(np.sqrt(sum(np.sum(np.asarray(g, np.float64) ** 2) for g in jax.grad(loss)(tv))))
    opt = keras.optimizers.SGD(0.05, momentum=0.9, global_clipnorm=clip)
    model.compile(optimizer=opt, loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    cb = NeuralDbgCallback()
    losses = model.fit(x, y, batch_size=64, epochs=5, verbose=0, callbacks=[cb]).history["loss"]
    found = cb.dbg.explain_failure()
    if clip == 1.0:
        assert losses[-1] < 0.5 * losses[0], losses
        assert not any(h.confidence >= 0.5 for h in found), found
        return
    assert first > 100 * clip, "the step's gradient is cut 100x or more"
    assert losses[-1] > 0.95 * losses[0], "and the loss never moves"
    # The engine's typical cut (over every step, from the norms read before apply clips them)
    # is of the first step's order: the loss never moves, nor do the gradients much.
    cut = re.search(r"typically to 1/([\d,.e+]+) of its norm", found[0].description)
    assert cut is not None, found[0]
    assert first / clip / 3 < float(cut.group(1).replace(",", "")) < 3 * first / clip, (cut.group(1), first / clip)
    top = found[0]
    assert top.confidence >= 0.5 and str(top.cause) == "learning_rate_too_low", top
    assert "gradient clipping cut the gradient on 100% of the steps" in top.description, top
    assert top.remedies[0].startswith("raise the optimizer's clipnorm / global_clipnorm"), top.remedies


@pytest.mark.parametrize("out_act", ["softmax", None])
def test_a_subclassed_models_output_activation_is_read_from_its_training_forward_pass(out_act: Any) -> None:
    """A subclassed model's output layer is not known before it runs; on the first training
    forward pass the callback finds the activation whose layer call returned the model's
    output (the same object), so a softmax under ``from_logits=True`` is named as in a
    Sequential model. Ground truth: Keras' own loss ends higher than the same model's with a
    linear output."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(640, 16)).astype("float32")
    y = (x @ rng.normal(size=(16, 5))).argmax(1)

    class Net(keras.Model):
        def __init__(self, act: Any) -> None:
            super().__init__()
            self.hidden = keras.layers.Dense(32, activation="relu")
            self.out = keras.layers.Dense(5, activation=act)

        def call(self, v: Any) -> Any:
            return self.out(self.hidden(v))

    def fit(act: Any) -> Any:
        keras.utils.set_random_seed(0)
        model = Net(act)
        model.compile(keras.optimizers.Adam(1e-3), keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        cb = NeuralDbgCallback(verbose=False)
        return model.fit(x, y, epochs=10, batch_size=32, verbose=0, callbacks=[cb]).history, cb

    history, cb = fit(out_act)
    hyps = cb.dbg.explain_failure()
    if out_act is None:
        assert all(h.confidence < 0.5 for h in hyps), hyps
        return
    linear, _ = fit(None)
    assert history["loss"][-1] > linear["loss"][-1] + 0.1, (history["loss"], linear["loss"])
    top = hyps[0]
    assert str(top.cause) == "output_loss_mismatch" and top.confidence >= 0.5, hyps
    assert "a cross-entropy with from_logits=True expects raw logits" in top.description, top


def _relu_mlp(inputs: int, units: int, out_act: Any = None) -> Any:
    """Two ReLU layers of 64 and an output of ``units``, seeded."""
    keras.utils.set_random_seed(1)
    return keras.Sequential(
        [
            keras.Input((inputs,)),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(64, activation="relu"),
            keras.layers.Dense(units, activation=out_act),
        ]
    )


def _classes_under(loss: Any, units: int) -> Any:
    """A 2x64 ReLU MLP with ``units`` outputs fitted 6 epochs under ``loss`` (Adam 1e-3) on
    2,048 Gaussian rows labelled by a random linear map (10 classes by its argmax, or 2 by
    one column's sign); returns the callback and the per-epoch losses."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 32)).astype("float32")
    w = rng.normal(size=(32, 10))
    y = (x @ w).argmax(1) if units > 1 else (x @ w[:, 0] > 0).astype("float32")
    model = _relu_mlp(32, units)
    model.compile(optimizer=keras.optimizers.Adam(1e-3), loss=loss)
    cb = NeuralDbgCallback(verbose=False)
    return cb, model.fit(x, y, batch_size=64, epochs=6, callbacks=[cb], verbose=0).history["loss"]


def test_a_linear_output_under_the_default_cross_entropy_is_the_loss_not_a_learning_rate() -> None:
    """``loss="sparse_categorical_crossentropy"`` (``from_logits=False``, the default) on a
    ``Dense(10)`` with no activation: Keras divides the raw outputs by their sum and takes the
    log, so where that sum nears zero the output layer's gradient blows up (Adam 1e-3, nothing
    else wrong). The explosion begins in the output layer and is the loss's (before:
    ``learning_rate_too_high`` at 0.85 on top, remedy "lower the learning rate"). Ground truth
    by ``jax.grad`` of Keras' own losses at the initial weights, one sample at a time: the
    output kernel's gradient reaches thousands under this loss and stays below 10 under the
    same loss ``from_logits=True``; the loss never falls, the from-logits run learns."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 32)).astype("float32")
    y = (x @ rng.normal(size=(32, 10))).argmax(1)
    largest = {}
    for from_logits in (False, True):
        model = _relu_mlp(32, 10)
        loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=from_logits)
        tv = [v.value for v in model.trainable_variables]

        def one(xi: Any, yi: Any, tv: Any = tv, model: Any = model, loss_fn: Any = loss_fn) -> Any:
            def loss(tv: Any) -> Any:
                return loss_fn(yi[None], model.stateless_call(tv, [], xi[None])[0])

            return jnp.linalg.norm(jax.grad(loss)(tv)[-2])  # the output kernel's

        largest[from_logits] = float(jax.vmap(one)(x, y).max())
    assert largest[False] > 1000 and largest[True] < 10, largest
    cb, losses = _classes_under("sparse_categorical_crossentropy", 10)
    _, matched = _classes_under(keras.losses.SparseCategoricalCrossentropy(from_logits=True), 10)
    assert matched[-1] < 0.5 * matched[0] and losses[-1] > 0.9 * losses[0], (losses, matched)
    found = cb.dbg.explain_failure()
    top = found[0]
    assert str(top.cause) == "output_loss_mismatch" and top.confidence >= 0.5, found
    assert not any(str(h.cause) == "learning_rate_too_high" and h.confidence >= 0.5 for h in found), found
    assert "set from_logits=True" in top.remedies[0], top.remedies
    explosions = [h for h in found if str(h.failure) == "exploding_gradients"]
    assert explosions and str(explosions[0].cause) == "output_loss_mismatch", found
    assert "the blow-up begins in the output layer" in explosions[0].description, explosions[0]


def test_a_linear_output_under_the_default_binary_cross_entropy_is_told_to_end_in_a_sigmoid() -> None:
    """The binary case of the same mistake (``Dense(1)`` under ``BinaryCrossentropy()``): its
    remedy is a sigmoid or ``from_logits=True`` (before: "activation=softmax", which on one unit
    is the constant 1). Ground truth: the from-logits run ends lower."""
    cb, losses = _classes_under(keras.losses.BinaryCrossentropy(), 1)
    _, matched = _classes_under(keras.losses.BinaryCrossentropy(from_logits=True), 1)
    assert matched[-1] < 0.5 * losses[-1], (losses, matched)
    named = [h for h in cb.dbg.explain_failure() if str(h.cause) == "output_loss_mismatch"]
    assert named and named[0].confidence >= 0.5, named
    assert named[0].remedies[0].startswith('give the output layer activation="sigmoid"'), named[0].remedies
    assert "softmax" not in " ".join(named[0].remedies)


def test_regression_targets_on_their_raw_scale_are_told_to_be_standardized() -> None:
    """Prices of ~2e5 fitted as they are (``loss="mse"``, Adam 1e-3) by a network whose output
    starts near 0: the loss stays at the prices' square. Named bad input data with the targets'
    range against the first outputs', and the remedy standardizes the targets. Ground truth:
    Keras' own history, and the same model fitted on the standardized targets ending below a
    tenth of their variance."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 12)).astype("float32")
    signal = (x @ rng.normal(size=(12, 1)) / 3.5).astype("float32")
    raw = 2e5 + 5e4 * signal

    def fit(y: Any) -> Any:
        model = _relu_mlp(12, 1)
        model.compile(optimizer=keras.optimizers.Adam(1e-3), loss="mse")
        cb = NeuralDbgCallback(verbose=False)
        return cb, model.fit(x, y, batch_size=32, epochs=4, callbacks=[cb], verbose=0).history["loss"]

    cb, losses = fit(raw)
    _, standardized = fit((raw - raw.mean()) / raw.std())
    assert standardized[-1] < 0.1 and losses[-1] > 0.5 * float(np.mean(raw**2)), (standardized, losses)
    found = cb.dbg.explain_failure()
    top = found[0]
    assert str(top.cause) == "bad_input_data" and top.confidence >= 0.5, found
    assert "they are on their raw scale" in top.description, top.description
    assert top.remedies[0].startswith("standardize the regression targets"), top.remedies
    assert "bias_initializer" in top.remedies[0], top.remedies


@pytest.mark.parametrize("out_act", ["sigmoid", None])
def test_one_output_unit_under_a_cross_entropy_over_classes_is_named(out_act: Any) -> None:
    """A binary target fitted by ``Dense(1)`` under ``sparse_categorical_crossentropy`` (a
    sigmoid output) or its ``from_logits=True`` form (a linear one): over one class the one
    probability is the constant 1, so Keras' loss is 0 at every batch and no weight moves.
    Before: "no layer trained ... the loss does not reach the model's output" at 0.93 (sigmoid),
    nothing at 0.5 (linear). Ground truth by ``jax.grad`` of Keras' own loss at the first
    weights: every gradient exactly zero; the same model with 2 units reaches 90% accuracy."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 16)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("int32")
    loss = keras.losses.SparseCategoricalCrossentropy(from_logits=out_act is None)

    def build(units: int) -> Any:
        keras.utils.set_random_seed(1)
        return keras.Sequential(
            [
                keras.Input((16,)),
                keras.layers.Dense(32, activation="relu"),
                keras.layers.Dense(units, activation=out_act),
            ]
        )

    model = build(1)
    tv = [v.value for v in model.trainable_variables]
    grads = jax.grad(lambda tv: loss(y[:256], model.stateless_call(tv, [], x[:256])[0]))(tv)
    assert all(float(jnp.abs(g).max()) == 0.0 for g in grads)
    model.compile(optimizer="adam", loss=loss)
    cb = NeuralDbgCallback(verbose=False)
    assert max(model.fit(x, y, batch_size=64, epochs=2, callbacks=[cb], verbose=0).history["loss"]) < 1e-6
    two = build(2)
    two.compile(optimizer="adam", loss=loss, metrics=["accuracy"])
    assert two.fit(x, y, batch_size=64, epochs=6, verbose=0).history["accuracy"][-1] > 0.9
    top = cb.dbg.explain_failure()[0]
    assert str(top.cause) == "output_loss_mismatch" and top.confidence >= 0.5, top
    assert "a cross-entropy over classes taken of 1 output unit" in top.description, top.description
    assert "Dense(2)" in top.remedies[0], top.remedies
    # A loss at 0 from the first step is not "held above its optimum", nor "creeping".
    plateaus = [h for h in cb.dbg.explain_failure() if str(h.failure) == "loss_plateau"]
    assert plateaus, cb.dbg.explain_failure()
    assert all("at zero from the first step" in h.description for h in plateaus), plateaus


def test_a_confident_sigmoid_output_under_binary_cross_entropy_is_no_saturation() -> None:
    """``Dense(1, activation="sigmoid")`` under ``binary_crossentropy`` that learned its task:
    most outputs sit within 0.05 of 0 or 1 (Keras' own predictions), as confident predictions
    do. Before: ``saturated_activations <- saturating_activation`` at 0.61 on this healthy run."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2048, 16)).astype("float32")
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).astype("float32")
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((16,)), keras.layers.Dense(32, activation="relu"), keras.layers.Dense(1, activation="sigmoid")]
    )
    model.compile(optimizer=keras.optimizers.Adam(1e-2), loss="binary_crossentropy", metrics=["accuracy"])
    cb = NeuralDbgCallback(verbose=False)
    assert model.fit(x, y, batch_size=64, epochs=6, callbacks=[cb], verbose=0).history["accuracy"][-1] > 0.95
    p = model.predict(x, verbose=0)
    assert float((np.abs(p - 0.5) > 0.45).mean()) > 0.5
    assert not any(h.confidence >= 0.5 for h in cb.dbg.explain_failure()), cb.dbg.explain_failure()


@pytest.mark.parametrize("act", ["softmax", "sigmoid"])
def test_a_softmax_over_labels_that_are_not_exclusive_is_named(act: str) -> None:
    """A multi-label task (5 labels, up to 5 present in a sample) under
    ``loss="binary_crossentropy"`` with ``Dense(5, activation="softmax")``: Keras' own
    predictions sum to one, so two present labels cannot both reach 1. Before: nothing at
    0.5 or above. Now the output/loss mismatch (the callback reads the most labels present in
    one sample of the first batch), remedy a sigmoid per label; with ``activation="sigmoid"``
    the same model learns (binary accuracy > 0.85) and nothing is said."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4096, 32)).astype("float32")
    y = (x @ rng.normal(size=(32, 5)) > 0.5).astype("float32")
    assert y.sum(1).max() >= 2
    keras.utils.set_random_seed(1)
    model = keras.Sequential(
        [keras.Input((32,)), keras.layers.Dense(64, activation="relu"), keras.layers.Dense(5, activation=act)]
    )
    model.compile(optimizer="adam", loss="binary_crossentropy", metrics=["binary_accuracy"])
    cb = NeuralDbgCallback(verbose=False)
    history = model.fit(x, y, batch_size=64, epochs=3, callbacks=[cb], verbose=0).history
    found = cb.dbg.explain_failure()
    if act == "sigmoid":
        assert history["binary_accuracy"][-1] > 0.85, history
        assert not any(h.confidence >= 0.5 for h in found), found
        return
    np.testing.assert_allclose(np.asarray(model.predict(x[:64], verbose=0)).sum(1), 1.0, atol=1e-4)
    assert history["binary_accuracy"][-1] < 0.7, history
    top = found[0]
    assert (str(top.failure), str(top.cause)) == ("loss_plateau", "output_loss_mismatch"), found
    assert top.confidence >= 0.5 and "a multi-label task" in top.description, top
    assert 'activation="sigmoid"' in top.remedies[0], top.remedies


@pytest.mark.parametrize("related", [False, True])
@pytest.mark.parametrize("loss", ["binary_crossentropy", "categorical_crossentropy"])
def test_a_classifier_that_learns_only_how_often_each_class_occurs_is_at_chance(loss: str, related: bool) -> None:
    """Unbalanced targets drawn apart from the inputs: a quarter of binary labels 1 under
    ``binary_crossentropy``, or one-hot labels (``to_categorical``) of 4 classes, one of them
    ~70%, under ``categorical_crossentropy``. Keras' loss ends within 5% of the entropy of
    those frequencies (computed from the labels), below ln 2 or ln 4, where the chance level
    read at ln C saw a model that learned. Now a plateau "at its chance level", the
    frequencies' entropy as measured on the first batch of 256. Labels that follow from the
    inputs, about as unbalanced: the loss falls below 80% of it and nothing is said."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8192, 20)).astype("float32")
    binary = loss == "binary_crossentropy"
    if binary:
        truth = x[:, 0] + 0.3 * rng.normal(size=8192) > 0.7 if related else rng.random(8192) < 0.25
        y = truth.astype("float32")
        f = np.array([y.mean(), 1 - y.mean()])
    else:
        bias = np.array([5.5, 0.0, 0.0, 0.0])
        labels = (
            np.argmax(x @ rng.normal(size=(20, 4)) + bias, 1)
            if related
            else rng.choice(4, 8192, p=[0.7, 0.1, 0.1, 0.1])
        )
        y = keras.utils.to_categorical(labels, 4)
        f = np.bincount(labels, minlength=4) / len(labels)
        assert f.max() > 0.6
    entropy = float(-(f * np.log(f)).sum())
    keras.utils.set_random_seed(1)
    head = keras.layers.Dense(1, activation="sigmoid") if binary else keras.layers.Dense(4, activation="softmax")
    model = keras.Sequential([keras.Input((20,)), keras.layers.Dense(64, activation="relu"), head])
    model.compile(optimizer="adam", loss=loss)
    cb = NeuralDbgCallback(verbose=False)
    end = model.fit(x, y, batch_size=256, epochs=5, callbacks=[cb], verbose=0).history["loss"][-1]
    found = cb.dbg.explain_failure()
    if related:
        assert end < 0.8 * entropy, (end, entropy)
        assert not any("chance level" in h.description for h in found), found
        return
    assert abs(end - entropy) < 0.05 * entropy, (end, entropy)
    top = found[0]
    assert str(top.failure) == "loss_plateau", found
    what = "how often a target is 1" if binary else "how often each class occurs"
    assert f"the model learned {what} and nothing of its input" in top.description, top


def test_one_hot_targets_give_their_classes_entropy_and_smoothed_ones_none() -> None:
    from neuraldbg.keras import _one_hot_entropy

    y = keras.utils.to_categorical([0, 0, 0, 1, 2], 4)
    entropy, se = (float(v) for v in np.asarray(_one_hot_entropy(y)))
    p = np.array([0.6, 0.2, 0.2])
    h = float(-(p * np.log(p)).sum())
    assert entropy == pytest.approx(h, rel=1e-5)
    assert se == pytest.approx(np.sqrt(((p * np.log(p) ** 2).sum() - h * h) / 5), rel=1e-4)
    assert np.isnan(np.asarray(_one_hot_entropy(0.9 * y + 0.025))).all()


def test_sample_weights_leave_the_frequencies_uncounted() -> None:
    # Under `class_weight` (sample weights in `compute_loss`) a constant guess's loss is not the
    # frequencies' entropy: the first batch's facts leave it out.
    from neuraldbg.keras import _first_batch_stats

    y = keras.utils.to_categorical([0, 0, 0, 1, 2], 4)
    pred = np.full((5, 4), 0.25, np.float32)
    plain = np.asarray(_first_batch_stats(None, y, pred, 0, "one_hot"))
    weighted = np.asarray(_first_batch_stats(None, y, pred, 0, "one_hot", weighted=True))
    assert np.isfinite(plain[6:8]).all() and np.isnan(weighted[6:8]).all()
    assert np.array_equal(np.delete(plain, [6, 7]), np.delete(weighted, [6, 7]), equal_nan=True)
