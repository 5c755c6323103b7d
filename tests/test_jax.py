"""neuraldbg.jax: flax nnx / optax training loops, jitted, scanned and accumulated.

Ground truth comes from JAX itself: each test step also returns the gradients ``jax.grad``
(``nnx.value_and_grad``) produced, and the per-layer norms are computed from them here, in
float64 on the host, independently of the spoke's own reduction inside the compiled step.
"""

from __future__ import annotations

import functools
import json
import math
import os
import pickle
import re
import subprocess
import sys
import warnings
from typing import Any, Dict, List

import numpy as np
import pytest

jax = pytest.importorskip("jax")
jnp = pytest.importorskip("jax.numpy")
optax = pytest.importorskip("optax")
nnx = pytest.importorskip("flax.nnx")

import neuraldbg  # noqa: E402
from neuraldbg import ConfigError, ModelError  # noqa: E402
from neuraldbg.jax import NeuralDbg  # noqa: E402


class MLP(nnx.Module):
    def __init__(self, depth: int, width: int, rngs: Any, act: Any = jnp.tanh, d_in: int = 8) -> None:
        self.inp = nnx.Linear(d_in, width, rngs=rngs)
        self.hidden = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
        self.out = nnx.Linear(width, 1, rngs=rngs)
        self.act = act

    def __call__(self, x: Any) -> Any:
        x = self.act(self.inp(x))
        for layer in self.hidden:
            x = self.act(layer(x))
        return self.out(x)


LAYERS = ["inp", "hidden.0", "hidden.1", "hidden.2", "out"]


def data(n: int = 512, seed: int = 0) -> Any:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8)).astype(np.float32)
    y = (np.sin(x[:, :1]) + 0.5 * x[:, 1:2]).astype(np.float32)
    return x, y


def mse(model: Any, x: Any, y: Any) -> Any:
    return jnp.mean((model(x) - y) ** 2)


def truth(grads: Any) -> Dict[str, float]:
    """Per-layer L2 norm of the gradients JAX produced (host, float64)."""
    sums: Dict[str, float] = {}
    pure = nnx.as_pure(grads) if isinstance(grads, nnx.State) else grads
    for path, leaf in jax.tree_util.tree_flatten_with_path(pure)[0]:
        keys = [str(getattr(k, "key", getattr(k, "idx", k))) for k in path]
        layer = ".".join(keys[:-1])
        sums[layer] = sums.get(layer, 0.0) + float(np.sum(np.asarray(leaf, dtype=np.float64) ** 2))
    return {k: float(np.sqrt(v)) for k, v in sums.items()}


def make_step() -> Any:
    @nnx.jit
    def step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        loss, grads = nnx.value_and_grad(mse)(model, x, y)
        optimizer.update(model, grads, value=loss)
        return loss, grads

    return step


def train(lr: float, steps: int, *, nan_at: int = -1, depth: int = 3, **options: Any) -> Any:
    model = MLP(depth, 32, nnx.Rngs(0))
    x, y = data()
    gts: List[Dict[str, float]] = []
    losses: List[float] = []
    with NeuralDbg(model, **options) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(lr), learning_rate=lr), wrt=nnx.Param)
        step = make_step()
        for i in range(steps):
            j = (i * 32) % len(x)
            xb = x[j : j + 32].copy()
            if i == nan_at:
                xb[3, 2] = np.nan
            loss, grads = step(model, optimizer, xb, y[j : j + 32])
            gts.append(truth(grads))
            losses.append(float(loss))
    return dbg, gts, losses


def kernels_moved(model: Any, optimizer: Any, *, first: int, steps: int = 60) -> List[float]:
    """Trains the MLP ``steps`` jitted steps on :func:`data`; returns how far each of the
    ``first`` steps moved each kernel relative to its size, read from the model's own
    parameters around the step (the truth a measured or estimated step size is checked by)."""
    x, y = data()
    step = make_step()
    moved: List[float] = []
    for i in range(steps):
        before = [np.asarray(layer.kernel.value) for layer in (model.inp, *model.hidden, model.out)]
        j = (i * 32) % len(x)
        step(model, optimizer, x[j : j + 32], y[j : j + 32])
        after = [np.asarray(layer.kernel.value) for layer in (model.inp, *model.hidden, model.out)]
        if i < first:
            moved += [float(np.linalg.norm(a - b) / np.linalg.norm(b)) for a, b in zip(after, before)]
    return moved


class _Spy:
    """A debugger's engine whose calls named in ``on`` are seen first, with their arguments."""

    def __init__(self, engine: Any, **on: Any) -> None:
        self._engine, self._on = engine, on

    def __getattr__(self, name: str) -> Any:
        attr, seen = getattr(self._engine, name), self._on.get(name)
        if seen is None:
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            seen(*args, **kwargs)
            return attr(*args, **kwargs)

        return call


def history(dbg: Any, layer: str) -> np.ndarray:
    steps, values = dbg.history(layer, "grad_norm")
    assert list(steps) == list(range(len(steps)))
    return values


def test_layers_are_parameter_paths_in_definition_order() -> None:
    model = MLP(3, 16, nnx.Rngs(0))
    dbg = NeuralDbg(model)
    # flax sorts attributes by name (hidden < inp < out); the model defines inp first.
    assert dbg.layers == LAYERS


def test_a_module_used_twice_is_one_layer_in_the_place_it_was_defined() -> None:
    """A tied (shared) module: flax names it by the path its sorted walk meets first
    (``again``); its place in the layer order is where the model defined it, its gradient the
    sum of both uses' (before: it came after the output layer)."""

    class Tied(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.inp = nnx.Linear(8, 16, rngs=rngs)
            self.shared = nnx.Linear(16, 16, rngs=rngs)
            self.again = self.shared
            self.out = nnx.Linear(16, 1, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            return self.out(jnp.tanh(self.again(jnp.tanh(self.shared(jnp.tanh(self.inp(x)))))))

    model = Tied(nnx.Rngs(0))
    x, y = data(64)
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(0.01)), wrt=nnx.Param)
        grads = make_step()(model, optimizer, x[:32], y[:32])[1]
    assert dbg.layers == ["inp", "again", "out"]
    assert history(dbg, "again")[0] == pytest.approx(truth(grads)["again"], rel=1e-5)


def test_healthy_run_no_alarm_and_norms_match_jax_grad() -> None:
    dbg, gts, losses = train(0.01, 40)
    assert dbg.step == 40
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5]
    for layer in LAYERS:
        np.testing.assert_allclose(history(dbg, layer), [g[layer] for g in gts], rtol=1e-4)
    _, loss = dbg.history(None, "loss")
    np.testing.assert_allclose(loss, losses, rtol=1e-6)
    _, lr = dbg.history(None, "lr")
    np.testing.assert_allclose(lr, 0.01, rtol=1e-6)
    _, w = dbg.history("inp", "weight_norm")
    assert len(w) >= 10  # dense_steps 10, then every 10th


@pytest.mark.parametrize("small", [True, False])
def test_parameter_norms_on_sampled_steps_with_no_conditional_in_a_small_models_step(
    small: bool, monkeypatch: Any
) -> None:
    """A small model's update measures its parameters at every step and keeps the sampled
    steps' by a select; a large one's (here: the threshold set to 0) under a conditional, which
    on a GPU waits for the device at every step. Either way the sampled steps get the norms of
    the parameters each update began from, read from the model around each step."""
    import neuraldbg.jax as nj

    conds: List[int] = []
    real = jax.lax.cond

    def spy(*args: Any, **kwargs: Any) -> Any:
        conds.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(jax.lax, "cond", spy)
    if not small:
        monkeypatch.setattr(nj, "ALWAYS_MEASURED", 0)
    model = MLP(3, 32, nnx.Rngs(0))
    x, y = data()
    expected: List[Dict[str, float]] = []
    with NeuralDbg(model, dense_steps=2, weight_every=3) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(0.1), learning_rate=0.1), wrt=nnx.Param)
        step = make_step()
        for i in range(10):
            expected.append(truth(nnx.state(model, nnx.Param)))  # each layer's, before the update
            step(model, optimizer, x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])
    assert (len(conds) > 0) != small
    sampled = [s for s in range(10) if s < 2 or s % 3 == 0]
    for layer in LAYERS:
        steps, norms = dbg.history(layer, "weight_norm")
        assert list(steps) == sampled
        np.testing.assert_allclose(norms, [expected[s][layer] for s in sampled], rtol=1e-5)


def test_learning_rate_too_high_explosion_named(tmp_path: Any) -> None:
    confirmed: List[Any] = []
    trace = tmp_path / "run.ndbg"
    dbg, gts, _ = train(5.0, 40, halt_on="exploding_gradients", on_failure=confirmed.extend, trace=trace)
    exploded = [i for i, g in enumerate(gts) if any(v > 1e3 for v in g.values())]
    assert exploded, "the planted learning rate should make JAX's own gradients explode"
    onset = exploded[0]
    assert all(v < 1e3 for v in gts[0].values())  # healthy before any update
    h = dbg.explain_failure("exploding_gradients")[0]
    assert h.confidence >= 0.5
    assert str(h.cause) == "learning_rate_too_high"
    assert h.step == onset
    assert h.layer in {k for k, v in gts[onset].items() if v > 1e3}
    top = dbg.explain_failure()[0]
    assert str(top.cause) == "learning_rate_too_high"
    # Confirmed while training ran: on_failure heard it, and halt_on marked the run.
    assert any(str(c.failure) == "exploding_gradients" for c in confirmed)
    assert dbg.halted and str(dbg.halted[0].failure) == "exploding_gradients"
    # The fixes are said in optax's terms, not PyTorch's.
    fixes = [r for h in dbg.explain_failure() for r in h.remedies]
    assert "clip gradients: optax.chain(optax.clip_by_global_norm(1.0), tx)" in fixes
    assert not [r for r in fixes if "torch" in r]
    # The trace's model says which framework: replayed, the same fixes.
    assert [h.remedies for h in neuraldbg.load(trace).explain_failure()] == [h.remedies for h in dbg.explain_failure()]


@pytest.mark.parametrize(("make", "lr", "kind"), [(optax.adam, 1e-6, "Adam"), (optax.sgd, 1e-4, None)])
def test_the_optimizers_kind_makes_the_step_size_right(make: Any, lr: float, kind: Any) -> None:
    """The kind of step the wrapped transformation makes is read from its state's types and
    registered with the model, so that a learning rate far too low is said with a step size
    of the right order: Adam moves each weight by about the learning rate whatever the
    gradient's size (here ~5e-6 of the weights at lr 1e-6, which an SGD-style estimate from
    the gradient, all there was before, put 30x lower), SGD (no claim: a plain step keeps no
    state that says so, and the engine's estimate is then a plain step's) by the learning rate
    times the gradient. The truth is how
    far each jitted step moved the kernels, from the model's own parameters."""
    model = MLP(3, 32, nnx.Rngs(0))
    registered: List[Dict[str, Any]] = []
    with NeuralDbg(model) as dbg:
        dbg._engine = _Spy(dbg._engine, register_model=lambda spec: registered.append(json.loads(spec)))
        optimizer = nnx.Optimizer(model, dbg.wrap(make(lr), learning_rate=lr), wrt=nnx.Param)
        moved = kernels_moved(model, optimizer, first=5)
    assert [spec["optimizer"] for spec in registered] == [kind]
    top = dbg.explain_failure()[0]
    assert (str(top.failure), str(top.cause)) == ("loss_plateau", "learning_rate_too_low"), top
    said = float(re.search(r"each step moves the weights by ~([0-9.e+-]+) of their size", top.description)[1])
    truth = float(np.median(moved))
    assert truth / 3 < said < truth * 3, (said, truth)


def _frozen_but_the_head(params: Any) -> Any:
    """optax.masked's mask that trains only ``out``: what a user writes to freeze the rest."""
    return jax.tree_util.tree_map_with_path(lambda path, _: path[0].key == "out", params)


@pytest.mark.parametrize("how", ["adam", "masked"])
def test_update_direction_is_the_cosine_between_each_move_and_its_gradient(how: str) -> None:
    """From two consecutive sampled rows (the first ``dense_steps`` updates), per measured
    kernel: the cosine between how the update moved a strided sample of it (every
    ``size // 8``-th element, the first 8) and the gradient that update was given there, posted
    with the next step's row, as the step size is. Below 0 under Adam; +1 for the layers a user
    meant to freeze with ``optax.masked``, which passes their gradients through as their
    updates, so ``apply_updates`` climbs them: named a flipped update sign (before: a learning
    rate too high). The truth is each kernel's move read from the model around the step and
    the gradient the step returned."""
    model = MLP(3, 32, nnx.Rngs(0))
    x, y = data()
    tx = optax.adam(1e-3) if how == "adam" else optax.masked(optax.adam(1e-3), _frozen_but_the_head)
    seen: Dict[int, np.ndarray] = {}
    truth_: List[Dict[str, float]] = []

    def observed(step: int, *args: Any, measures: Any = None, **kwargs: Any) -> None:
        if measures and "update_direction" in measures:
            seen[step] = np.asarray(measures["update_direction"])

    with NeuralDbg(model) as dbg:
        dbg._engine = _Spy(dbg._engine, observe=observed)
        optimizer = nnx.Optimizer(model, dbg.wrap(tx), wrt=nnx.Param)
        step = make_step()
        for i in range(40):
            layers = [model.inp, *model.hidden, model.out]
            before = [np.asarray(layer.kernel.value, np.float64) for layer in layers]
            j = (i * 32) % len(x)
            _, grads = step(model, optimizer, x[j : j + 32], y[j : j + 32])
            after = [np.asarray(layer.kernel.value, np.float64) for layer in layers]
            pure = nnx.as_pure(grads)
            g = [pure["inp"]["kernel"], *(pure["hidden"][k]["kernel"] for k in range(3)), pure["out"]["kernel"]]
            row = {}
            for name, b, a, gk in zip(LAYERS, before, after, g):
                stride = max(1, b.size // 8)
                move, grad = (a - b).reshape(-1)[::stride][:8], np.asarray(gk, np.float64).reshape(-1)[::stride][:8]
                row[name] = float(move @ grad / np.sqrt((move @ move) * (grad @ grad)))
            truth_.append(row)
    sampled = [s for s in range(40) if s < dbg._dense_steps or s % dbg._weight_every == 0]
    assert sorted(seen) == [s for s in sampled if s - 1 in sampled and s <= dbg._dense_steps]
    names = [".".join(e.layer) for e in dbg._model.entries]
    for s, cosines in seen.items():
        measured = {names[k]: float(v) for k, v in enumerate(cosines) if np.isfinite(v)}
        assert len(measured) == 4 and set(measured) <= set(LAYERS), measured
        for name, value in measured.items():
            assert value == pytest.approx(truth_[s - 1][name], abs=1e-3), (s, name)
            if how == "masked" and name != "out":
                assert value == pytest.approx(1.0, abs=1e-5), (s, name)
            elif s <= 5:  # the steps the engine reads; Adam's momentum may later turn a sample's cosine
                assert value < 0, (s, name, value)
    causes = [str(h.cause) for h in dbg.explain_failure()]
    if how == "adam":
        assert "flipped_update_sign" not in causes
    else:
        top = dbg.explain_failure()[0]
        assert str(top.cause) == "flipped_update_sign" and top.confidence >= 0.8, top
        assert "optax.set_to_zero()" in top.remedies[0]


def test_the_kind_of_step_is_read_from_the_transformations_state() -> None:
    from neuraldbg.jax import optimizer_kind

    kinds = {
        "Adam": [optax.adam(1e-3), optax.adamw(1e-3), optax.chain(optax.clip_by_global_norm(1.0), optax.adam(1e-3))],
        "RMSprop": [optax.rmsprop(1e-3)],
        "Adagrad": [optax.adagrad(0.1)],
        "Lion": [optax.lion(1e-4)],
        "AdaBelief": [optax.adabelief(1e-3)],
        # A plain step keeps no state that says so (nor do sign_sgd or LARS' trust ratio): no claim.
        None: [optax.sgd(0.1), optax.sgd(0.1, momentum=0.9), optax.inject_hyperparams(optax.sgd)(learning_rate=0.1)],
    }
    for kind, txs in kinds.items():
        for tx in txs:
            assert optimizer_kind(optax.with_extra_args_support(tx)) == kind, (kind, tx)


def test_nan_batch_is_named_at_its_step() -> None:
    dbg, gts, losses = train(0.01, 20, nan_at=7)
    assert not np.isfinite(losses[7]) and all(np.isfinite(losses[:7]))
    bad = [i for i, g in enumerate(gts) if not all(np.isfinite(v) for v in g.values())]
    assert bad and bad[0] == 7
    h = dbg.explain_failure("non_finite")[0]
    assert h.confidence >= 0.5
    assert h.step == 7


def test_the_batch_given_as_inputs_is_measured_and_a_nan_batch_is_the_datas() -> None:
    """``optimizer.update(model, grads, value=loss, inputs=x)``: each batch's scale, as numpy
    reads it, at its step; a NaN batch is then bad input data at its step (without it the
    spoke sees only the gradients, and the cause of the NaN is not the data's). A batch of
    token ids alone is not taken for one (no floating-point array)."""
    model = MLP(3, 32, nnx.Rngs(0))
    x, y = data()
    x[7 * 32 + 3, 2] = np.nan

    @nnx.jit
    def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
        loss, grads = nnx.value_and_grad(mse)(model, xb, yb)
        optimizer.update(model, grads, value=loss, inputs={"ids": jnp.zeros((32, 4), jnp.int32), "x": xb})
        return loss

    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(0.01), learning_rate=0.01), wrt=nnx.Param)
        for i in range(12):
            step(model, optimizer, x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])
    steps, scale = dbg.history(None, "input_scale")
    assert list(steps) == list(range(12))
    truth = np.abs(x[: 12 * 32]).reshape(12, 32, 8).max(axis=(1, 2))
    finite = [i for i in range(12) if i != 7]
    np.testing.assert_allclose(scale[finite], truth[finite], rtol=1e-6)
    assert not np.isfinite(scale[7])
    h = dbg.explain_failure()[0]
    assert (str(h.failure), str(h.cause), h.step) == ("data_anomaly", "bad_input_data", 7) and h.confidence >= 0.5

    # Token ids only: nothing measured, nothing claimed about them.
    with NeuralDbg(MLP(1, 8, nnx.Rngs(0))) as ids_only:
        params = nnx.state(ids_only.model, nnx.Param)
        tx = ids_only.wrap(optax.sgd(0.01))
        grads = jax.tree.map(jnp.zeros_like, params)
        tx.update(grads, tx.init(params), params, inputs=jnp.zeros((4, 3), jnp.int32))
    ids_steps, ids_scale = ids_only.history(None, "input_scale")
    assert list(ids_steps) == [0] and np.isnan(ids_scale[0])


def test_no_step_lost_when_the_loop_never_waits() -> None:
    """A loop that never reads a result while it runs (so the device may be steps behind) and a
    ring far shorter than the run: every update arrives once, in order, with the loss the loop
    computed, also the last ones, which only the final state holds."""
    model = MLP(2, 16, nnx.Rngs(3))
    x, y = data()
    steps = 150  # over 9 rings of 16, and not a multiple of 16
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-3), buffer=16), wrt=nnx.Param)
        step = make_step()
        out = []
        for i in range(steps):
            j = (i * 32) % len(x)
            out.append(step(model, optimizer, x[j : j + 32], y[j : j + 32])[0])
        ring = dbg._rings[0]
        # Read lazily: not every state (whether the last read came at the last state depends on
        # when the device finished the steps before it).
        assert ring.every > 1
        assert dbg.step == steps  # read while the run is open: waits for the device
        assert ring.missed == 0
        losses = [float(v) for v in out]
    assert dbg.step == steps
    got, loss = dbg.history(None, "loss")
    assert list(got) == list(range(steps))
    np.testing.assert_allclose(loss, losses, rtol=1e-6)


def test_plain_jit_loop_last_partial_buffer_arrives_at_exit() -> None:
    """A functional loop under jax.jit: the state goes in and out of the compiled step (the host
    sees it there); the steps after the last read are in the final state only."""
    p = {"l1": {"kernel": jnp.asarray(np.random.default_rng(0).normal(size=(8, 4)), jnp.float32), "bias": jnp.zeros(4)}}
    x, _y = data(64)

    def loss_fn(p: Any, xb: Any) -> Any:
        return jnp.mean(jnp.tanh(xb @ p["l1"]["kernel"] + p["l1"]["bias"]) ** 2)

    with NeuralDbg(p) as dbg:
        tx = dbg.wrap(optax.sgd(0.1), buffer=8)
        state = tx.init(p)

        @jax.jit
        def step(p: Any, s: Any, xb: Any) -> Any:
            loss, g = jax.value_and_grad(loss_fn)(p, xb)
            u, s = tx.update(g, s, p, value=loss)
            return optax.apply_updates(p, u), s, loss

        out = []
        for i in range(21):
            p, state, loss = step(p, state, x[(i % 8) * 8 : (i % 8 + 1) * 8])
            out.append(loss)
        assert int(state.count) == 21
    assert dbg.step == 21
    _, loss = dbg.history(None, "loss")
    np.testing.assert_allclose(loss, [float(v) for v in out], rtol=1e-6)


@pytest.mark.parametrize("mistake", ["updates not applied", "parameters re-initialized", "none"])
def test_updates_that_never_reach_the_parameters_are_named_with_optax_remedy(mistake: str) -> None:
    """A functional ``jax.jit`` loop under Adam 1e-3 that computes its updates and returns the
    parameters it was given, or one that re-initializes them before each step: the weights
    never move (checked here against the parameters the loop ends with) and the loss stays at
    its start. Named `parameters_not_updated` from the measured step size of exactly 0, with the
    remedy that applies and carries the updates (before: a learning rate too low, "raise the
    learning rate 10x"). Applied and carried: no such finding."""
    x, y = data()

    def init() -> Any:
        g = np.random.default_rng(0)
        return {
            "l1": {"kernel": jnp.asarray(g.normal(size=(8, 64)) / np.sqrt(8), jnp.float32), "bias": jnp.zeros(64)},
            "l2": {"kernel": jnp.asarray(g.normal(size=(64, 64)) / 8, jnp.float32), "bias": jnp.zeros(64)},
            "out": {"kernel": jnp.asarray(g.normal(size=(64, 1)) / 8, jnp.float32), "bias": jnp.zeros(1)},
        }

    def loss_fn(p: Any, xb: Any, yb: Any) -> Any:
        h = jnp.tanh(jnp.tanh(xb @ p["l1"]["kernel"] + p["l1"]["bias"]) @ p["l2"]["kernel"] + p["l2"]["bias"])
        return jnp.mean((h @ p["out"]["kernel"] + p["out"]["bias"] - yb) ** 2)

    p = start = init()
    losses = []
    with NeuralDbg(p) as dbg:
        tx = dbg.wrap(optax.adam(1e-3))
        state = tx.init(p)

        @jax.jit
        def step(p: Any, s: Any, xb: Any, yb: Any) -> Any:
            loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
            u, s = tx.update(g, s, p, value=loss)
            return (p if mistake == "updates not applied" else optax.apply_updates(p, u)), s, loss

        for i in range(150):
            if mistake == "parameters re-initialized":
                p = init()
            j = (i * 32) % len(x)
            p, state, loss = step(p, state, x[j : j + 32], y[j : j + 32])
            losses.append(float(loss))
    found = dbg.explain_failure()
    said = [h for h in found if "never reached the weights" in h.description]
    if mistake == "none":
        assert np.mean(losses[-20:]) < 0.5 * np.mean(losses[:20]) and said == [], found
        return
    assert np.mean(losses[-20:]) > 0.9 * np.mean(losses[:20])  # it did not learn
    if mistake == "updates not applied":
        assert not np.any(np.asarray(p["l1"]["kernel"] - start["l1"]["kernel"]))
    assert found, "no finding"
    top = found[0]
    assert (str(top.failure), str(top.cause)) == ("loss_plateau", "parameters_not_updated"), found
    assert top.confidence >= 0.5 and said and said[0] is top, top
    assert top.remedies[0].startswith("apply the updates and carry them: params = optax.apply_updates(params, updates)")
    assert not any(str(h.cause) == "learning_rate_too_low" and h.confidence >= 0.2 for h in found), found


@pytest.mark.parametrize("value", [False, True])
def test_updates_given_no_loss_are_said_at_the_end(value: bool) -> None:
    """An update not given its loss (``value=``) leaves the engine no loss to judge a plateau
    or a divergence by: said once at the end of the block, with the call that gives it (before:
    nothing, and a learning rate 1,000x too low went unnamed). Given: not said."""
    model = MLP(1, 16, nnx.Rngs(0))
    x, y = data()

    @nnx.jit
    def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
        loss, grads = nnx.value_and_grad(mse)(model, xb, yb)
        optimizer.update(model, grads, **({"value": loss} if value else {}))
        return loss

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NeuralDbg(model) as dbg:
            optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(1e-3)), wrt=nnx.Param)
            for i in range(12):
                step(model, optimizer, x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])
    said = [str(w.message) for w in caught if "none of their losses" in str(w.message)]
    assert dbg.step == 12
    if value:
        assert said == []
    else:
        assert len(said) == 1 and "optimizer.update(model, grads, value=loss)" in said[0], said


def test_donating_loop_loses_no_step() -> None:
    """A jax.jit loop that donates its state (each step deletes the buffers it was given) and
    never waits: lazy reading sees a buffer deleted before it was read, then waits for the
    device at each read, and every update arrives with the loss the loop computed."""
    p = {"l1": {"kernel": jnp.asarray(np.random.default_rng(1).normal(size=(8, 4)), jnp.float32), "bias": jnp.zeros(4)}}
    x, _y = data(64)

    def loss_fn(p: Any, xb: Any) -> Any:
        return jnp.mean(jnp.tanh(xb @ p["l1"]["kernel"] + p["l1"]["bias"]) ** 2)

    with NeuralDbg(p) as dbg:
        tx = dbg.wrap(optax.sgd(0.1), buffer=8)
        state = tx.init(p)

        @functools.partial(jax.jit, donate_argnums=(0, 1))
        def step(p: Any, s: Any, xb: Any) -> Any:
            loss, g = jax.value_and_grad(loss_fn)(p, xb)
            u, s = tx.update(g, s, p, value=loss)
            return optax.apply_updates(p, u), s, loss

        out = []
        for i in range(100):
            p, state, loss = step(p, state, x[(i % 8) * 8 : (i % 8 + 1) * 8])
            out.append(loss)
        ring = dbg._rings[0]
        assert ring.missed == 0
        # Whether a buffer was donated before it was read depends on who was faster, the loop or
        # the device (usually the loop on a CPU; not under load, nor on an H200): nothing is
        # lost either way. What happens once one is, the test below sees directly.
    assert dbg.step == 100
    steps, loss = dbg.history(None, "loss")
    assert list(steps) == list(range(100))
    np.testing.assert_allclose(loss, [float(v) for v in out], rtol=1e-6)


@pytest.mark.parametrize("many", [False, True])
def test_squares_of_small_leaves_together_match_numpy(many: bool) -> None:
    """The compiled step's sums of squares (small leaves as the rows of one matrix, summed per
    leaf by one product; large ones alone; an absent parameter -1), against numpy in float64;
    with many small leaves the rows widen."""
    from neuraldbg._jax_stats import SMALL_LEAF, squares

    rng = np.random.default_rng(4)
    shapes = [(64, 64), (64,), (3, 5, 7), (64, 10), (10,), (1,), (SMALL_LEAF + 3,), (17, 64), (0,)]
    if many:
        shapes += [(4096 + k,) for k in range(40)]
    leaves = [rng.normal(size=s).astype(np.float32) * 10.0 ** rng.integers(-8, 3) for s in shapes]
    where = [3, -1, 0, 8, 6, 1, 2, 5, 4, 7] + list(range(9, len(shapes)))
    got = np.asarray(jax.jit(lambda ls: squares(ls, where))([jnp.asarray(v) for v in leaves]))
    want = [np.sum(np.asarray(leaves[i], np.float64) ** 2) if i >= 0 else -1.0 for i in where]
    np.testing.assert_allclose(got, want, rtol=1e-5)


class _Buffer:
    """A stand-in for a device buffer: ready or not, deleted or not; reading one that is not
    ready is what waiting for the device would be, and is recorded."""

    def __init__(self, count: int, rows: int, width: int) -> None:
        from neuraldbg._spoke import RING_MARKER

        v = np.zeros((rows + 1, width), np.float32)
        v[:rows, 0] = np.array([-1], np.int32).view(np.float32)[0]
        for s in range(max(0, count - rows), count):
            v[s % rows, :2] = np.array([s, 0], np.int32).view(np.float32)
        v[rows, :2] = np.array([count, RING_MARKER], np.int32).view(np.float32)
        self.v, self.shape = v, v.shape
        self.ready, self.deleted, self.waited = False, False, False

    def is_ready(self) -> bool:
        return self.ready

    def is_deleted(self) -> bool:
        return self.deleted

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        self.waited = self.waited or not self.ready
        return self.v


def test_a_buffer_donated_before_it_was_read_turns_lazy_reading_into_waiting() -> None:
    """A state buffer deleted (donated to the next step) before the host read it: the reader
    drops it, lets the next state's buffer (which holds its rows) stand for it, and from then on
    waits for the device at each read so that no later buffer goes the same way."""
    p = {"l1": {"kernel": jnp.ones((8, 4)), "bias": jnp.zeros(4)}}
    with NeuralDbg(p) as dbg:
        tx = dbg.wrap(optax.sgd(0.1), buffer=8)
        tx.init(p)
        ring = dbg._rings[0]
        buf = jnp.zeros((ring.rows + 1, ring.width), jnp.float32)
        buf.delete()
        ring.pending.append(buf)
        assert not ring.donated
        ring.pump()
        assert ring.donated and not ring.pending and ring.missed == 0


def test_lazy_reading_never_waits_for_the_step_just_dispatched() -> None:
    """Lazy reading (one state in up to 16) reads the buffers the device is done with and leaves
    the newest, still being computed, to the next read: the host waits for no step it has just
    dispatched (on a step longer than its dispatch that wait would empty the device's queue each
    time). A buffer deleted unread (a loop that donates its state) makes reads wait from then on,
    and no step is lost either way."""
    from neuraldbg._spoke import RingReader

    posted: List[int] = []
    rows, width = 32, 6
    reader = RingReader(None, rows, width, post=lambda steps, flags, rows: posted.extend(steps.tolist()))  # type: ignore[arg-type]
    reader.max_every = 16
    made = []
    for count in range(1, 61):
        buf = _Buffer(count, rows, width)
        made.append(buf)
        for older in made[:-1]:
            older.ready = True  # the device finishes a step by the time the next one is dispatched
        if reader.due():
            reader.add(buf)
        else:
            reader.unread = buf
    assert not any(b.waited for b in made)
    assert not reader.donated and 0 < len(posted) < 60 and posted == list(range(len(posted)))
    for count in range(61, 101):  # now each step deletes the buffer of the last (donation)
        buf = _Buffer(count, rows, width)
        made[-1].deleted = True
        made.append(buf)
        if reader.due():
            reader.add(buf)
        else:
            reader.unread = buf
    assert reader.donated and any(b.waited for b in made[60:])
    reader.unread = made[-1]
    made[-1].deleted = False
    reader.pump(wait=1)
    assert posted == list(range(100)) and reader.missed == 0


def test_lazy_reading_reads_fast_steps_in_batches_and_slow_ones_as_they_come(monkeypatch: Any) -> None:
    """A read costs about the same whatever its number of rows, so lazy reading takes a state in
    once ``READ_INTERVAL`` has passed since the last read: steps faster than that are read
    together (before half the ring fills, so that none is lost), a slower step at the next state
    after it, never waiting for the device."""
    from neuraldbg import _spoke

    clock = [0.0]
    monkeypatch.setattr(_spoke.time, "monotonic", lambda: clock[0])
    reads: List[List[int]] = []
    rows, width = 32, 6
    reader = _spoke.RingReader(None, rows, width, post=lambda steps, flags, r: reads.append(steps.tolist()))  # type: ignore[arg-type]
    reader.max_every = 256  # (as the JAX spoke's)
    made: List[_Buffer] = []

    def state(count: int, seconds: float) -> None:
        clock[0] += seconds
        for older in made:
            older.ready = True  # the device finishes a step by the time the next one is dispatched
        made.append(_Buffer(count, rows, width))
        if reader.due():
            reader.add(made[-1])
        else:
            reader.unread = made[-1]

    for count in range(1, 301):  # 1 ms steps: 0.3 s
        state(count, 0.001)
    fast = list(reads)
    posted = [s for r in fast for s in r]
    assert posted == list(range(len(posted))) and len(posted) >= 250 and reader.missed == 0
    # Read in batches, each before half the ring filled (the ring holds 32 steps, the interval 100).
    assert 2 <= len(fast) <= 30 and max(len(r) for r in fast) <= rows // 2 + 1, [len(r) for r in fast]
    for count in range(301, 311):  # 0.5 s steps: from the second on, each read at the next state
        reads.clear()
        state(count, 0.5)
        if count >= 302:  # (the first two catch up with the fast steps' last rows)
            assert reads[-1][-1] == count - 2 and (count == 302 or reads == [[count - 2]]), (count, reads)
    assert not any(b.waited for b in made) and reader.missed == 0


def test_a_functional_loop_reads_each_state_once_per_half_ring() -> None:
    """A ``jax.jit`` step over a params pytree meets each state twice: built from the step's
    outputs, then flattened as the next step's input. The second sighting is the same state, so
    lazy reading counts it once and reads once per half ring (32 rows: every 16 steps, after
    a start that doubles the interval), every update observed."""
    params = {
        "l1": {"kernel": jnp.ones((8, 16)) * 0.1, "bias": jnp.zeros(16)},
        "l2": {"kernel": jnp.ones((16, 1)) * 0.1},
    }
    x = jnp.asarray(np.random.default_rng(0).normal(size=(32, 8)), jnp.float32)
    y = jnp.sum(x, axis=1, keepdims=True)
    with NeuralDbg(params) as dbg:
        tx = dbg.wrap(optax.sgd(0.01), learning_rate=0.01, buffer=32)
        ring = dbg._rings[0]
        ring.interval = math.inf  # (reads by count only: what the test counts)
        taken: List[int] = []  # the update count of each state lazy reading takes
        add = ring.add
        ring.add = lambda buf: (taken.append(int(np.asarray(buf)[-1, :1].view(np.int32)[0])), add(buf))

        @jax.jit
        def step(p: Any, s: Any) -> Any:
            loss, grads = jax.value_and_grad(
                lambda q: jnp.mean((jnp.tanh(x @ q["l1"]["kernel"] + q["l1"]["bias"]) @ q["l2"]["kernel"] - y) ** 2)
            )(p)
            updates, s = tx.update(grads, s, p, value=loss)
            return optax.apply_updates(p, updates), s

        state = tx.init(params)
        for _ in range(200):
            params, state = step(params, state)
        jax.block_until_ready(params)
    assert dbg.step == 200 and ring.missed == 0
    # Half a ring apart (16 steps) once the interval has doubled up to it; counting each state
    # twice read every 8 steps.
    apart = np.diff(taken).tolist()
    assert apart[:3] == [2, 4, 8] and set(apart[3:]) == {16}, apart


def test_nan_halts_on_its_step() -> None:
    """``halt_on``: the loop checks ``dbg.halted`` after each step; once the step's loss has been
    read (the device has finished it), the halt is there, dated at the NaN batch."""
    model = MLP(2, 16, nnx.Rngs(0))
    x, y = data()
    stopped = None
    with NeuralDbg(model, halt_on="non_finite") as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(0.01)), wrt=nnx.Param)
        step = make_step()
        for i in range(30):
            xb = x[i * 16 : (i + 1) * 16].copy()
            if i == 7:
                xb[0, 0] = np.nan
            loss, _ = step(model, optimizer, xb, y[i * 16 : (i + 1) * 16])
            if i < 7:
                assert np.isfinite(float(loss)) and dbg.halted is None
            elif not np.isfinite(float(loss)) and dbg.halted:
                stopped = i
                break
    assert stopped == 7
    assert dbg.step == 8
    assert str(dbg.halted[0].failure) == "non_finite" and dbg.halted[0].step == 7


def test_more_updates_per_call_than_the_ring_holds_is_said() -> None:
    """A scan of 8 updates per call over a ring of 4 rows cannot keep them all: a warning names
    the steps missed and the remedy, and the steps kept are right."""
    model = MLP(1, 8, nnx.Rngs(2))
    x, y = data(256)
    xs, ys = x.reshape(8, 32, 8), y.reshape(8, 32, 1)
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(0.01), buffer=4), wrt=nnx.Param)

        @nnx.jit
        def epoch(model: Any, optimizer: Any, xs: Any, ys: Any) -> Any:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def body(carry: Any, xb: Any, yb: Any) -> Any:
                model, optimizer = carry
                loss, grads = nnx.value_and_grad(mse)(model, xb, yb)
                optimizer.update(model, grads, value=loss)
                return (model, optimizer), loss

            _, losses = body((model, optimizer), xs, ys)
            return losses

        with pytest.warns(neuraldbg.NeuralDbgWarning, match="missed steps 0-3.*buffer=N"):
            losses = np.asarray(epoch(model, optimizer, xs, ys))
            assert dbg.step == 8
    steps, loss = dbg.history(None, "loss")
    assert list(steps) == [4, 5, 6, 7]
    np.testing.assert_allclose(loss, losses[4:], rtol=1e-6)


@pytest.mark.parametrize(
    "wrapped, mean",
    [("inside", True), ("outside", True), ("outside", False), ("its gradient_transformation()", True)],
)
def test_gradient_accumulation_is_one_step_per_update(wrapped: str, mean: bool) -> None:
    """``optax.MultiSteps`` around the watched transformation, or watched itself (the
    debugger then watches the transformation inside it, the accumulation's settings kept:
    ``use_grad_mean=False`` applies the sum of the micro-batches' gradients)."""
    model = MLP(2, 16, nnx.Rngs(1))
    x, y = data(256)
    with NeuralDbg(model) as dbg:
        if wrapped == "inside":
            tx = optax.MultiSteps(dbg.wrap(optax.adam(1e-3)), every_k_schedule=4)
        else:
            accumulating = optax.MultiSteps(optax.adam(1e-3), every_k_schedule=4, use_grad_mean=mean)
            tx = dbg.wrap(accumulating if wrapped == "outside" else accumulating.gradient_transformation())
            assert dbg.wrap(tx) is tx  # watched once, however often it is wrapped
        optimizer = nnx.Optimizer(model, tx, wrt=nnx.Param)

        @nnx.jit
        def micro(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            loss, grads = nnx.value_and_grad(mse)(model, xb, yb)
            optimizer.update(model, grads, value=loss)
            return grads

        accumulated = []
        group: List[Any] = []
        for i in range(24):
            j = (i * 16) % len(x)
            group.append(micro(model, optimizer, x[j : j + 16], y[j : j + 16]))
            if len(group) == 4:
                total = jax.tree.map(lambda *g: sum(g) / (4 if mean else 1), *group)
                accumulated.append(truth(total))
                group = []
    assert dbg.step == 6
    for layer in ("inp", "hidden.0", "out"):
        np.testing.assert_allclose(history(dbg, layer), [g[layer] for g in accumulated], rtol=1e-4)


def test_scan_over_batches_one_step_each() -> None:
    """A scan of 8 updates per call and a ring of 16 rows: lazy reading reads often enough (one
    state in 16 would lose steps) and every update arrives."""
    model = MLP(2, 16, nnx.Rngs(2))
    x, y = data(256)
    xs, ys = x.reshape(8, 32, 8), y.reshape(8, 32, 1)
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(0.01), buffer=16), wrt=nnx.Param)

        @nnx.jit
        def epoch(model: Any, optimizer: Any, xs: Any, ys: Any) -> Any:
            @nnx.scan(in_axes=(nnx.Carry, 0, 0), out_axes=(nnx.Carry, 0))
            def body(carry: Any, xb: Any, yb: Any) -> Any:
                model, optimizer = carry
                loss, grads = nnx.value_and_grad(mse)(model, xb, yb)
                optimizer.update(model, grads, value=loss)
                return (model, optimizer), loss

            _, losses = body((model, optimizer), xs, ys)
            return losses

        losses = np.concatenate([np.asarray(epoch(model, optimizer, xs, ys)) for _ in range(6)])
    assert dbg._rings[0].missed == 0
    assert dbg.step == 48
    _, loss = dbg.history(None, "loss")
    np.testing.assert_allclose(loss, losses, rtol=1e-6)


def test_params_pytree_plain_optax_and_schedule_lr(tmp_path: Any) -> None:
    rng = np.random.default_rng(0)
    params = {
        "params": {
            "Dense_0": {"kernel": jnp.asarray(rng.normal(size=(8, 16)) * 0.3, jnp.float32), "bias": jnp.zeros(16)},
            "Dense_1": {"kernel": jnp.asarray(rng.normal(size=(16, 1)) * 0.3, jnp.float32), "bias": jnp.zeros(1)},
        }
    }

    def f(p: Any, x: Any) -> Any:
        h = jnp.tanh(x @ p["Dense_0"]["kernel"] + p["Dense_0"]["bias"])
        return h @ p["Dense_1"]["kernel"] + p["Dense_1"]["bias"]

    def loss_fn(p: Any, x: Any, y: Any) -> Any:
        return jnp.mean((f(p, x) - y) ** 2)

    schedule = optax.linear_schedule(0.05, 0.01, 20)
    x, y = data(320)
    inner = params["params"]
    path = tmp_path / "run.ndbg"
    with NeuralDbg(params, trace=path) as dbg:
        tx = dbg.wrap(optax.inject_hyperparams(optax.sgd)(learning_rate=schedule))
        state = tx.init(inner)

        @jax.jit
        def step(p: Any, s: Any, xb: Any, yb: Any) -> Any:
            loss, g = jax.value_and_grad(loss_fn)(p, xb, yb)
            u, s = tx.update(g, s, p, value=loss)
            return optax.apply_updates(p, u), s, g

        gts = []
        for i in range(10):
            inner, state, g = step(inner, state, x[i * 32 : (i + 1) * 32], y[i * 32 : (i + 1) * 32])
            gts.append(truth(g)["Dense_0"])
    assert dbg.layers == ["Dense_0", "Dense_1"]
    _, lr = dbg.history(None, "lr")
    np.testing.assert_allclose(lr, [float(schedule(i)) for i in range(10)], rtol=1e-5)
    np.testing.assert_allclose(history(dbg, "Dense_0"), gts, rtol=1e-4)
    # The trace replays to the same diagnosis.
    run = neuraldbg.load(path)
    assert run.step == dbg.step == 10  # completed steps, like the live dbg.step
    assert [str(h) for h in run.explain_failure()] == [str(h) for h in dbg.explain_failure()]
    html = dbg.report_html()
    assert "Dense_0" in html


def test_code_written_for_the_unwrapped_state_runs_on_the_watched_one() -> None:
    """What training code does with an optax state, done with the watched one: a linen
    ``TrainState`` saved with ``flax.serialization`` (before: "can not serialize 'WatchState'"),
    its checkpoint loaded by a run watched or not, either way round; the learning rate read and
    changed through ``opt_state.hyperparams`` (optax's way between steps; before: no attribute
    ``hyperparams``); a chain's states by index; the state pickled."""
    serialization = pytest.importorskip("flax.serialization")
    train_state = pytest.importorskip("flax.training.train_state")
    x, y = data(64)
    params = {"w": jnp.full((8, 1), 0.1, jnp.float32), "b": jnp.zeros((1,), jnp.float32)}

    def loss_fn(p: Any) -> Any:
        return jnp.mean((x[:32] @ p["w"] + p["b"] - y[:32]) ** 2)

    def trained(tx: Any) -> Any:
        ts = train_state.TrainState.create(apply_fn=None, params=params, tx=tx)
        for _ in range(3):
            ts = ts.apply_gradients(grads=jax.grad(loss_fn)(ts.params))  # (the loss it cannot pass)
        return ts

    plain = trained(optax.adam(1e-2))
    with NeuralDbg(params) as dbg:
        watched = trained(dbg.wrap(optax.adam(1e-2)))
        fresh = train_state.TrainState.create(apply_fn=None, params=params, tx=dbg.wrap(optax.adam(1e-2)))
        # An unwatched run's checkpoint into a watched run: the inner state restored, the ring its own.
        loaded = serialization.from_bytes(fresh, serialization.to_bytes(plain))
        assert loaded.opt_state.ring is fresh.opt_state.ring
        back = serialization.from_bytes(plain, serialization.to_bytes(watched))  # and the other way
    assert serialization.to_bytes(watched) == serialization.to_bytes(plain)  # the same training, the same bytes
    for a, b in zip(jax.tree.leaves(loaded.opt_state.inner), jax.tree.leaves(plain.opt_state)):
        np.testing.assert_array_equal(a, b)
    for a, b in zip(jax.tree.leaves(back.opt_state), jax.tree.leaves(watched.opt_state.inner)):
        np.testing.assert_array_equal(a, b)
    assert dbg.step == 3

    with NeuralDbg(params) as dbg:
        tx = dbg.wrap(optax.inject_hyperparams(optax.sgd)(learning_rate=0.1))
        state = tx.init(params)
        step = jax.jit(lambda p, s: tx.update(jax.grad(loss_fn)(p), s, p, value=loss_fn(p)))
        for lr in (0.1, 0.01):
            state.hyperparams["learning_rate"] = lr
            _, state = step(params, state)
        assert float(state.hyperparams["learning_rate"]) == np.float32(0.01)
        chain = dbg.wrap(optax.chain(optax.clip(1.0), optax.adam(0.1))).init(params)
        assert type(chain[0]).__name__ == "EmptyState" and type(chain[1][0]).__name__ == "ScaleByAdamState"
        copy = pickle.loads(pickle.dumps(state))
        assert float(copy.hyperparams["learning_rate"]) == np.float32(0.01)
    np.testing.assert_allclose(dbg.history(None, "lr")[1][:2], [0.1, 0.01], rtol=1e-6)


def test_a_pmap_loop_over_replicated_state_is_read_from_its_first_replica() -> None:
    """Data parallel with ``jax.pmap``: the state carries one ring per device (a leading axis),
    alike after the gradients' ``pmean``; every update is a step with the gradients JAX gave
    (before: no step was read, and leaving the block raised an IndexError from the ring
    reader). One device here: the axis is there all the same."""
    rng = np.random.default_rng(5)
    params = {"l1": {"w": jnp.asarray(rng.normal(size=(8, 16)) * 0.3, jnp.float32)}}
    params["l2"] = {"w": jnp.asarray(rng.normal(size=(16, 1)) * 0.3, jnp.float32)}
    x, y = data(256)
    devices = jax.local_device_count()

    def replicate(tree: Any) -> Any:
        return jax.tree.map(lambda a: jnp.stack([a] * devices), tree)

    with NeuralDbg(params) as dbg:
        tx = dbg.wrap(optax.sgd(0.05))

        def step(p: Any, s: Any, xb: Any, yb: Any) -> Any:
            loss, g = jax.value_and_grad(lambda p: jnp.mean((jnp.tanh(xb @ p["l1"]["w"]) @ p["l2"]["w"] - yb) ** 2))(p)
            g, loss = jax.lax.pmean(g, "d"), jax.lax.pmean(loss, "d")
            u, s = tx.update(g, s, p, value=loss)
            return optax.apply_updates(p, u), s, g

        pstep = jax.pmap(step, axis_name="d")
        p, s = replicate(params), replicate(tx.init(params))
        gts = []
        for i in range(12):
            j = (i * 32) % len(x)
            xb, yb = (a[j : j + 32].reshape(devices, -1, a.shape[1]) for a in (x, y))
            p, s, g = pstep(p, s, xb, yb)
            gts.append(truth(jax.tree.map(lambda a: a[0], g)))
    assert dbg.step == 12
    for layer in ("l1", "l2"):
        np.testing.assert_allclose(history(dbg, layer), [t[layer] for t in gts], rtol=1e-5)


def test_a_transformation_is_watched_once_by_each_debugger() -> None:
    """Wrapping what a debugger wrapped already gives it back from that debugger; another
    debugger of the model (nested blocks) wraps it again and reads its own ring: both see every
    update, with the same norms."""
    model = MLP(1, 8, nnx.Rngs(0))
    x, y = data(64)
    with NeuralDbg(model) as outer, NeuralDbg(model) as inner:
        tx = outer.wrap(optax.sgd(0.01))
        assert outer.wrap(tx) is tx
        both = inner.wrap(tx)
        assert both is not tx and inner.wrap(both) is both
        optimizer = nnx.Optimizer(model, both, wrt=nnx.Param)
        step = make_step()
        for _ in range(5):
            step(model, optimizer, x[:32], y[:32])
    assert outer.step == inner.step == 5
    np.testing.assert_allclose(history(outer, "inp"), history(inner, "inp"), rtol=1e-6)


def test_a_block_that_wrapped_no_transformation_says_how_to() -> None:
    """The first-hour mistake: the optimizer given ``optax.adam`` itself, not ``dbg.wrap`` of it.
    Nothing can be observed; leaving the block says so and how (before: silence, no step)."""
    model = MLP(1, 4, nnx.Rngs(0))
    x, y = data(64)
    said = pytest.warns(neuraldbg.NeuralDbgWarning, match=r"no optax transformation was wrapped.*dbg\.wrap")
    with said, NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, optax.sgd(0.01), wrt=nnx.Param)
        make_step()(model, optimizer, x[:32], y[:32])
    assert dbg.step == 0


def test_bad_input_is_a_clear_error() -> None:
    with pytest.raises(ModelError, match="no floating-point parameter"):
        NeuralDbg({"step": jnp.zeros((), jnp.int32)})
    dbg = NeuralDbg(MLP(1, 4, nnx.Rngs(0)))
    with pytest.raises(ConfigError, match="GradientTransformation"):
        dbg.wrap("adam")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="learning_rate"):
        dbg.wrap(optax.sgd(0.1), learning_rate="high")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="buffer"):
        dbg.wrap(optax.sgd(0.1), buffer=0)
    with pytest.raises(ConfigError, match="unknown option"):
        NeuralDbg(MLP(1, 4, nnx.Rngs(0)), no_such_option=1)
    with pytest.raises(ConfigError, match="weight_every"):
        NeuralDbg(MLP(1, 4, nnx.Rngs(0)), weight_every=0)


_BLOCK = """
import sys
class Block:
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {blocked!r}:
            raise ImportError("blocked for the test: " + name)
sys.meta_path.insert(0, Block())
"""


def run_blocked(blocked: List[str], code: str) -> subprocess.CompletedProcess:
    src = _BLOCK.format(blocked=set(blocked)) + code
    env = dict(os.environ, KERAS_BACKEND="jax")
    return subprocess.run([sys.executable, "-c", src], capture_output=True, text=True, env=env, timeout=300)


def test_package_imports_without_torch_jax_or_keras() -> None:
    r = run_blocked(
        ["torch", "jax", "jaxlib", "flax", "optax", "keras"],
        "import neuraldbg, sys\nprint(neuraldbg.__version__, 'torch' in sys.modules)\n"
        "try:\n    import neuraldbg.jax\nexcept ImportError as e:\n    print('jax:', e)\n",
    )
    assert r.returncode == 0, r.stderr
    assert "False" in r.stdout
    assert "neuraldbg.jax needs jax and optax" in r.stdout


def test_keras_spoke_imports_without_torch() -> None:
    r = run_blocked(
        ["torch"], "import sys, neuraldbg.keras, keras\nprint(keras.backend.backend(), 'torch' in sys.modules)\n"
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["jax", "False"]


def test_jax_spoke_runs_without_torch() -> None:
    r = run_blocked(
        ["torch"],
        "import sys, jax.numpy as jnp, optax\nfrom neuraldbg.jax import NeuralDbg\n"
        "p = {'l1': {'kernel': jnp.ones((3, 2)), 'bias': jnp.zeros(2)}}\n"
        "with NeuralDbg(p) as dbg:\n    tx = dbg.wrap(optax.sgd(0.1)); s = tx.init(p)\n"
        "    for _ in range(3):\n        u, s = tx.update(p, s, p)\n"
        "print(dbg.step, 'torch' in sys.modules)\n",
    )
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["3", "False"]


def test_a_loss_cut_from_the_models_output_is_named() -> None:
    # stop_gradient on the model's output: jax.grad returns exact zeros for every parameter,
    # Adam moves nothing, and the loss never falls.
    def cut_mse(model: Any, x: Any, y: Any) -> Any:
        return jnp.mean((jax.lax.stop_gradient(model(x)) - y) ** 2)

    model = MLP(3, 32, nnx.Rngs(0))
    x, y = data()
    before = jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))
    before = [np.asarray(a).copy() for a in before]
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-3)), wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            loss, grads = nnx.value_and_grad(cut_mse)(model, xb, yb)
            optimizer.update(model, grads, value=loss)
            return loss, grads

        for i in range(40):
            j = (i * 32) % len(x)
            _, grads = step(model, optimizer, x[j : j + 32], y[j : j + 32])
            assert all(v == 0.0 for v in truth(grads).values()), "jax.grad gives exact zeros"
    after = [np.asarray(a) for a in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param))]
    assert all(np.array_equal(a, b) for a, b in zip(before, after)), "no weight moved"
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause) == ("stalled_layer", "parameters_not_updated"), top
    assert top.confidence >= 0.8, top
    assert "every gradient was exactly zero and no weight moved" in top.description
    assert "jax.grad" in top.remedies[0], top.remedies
    assert not any(h.cause == "poor_initialization" and h.confidence >= 0.5 for h in dbg.explain_failure())


class Classifier(nnx.Module):
    """A 4-class MLP whose output is what ``head`` makes of its logits (a mistake or none)."""

    def __init__(self, classes: int, head: Any, rngs: Any) -> None:
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, classes, rngs=rngs)
        self.head = head

    def __call__(self, x: Any) -> Any:
        return self.head(self.l2(nnx.relu(self.l1(x))))


def classify(
    head: Any,
    loss: Any,
    *,
    classes: int = 4,
    lr: float = 1e-2,
    steps: int = 200,
    shuffled: bool = False,
    flat: bool = False,
    inputs: bool = False,
) -> Any:
    """Trains a Classifier on separable classes (the argmax of a fixed linear map; ``shuffled``:
    the labels permuted away from their inputs; ``flat``: one output's labels of shape ``(N,)``;
    ``inputs``: the batch given as ``inputs=``), watched; the loss is an optax loss called by
    its module attribute, as tutorials write it."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    labels = np.argmax(x @ rng.normal(size=(8, max(classes, 2))), 1)[:, None] if classes == 1 else None
    y = labels.astype(np.float32) if labels is not None else np.argmax(x @ rng.normal(size=(8, classes)), 1)
    if shuffled:
        y = y[rng.permutation(len(y))]
    if flat:
        y = y[:, 0]
    model = Classifier(classes, head, nnx.Rngs(0))
    losses: List[float] = []
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(lr)), wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            value, grads = nnx.value_and_grad(lambda m: loss(m(xb), yb).mean())(model)
            optimizer.update(model, grads, value=value, **({"inputs": xb} if inputs else {}))
            return value

        for i in range(steps):
            j = (i * 64) % len(x)
            losses.append(float(step(model, optimizer, x[j : j + 64], y[j : j + 64])))
    return dbg, losses


def ce(logits: Any, labels: Any) -> Any:
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def bce(logits: Any, labels: Any) -> Any:
    return optax.sigmoid_binary_cross_entropy(logits, labels)


@pytest.mark.parametrize(
    "head, loss, classes, says",
    [
        (lambda z: nnx.softmax(z), ce, 4, "softmax_cross_entropy expects raw logits"),
        (lambda z: jax.nn.sigmoid(z), bce, 1, "sigmoid_binary_cross_entropy"),
    ],
    ids=["softmax into softmax_cross_entropy", "sigmoid into sigmoid_binary_cross_entropy"],
)
def test_an_output_activation_that_does_not_fit_the_optax_loss_is_named(
    head: Any, loss: Any, classes: int, says: str
) -> None:
    # Read while the step is traced: the loss the step calls and the activation that made the
    # output it was given. Ground truth: the same model without that activation, same data and
    # seed, reaches a loss several times lower (the loop's own numbers).
    dbg, losses = classify(head, loss, classes=classes)
    fixed, fixed_losses = classify(lambda z: z, loss, classes=classes)
    assert np.mean(losses[-20:]) > 3 * np.mean(fixed_losses[-20:]), (losses[-1], fixed_losses[-1])
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause) == ("loss_plateau", "output_loss_mismatch"), top
    assert top.confidence >= 0.5 and says in top.description, top
    assert not any("torch" in r or "Loss" in r for r in top.remedies), top.remedies  # in optax's words
    assert not [h for h in fixed.explain_failure() if h.confidence >= 0.5], fixed.explain_failure()


def test_labels_of_another_shape_broadcast_by_the_optax_loss_are_named() -> None:
    # One logit per sample, labels of shape (N,): optax.sigmoid_binary_cross_entropy broadcasts
    # them to (N, N) without a word (its own output's shape, below), so every logit is fitted
    # to every label; with labels of shape (N, 1) the same run's loss ends far lower.
    assert optax.sigmoid_binary_cross_entropy(jnp.zeros((64, 1)), jnp.zeros((64,))).shape == (64, 64)
    dbg, losses = classify(lambda z: z, bce, classes=1, flat=True)
    fixed, fixed_losses = classify(lambda z: z, bce, classes=1)
    assert np.mean(losses[-20:]) > 10 * np.mean(fixed_losses[-20:]), (losses[-1], fixed_losses[-1])
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause) == ("loss_plateau", "target_shape_mismatch"), top
    assert top.confidence >= 0.8 and "compared 4096 pairs from an output of 64 elements" in top.description, top
    assert top.remedies == [
        "make the output and the targets the same shape before the loss: loss(logits[:, 0], labels) or "
        "loss(logits, labels[:, None]) (optax broadcasts them without a word)"
    ], top.remedies
    assert not [h for h in fixed.explain_failure() if h.confidence >= 0.5], fixed.explain_failure()


def test_a_classifier_at_its_chance_level_is_judged_by_ln_c() -> None:
    # Labels permuted away from their inputs: the loop's own loss ends within 5% of the
    # cross-entropy of a uniform guess over 4 classes. The engine knows that level only from the
    # loss the step calls and its output's units.
    dbg, losses = classify(lambda z: z, ce, lr=1e-3, steps=120, shuffled=True)
    assert abs(np.mean(losses[-20:]) / np.log(4) - 1) < 0.05, losses[-20:]
    top = dbg.explain_failure()[0]
    assert top.failure == "loss_plateau", top
    assert "at its chance level (1.386 = ln 4 for 4 classes)" in top.description, top.description
    assert dbg._target_facts is None, "without inputs= the targets are not measured"


@pytest.mark.parametrize("shuffled", [False, True])
def test_labels_permuted_away_from_their_inputs_are_named_with_their_classes_entropy(shuffled: bool) -> None:
    # With the batch (`inputs=`) the update counts the first batch's classes: the loss of
    # predicting their frequencies is the level a model given unrelated labels sits at.
    dbg, losses = classify(lambda z: z, ce, lr=1e-3, steps=120, shuffled=shuffled, inputs=True)
    found = dbg.explain_failure()
    said = [h for h in found if "look unrelated to their inputs" in h.description]
    if not shuffled:
        assert np.mean(losses[-20:]) < 0.75 * np.log(4) and not said, (losses[-20:], found[:2])
        return
    rng = np.random.default_rng(0)  # (`classify`'s labels, the first batch of them)
    x = rng.normal(size=(512, 8))
    y = np.argmax(x @ rng.normal(size=(8, 4)), 1)[rng.permutation(512)][:64]
    p = np.bincount(y, minlength=4) / 64
    entropy = float(-(p[p > 0] * np.log(p[p > 0])).sum())
    assert said and found[0] is said[0], found[:2]
    assert found[0].cause == "bad_input_data" and found[0].confidence >= 0.5, found[0]
    said_entropy = float(found[0].description.split("it: ")[1].split(",")[0])
    assert said_entropy == pytest.approx(entropy, abs=1e-3), (said_entropy, entropy)


def test_the_loss_wrappers_change_nothing_and_are_gone_after_the_block_also_when_it_raises() -> None:
    originals = (jax.nn.softmax, nnx.relu, optax.softmax_cross_entropy_with_integer_labels, optax.losses.squared_error)
    z = jnp.asarray(np.random.default_rng(1).normal(size=(4, 3)), jnp.float32)
    model = Classifier(3, lambda v: v, nnx.Rngs(0))
    with pytest.raises(RuntimeError, match="the user's own"), NeuralDbg(model):
        assert jax.nn.softmax is not originals[0] and nnx.relu is not originals[1]
        assert np.array_equal(np.asarray(jax.nn.softmax(z)), np.asarray(originals[0](z)))
        labels = jnp.asarray([0, 2, 1, 1])
        assert np.array_equal(
            np.asarray(optax.softmax_cross_entropy_with_integer_labels(z, labels)),
            np.asarray(originals[2](z, labels)),
        )
        for fn in (jax.nn.softmax, optax.losses.squared_error):  # pickled by reference, as the originals
            assert pickle.loads(pickle.dumps(fn)) is fn
        raise RuntimeError("the user's own")
    assert (
        jax.nn.softmax,
        nnx.relu,
        optax.softmax_cross_entropy_with_integer_labels,
        optax.losses.squared_error,
    ) == originals


class Regressor(nnx.Module):
    def __init__(self, head: Any, rngs: Any) -> None:
        self.l1 = nnx.Linear(8, 32, rngs=rngs)
        self.l2 = nnx.Linear(32, 1, rngs=rngs)
        self.head = head

    def __call__(self, x: Any) -> Any:
        return self.head(self.l2(nnx.relu(self.l1(x))))


def regress(head: Any, loss: Any, targets: Any, steps: int = 200) -> Any:
    """Trains a Regressor on ``targets(x)`` with an optax loss, the targets passed to the
    loss function as an argument of the differentiated function (as the flax tutorials do) and
    the batch as ``inputs=`` (which has its targets measured too). ``head`` and ``loss`` call jax.nn and optax by their module attributes (a reference taken
    before the block is not seen)."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = targets(x).astype(np.float32)
    model = Regressor(head, nnx.Rngs(0))

    def loss_fn(m: Any, xb: Any, yb: Any) -> Any:
        return loss(m(xb), yb).mean()

    losses: List[float] = []
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-2)), wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            value, grads = nnx.value_and_grad(loss_fn)(model, xb, yb)
            optimizer.update(model, grads, value=value, inputs=xb)  # (the batch: its targets too)
            return value

        for i in range(steps):
            j = (i * 64) % len(x)
            losses.append(float(step(model, optimizer, x[j : j + 64], y[j : j + 64])))
    return dbg, losses, y


def test_a_sigmoid_output_regressing_targets_beyond_one_is_named_from_the_targets_measured() -> None:
    # Targets around 3: a sigmoid output cannot pass 1, so the loop's own loss cannot go below
    # the mean of (y - 1)^2 over targets above 1 (computed from the data); a linear output
    # reaches far lower. The engine learns the targets' range from the first update's row.
    def targets(x: Any) -> Any:
        return 3 + x[:, :1] + 0.5 * x[:, 1:2]

    def sigmoid(z: Any) -> Any:
        return jax.nn.sigmoid(z)

    def squared_error(out: Any, t: Any) -> Any:
        return optax.squared_error(out, t)

    dbg, losses, y = regress(sigmoid, squared_error, targets)
    floors = [float(np.mean(np.clip(y[j : j + 64] - 1, 0, None) ** 2)) for j in (np.arange(200) * 64) % 512]
    assert all(v >= 0.99 * f for v, f in zip(losses, floors)), "a sigmoid output cannot pass 1"
    _, linear, _ = regress(lambda z: z, squared_error, targets)
    assert np.mean(linear[-8:]) < 0.1 * np.mean(floors)
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause) == ("loss_plateau", "output_loss_mismatch"), top
    lo, hi = float(y[:64].min()), float(y[:64].max())
    assert f"the regression targets span [{lo:.3g}, {hi:.4g}]" in top.description, (top.description, lo, hi)


def test_binary_cross_entropy_targets_of_0_and_255_are_named_from_the_first_step() -> None:
    # A 0/255 mask as sigmoid_binary_cross_entropy's labels: the loop's own loss goes below 0,
    # which no binary cross-entropy of targets in [0, 1] can.
    dbg, losses, _ = regress(lambda z: z, bce, lambda x: 255.0 * (x[:, :1] > 0))
    assert min(losses) < 0, min(losses)
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause, top.step) == ("data_anomaly", "bad_input_data", 0), top
    assert "targets span [0, 255]" in top.description, top.description


def test_targets_traced_inside_a_vmap_of_the_loss_leave_the_update_observed() -> None:
    # A per-example loss under vmap: its targets are the vmap's, which the update (outside it)
    # cannot measure. The steps are observed all the same, and the run trains as unwatched.
    def per_example(out: Any, t: Any) -> Any:
        return jax.vmap(lambda o, u: optax.squared_error(o, u).mean())(out, t)

    dbg, losses, _ = regress(lambda z: z, per_example, lambda x: x[:, :1])
    assert dbg.step == 200 and losses[-1] < 0.1 * losses[0]
    assert dbg._target_facts is None and dbg._loss is not None


class Dropped(nnx.Module):
    def __init__(self, rate: float, rngs: Any) -> None:
        self.l1 = nnx.Linear(8, 64, rngs=rngs)
        self.d1 = nnx.Dropout(rate, rngs=rngs)
        self.l2 = nnx.Linear(64, 64, rngs=rngs)
        self.d2 = nnx.Dropout(rate, rngs=rngs)
        self.l3 = nnx.Linear(64, 5, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        return self.l3(self.d2(nnx.relu(self.l2(self.d1(nnx.relu(self.l1(x)))))))


@pytest.mark.parametrize("rate", [0.9, 0.1])
def test_nnx_dropout_that_zeroes_most_units_is_why_the_loss_stays_up(rate: float) -> None:
    # nnx.Dropout(0.9), a keep probability given as the rate: the loop's own loss stays near
    # ln 5 = 1.61; with 0.1 the same network learns. The engine reads each Dropout's rate from
    # the model (one set deterministic would drop nothing and is left out).
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(8, 5)), 1)
    model = Dropped(rate, nnx.Rngs(0))
    losses: List[float] = []
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(5e-3)), wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(xb), yb).mean()  # noqa: E731
            value, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads, value=value)
            return value

        for i in range(64):
            j = (i * 64) % len(x)
            losses.append(float(step(model, optimizer, x[j : j + 64], y[j : j + 64])))
    found = dbg.explain_failure()
    if rate == 0.1:
        assert np.mean(losses[-16:]) < 0.5, "the same network with dropout 0.1 learns"
        assert not any(h.confidence >= 0.5 or "dropout" in h.description for h in found), found
        return
    assert np.mean(losses[-16:]) > 1.2, "with dropout 0.9 the loss stays near ln 5"
    top = found[0]
    assert top.confidence >= 0.5 and top.cause == "over_regularization", top
    assert "dropout zeroes 90% of the units at every training step (`d1`, `d2`)" in top.description, top
    assert top.remedies[0].startswith("lower nnx.Dropout's rate"), top.remedies


def test_a_dropout_set_deterministic_is_not_in_the_spec() -> None:
    model = Dropped(0.9, nnx.Rngs(0))
    spec = NeuralDbg(model)._model.spec(None)
    assert [(m["name"], m["attrs"]) for m in spec["modules"] if m["kind"] == "Dropout"] == [
        ("d1", [["p", 0.9]]),
        ("d2", [["p", 0.9]]),
    ]
    assert [m["name"] for m in spec["modules"]][:4] == ["l1", "d1", "l2", "d2"], "in definition order"
    model.eval()  # deterministic: drops nothing
    assert not [m for m in NeuralDbg(model)._model.spec(None)["modules"] if m["kind"] == "Dropout"]


def test_the_step_size_is_measured_without_being_told_the_learning_rate() -> None:
    # optax.adam(1e-6), its rate given nowhere (no learning_rate=, no inject_hyperparams): the
    # update's size is read from strided samples of the weights in consecutive rows of the
    # first steps. The truth is how far each jitted step moved the kernels, read from the
    # model's own parameters around it.
    model = MLP(3, 32, nnx.Rngs(0))
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-6)), wrt=nnx.Param)
        moved = kernels_moved(model, optimizer, first=9)
    top = dbg.explain_failure()[0]
    assert (str(top.failure), str(top.cause)) == ("loss_plateau", "learning_rate_too_low"), top
    said = re.search(r"each step moves the weights by ~([0-9.e+-]+) of their size \(measured\)", top.description)
    assert said is not None, top.description
    truth = float(np.median(moved))
    assert truth / 2 < float(said[1]) < truth * 2, (said[1], truth)


def test_an_evaluation_step_traced_first_leaves_the_loss_to_the_training_step() -> None:
    # The loss noted by an evaluation step traced before training (another batch size, no
    # update) agrees with the training step's on everything but the shapes: the training step's
    # own call, the last before its update, is the one taken.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 8)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(8, 4)), 1)
    model = Classifier(4, lambda z: nnx.softmax(z), nnx.Rngs(0))
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-2)), wrt=nnx.Param)

        @nnx.jit
        def evaluate(model: Any, xb: Any, yb: Any) -> Any:
            return ce(model(xb), yb).mean()

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            value, grads = nnx.value_and_grad(lambda m: ce(m(xb), yb).mean())(model)
            optimizer.update(model, grads, value=value)
            return value

        evaluate(model, x[:128], y[:128])
        for i in range(200):
            j = (i * 64) % len(x)
            step(model, optimizer, x[j : j + 64], y[j : j + 64])
    assert dbg._loss is not None and dbg._loss["output_numel"] == 64 * 4, dbg._loss
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause) == ("loss_plateau", "output_loss_mismatch"), top


class DeepNormed(nnx.Module):
    """13 BatchNorm + ReLU blocks (the PyTorch scenario `deep_bn_mlp_trained_in_eval_mode`)."""

    def __init__(self, rngs: Any) -> None:
        self.inp = nnx.Linear(16, 32, rngs=rngs)
        self.blocks = nnx.List(
            [nnx.List([nnx.BatchNorm(32, rngs=rngs), nnx.Linear(32, 32, rngs=rngs)]) for _ in range(12)]
        )
        self.norm = nnx.BatchNorm(32, rngs=rngs)
        self.out = nnx.Linear(32, 4, rngs=rngs)

    def __call__(self, x: Any) -> Any:
        x = self.inp(x)
        for norm, linear in self.blocks:
            x = linear(nnx.relu(norm(x)))
        return self.out(nnx.relu(self.norm(x)))


@pytest.mark.parametrize("evaluating", [True, False])
def test_a_model_trained_after_model_eval_is_named(evaluating: bool) -> None:
    # model.eval() left over before training: every BatchNorm normalizes with its initial
    # running statistics, the step is compiled in that mode (read from the modules while it is
    # traced), and the loop's own loss stays at ln 4 while the same model in training mode
    # learns; jax.grad's gradient of the first layer is ~100x smaller in eval mode.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(512, 16)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(16, 4)), 1)
    model = DeepNormed(nnx.Rngs(0))
    if evaluating:
        model.eval()
    losses: List[float] = []
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.sgd(0.05), learning_rate=0.05), wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            value, grads = nnx.value_and_grad(lambda m: ce(m(xb), yb).mean())(model)
            optimizer.update(model, grads, value=value)
            return value, grads

        for i in range(60):
            j = (i * 64) % len(x)
            value, grads = step(model, optimizer, x[j : j + 64], y[j : j + 64])
            losses.append(float(value))
    first = truth(grads)["inp"]
    found = dbg.explain_failure()
    if not evaluating:
        assert np.mean(losses[-10:]) < 1.1 and first > 0.1, (losses[-10:], first)
        assert not any(h.cause == "eval_mode" for h in found), found
        return
    assert abs(np.mean(losses[-10:]) / np.log(4) - 1) < 0.03 and first < 0.02, (losses[-10:], first)
    top = found[0]
    assert top.cause == "eval_mode" and top.confidence >= 0.5, top
    assert "in eval() mode on 100% of the training steps" in top.description, top.description
    assert top.remedies[1].startswith("end every evaluation with model.train()"), top.remedies


def test_once_the_loss_is_taken_an_eager_loop_is_noted_no_more() -> None:
    # An eager loop (no jit) calls the loss and its activations at every step: once the update
    # has taken the loss, nothing more is noted and no array of the loop is kept.
    from neuraldbg import _jax_loss

    rng = np.random.default_rng(0)
    x = rng.normal(size=(64, 8)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(8, 4)), 1)
    model = Classifier(4, lambda z: z, nnx.Rngs(0))
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-2)), wrt=nnx.Param)
        for _ in range(3):
            value, grads = nnx.value_and_grad(lambda m: ce(m(x), y).mean())(model)
            optimizer.update(model, grads, value=value)
            assert dbg._loss is not None
            assert not _jax_loss.NOTES.losses and not _jax_loss.NOTES.outputs
        assert _jax_loss.NOTES.wanting == 0
    assert _jax_loss.NOTES.watchers == 0


@pytest.mark.parametrize(("units", "classes"), [(1, 2), (5, 10), (10, 10)])
def test_class_indices_with_no_output_unit_are_the_outputs_not_the_initialization(units: int, classes: int) -> None:
    """``optax.softmax_cross_entropy_with_integer_labels`` on ``units`` logits for labels
    0..``classes``-1: a label with no unit takes no logit, and optax fills its loss with NaN
    from the first step (checked here on the first batch). Before: ``non_finite <-
    poor_initialization`` at 0.42 (a binary target on one unit). The one-unit output, and class
    indices beyond the output's units (read from the targets given with ``inputs=``), are
    named with the fix; with a unit per class: no finding."""
    rng = np.random.default_rng(0)
    x = rng.normal(size=(1024, 16)).astype(np.float32)
    y = np.argmax(x @ rng.normal(size=(16, classes)), 1)
    model = nnx.Sequential(nnx.Linear(16, 32, rngs=nnx.Rngs(0)), nnx.relu, nnx.Linear(32, units, rngs=nnx.Rngs(1)))
    first = optax.softmax_cross_entropy_with_integer_labels(model(x[:64]), y[:64])
    assert bool(jnp.isnan(first).any()) == (classes > units)
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-3)), wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            loss_fn = lambda m: optax.softmax_cross_entropy_with_integer_labels(m(xb), yb).mean()  # noqa: E731
            value, grads = nnx.value_and_grad(loss_fn)(model)
            optimizer.update(model, grads, value=value, inputs=xb)
            return value

        for i in range(32):
            j = (i * 64) % len(x)
            step(model, optimizer, x[j : j + 64], y[j : j + 64])
    found = dbg.explain_failure()
    if classes == units:
        assert not any(h.confidence >= 0.5 for h in found), found
        return
    top = found[0]
    assert (top.failure, top.cause) == ("non_finite", "output_loss_mismatch"), found
    assert top.confidence >= 0.5, top
    if units == 1:
        assert "a cross-entropy over classes taken of 1 output unit" in top.description, top
        assert "optax.sigmoid_binary_cross_entropy" in top.remedies[0], top.remedies
    else:
        assert "the targets' class indices reach 9 but the output has 5 units" in top.description, top
        assert top.remedies[0].startswith("give the output one unit per class (10 for class indices up to 9)")


def test_the_class_counts_give_the_frequencies_entropy_and_its_standard_error() -> None:
    # [0, 0, 0, 1, 2] counted over 4 classes (5 is outside them): frequencies [3/5, 1/5, 1/5,
    # 0]; the entropy's standard error as an estimate from 5 targets is the spread of -ln p
    # over them, over sqrt(5) (numpy here, the compiled step's jnp there).
    from neuraldbg.jax import _class_stats

    lo, hi, entropy, se = (float(v) for v in _class_stats(jnp.asarray([0, 0, 0, 1, 2, 5]), 4))
    p = np.array([0.6, 0.2, 0.2])
    h = float(-(p * np.log(p)).sum())
    assert (lo, hi) == (0.0, 5.0)
    assert entropy == pytest.approx(h, rel=1e-5)
    assert se == pytest.approx(np.sqrt(((p * np.log(p) ** 2).sum() - h * h) / 5), rel=1e-4)


def test_a_binary_cross_entropy_s_frequency_comes_from_its_targets_mean_and_spread() -> None:
    # Targets all 0 or 1 have the largest variance values in [0, 1] can have at their mean,
    # mean * (1 - mean): the entropy of how often one is 1 and its standard error follow from
    # the two (numpy's own, on the targets). Smoothed labels (0.05 / 0.95) have less: none.
    from neuraldbg.jax import _batch_stats, _binary_frequency

    y = (np.random.default_rng(0).random(256) < 0.25).astype(np.float32)
    facts = _binary_frequency(*(float(v) for v in _batch_stats(jnp.asarray(y))), 256)
    p = np.array([y.mean(), 1 - y.mean()])
    h = float(-(p * np.log(p)).sum())
    assert facts["class_entropy"] == pytest.approx(h, rel=1e-4)
    assert facts["class_entropy_se"] == pytest.approx(np.sqrt(((p * np.log(p) ** 2).sum() - h * h) / 256), rel=1e-3)
    assert _binary_frequency(*(float(v) for v in _batch_stats(jnp.asarray(0.05 + 0.9 * y))), 256) == {}


def test_a_binary_classifier_that_learns_only_how_often_a_label_is_1_is_at_chance() -> None:
    # A quarter of the labels are 1, drawn apart from the inputs: the loop's own loss settles
    # within 5% of the entropy of that frequency (numpy's, on the labels), far below ln 2.
    # Given the batch (`inputs=`), the update measures the first batch's targets, and the
    # plateau is at that chance level.
    rng = np.random.default_rng(0)
    x = rng.normal(size=(400 * 256, 8)).astype(np.float32)  # (a new batch each step)
    y = (rng.random((400 * 256, 1)) < 0.25).astype(np.float32)
    p = float(y.mean())
    entropy = -(p * np.log(p) + (1 - p) * np.log(1 - p))
    model = Classifier(1, lambda z: z, nnx.Rngs(0))
    losses: List[float] = []
    with NeuralDbg(model) as dbg:
        optimizer = nnx.Optimizer(model, dbg.wrap(optax.adam(1e-3)), wrt=nnx.Param)

        @nnx.jit
        def step(model: Any, optimizer: Any, xb: Any, yb: Any) -> Any:
            value, grads = nnx.value_and_grad(lambda m: bce(m(xb), yb).mean())(model)
            optimizer.update(model, grads, value=value, inputs=xb)
            return value

        for i in range(400):
            j = i * 256
            losses.append(float(step(model, optimizer, x[j : j + 256], y[j : j + 256])))
    assert abs(np.mean(losses[-20:]) / entropy - 1) < 0.05, (losses[-20:], entropy)
    top = dbg.explain_failure()[0]
    assert top.failure == "loss_plateau", top
    assert "the model learned how often a target is 1 and nothing of its input" in top.description, top
