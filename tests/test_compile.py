"""torch.compile: a watched compiled model compiles to the same graphs as the unwatched one (no
graph breaks, no recompiles, checked on torch._dynamo's own counters), every step is observed
and the module where a NaN first appears is named.

The dynamo-level behaviour (tracing, guards, graph breaks) does not depend on the backend:
``aot_eager`` runs AOTAutograd like inductor (forward and backward graphs) without the C++
compile, so the tests stay fast; one test uses inductor itself."""

from __future__ import annotations

import copy
import inspect
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from neuraldbg import NeuralDbg
from neuraldbg.errors import NeuralDbgWarning

dynamo = pytest.importorskip("torch._dynamo")
from torch._dynamo.utils import counters  # noqa: E402


class LogShift(nn.Module):
    """``log(x + 1 + shift)``: finite while ``shift`` is 0; set ``shift`` to -100 (a buffer,
    changed in place, so no recompile) and it produces NaN in its own computation."""

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("shift", torch.zeros(()))

    def forward(self, x):
        return torch.log(x.abs() + 1.0 + self.shift)


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(8, 16)
        self.block = nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
        self.bad = LogShift()
        self.head = nn.Linear(16, 3)

    def forward(self, x):
        return self.head(self.bad(self.block(self.embed(x))).mean(dim=1))


def data(n: int):
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(4, 5, 8, generator=g), torch.randint(0, 3, (4,), generator=g)) for _ in range(n)]


def train(model, compiled, steps, dbg=None, nan_at=None):
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for i, (x, y) in enumerate(data(steps)):
        if i == nan_at:
            model.bad.shift.fill_(-100.0)
        opt.zero_grad()
        loss = nn.functional.cross_entropy(compiled(x), y)
        loss.backward()
        opt.step()
        if dbg is not None:
            assert dbg.step == i + 1


def dynamo_stats():
    return (
        dict(counters["stats"]),
        sum(counters["graph_break"].values()),
        dict(counters["recompiles"]) if "recompiles" in counters else {},
        dict(counters["aot_autograd"]),  # graphs handed to the backend
    )


def compiled_run(watch: bool, how: str, steps: int = 6, enter_after_first_call: bool = False):
    dynamo.reset()
    counters.clear()
    model = Tiny()
    if how == "method":
        model.compile(backend="aot_eager")
        compiled = model
    else:
        compiled = torch.compile(model, backend="aot_eager")
    if not watch:
        train(model, compiled, steps)
        return dynamo_stats(), None
    if enter_after_first_call:
        train(model, compiled, 1)
    with NeuralDbg(model) as dbg:
        train(model, compiled, steps - (1 if enter_after_first_call else 0), dbg)
    return dynamo_stats(), dbg


@pytest.mark.parametrize("how", ["function", "method"])
def test_watching_adds_no_graph_break_and_no_recompile(how):
    plain, _ = compiled_run(False, how)
    watched, dbg = compiled_run(True, how)
    assert plain[1] == 0
    assert watched == plain, f"unwatched {plain} vs watched {watched}"
    assert dbg.step == 6
    steps, values = dbg.history("embed")
    assert list(steps) == list(range(6)) and (values > 0).all()
    _, losses = dbg.history(None, "loss")
    assert len(losses) == 6
    _, scale = dbg.history(None, "input_scale")
    assert len(scale) == 6, "inputs of the compiled forward are measured"


def test_nan_origin_is_named_under_compile():
    dynamo.reset()
    model = Tiny()
    compiled = torch.compile(model, backend="aot_eager")
    with NeuralDbg(model) as dbg:
        train(model, compiled, 6, dbg, nan_at=3)
    hyps = [h for h in dbg.explain_failure() if h.failure == "non_finite"]
    assert hyps, dbg.explain_failure()
    assert hyps[0].layer == "bad" and hyps[0].step == 3


def test_inductor_compiled_model_is_observed():
    dynamo.reset()
    counters.clear()  # (graph breaks of earlier tests)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    compiled = torch.compile(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    g = torch.Generator().manual_seed(0)
    with NeuralDbg(model) as dbg:
        for _ in range(3):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)
            opt.zero_grad()
            nn.functional.cross_entropy(compiled(x), y).backward()
            opt.step()
    assert dbg.step == 3
    assert sum(counters["graph_break"].values()) == 0
    # Every step's gradients and input were seen through the compiled forward.
    steps, norms = dbg.history("0", "grad_norm")
    assert list(steps) == [0, 1, 2] and np.all(np.isfinite(norms)) and np.all(norms > 0)
    assert len(dbg.history(None, "input_scale")[1]) == 3


def test_entering_after_the_first_compiled_call_costs_one_recompile_and_sees_everything():
    plain, _ = compiled_run(False, "function", steps=4)
    late, dbg = compiled_run(True, "function", steps=4, enter_after_first_call=True)
    assert dbg.step == 3
    steps, _ = dbg.history("embed")
    assert list(steps) == [0, 1, 2]
    _, scale = dbg.history(None, "input_scale")
    assert len(scale) == 3 and np.isfinite(scale).all(), "the hooks were traced in after entering"
    assert late[1] == 0, "no graph break"
    assert late[3]["total"] <= plain[3]["total"] + 1, (plain, late)


class Mean(nn.Module):
    def forward(self, x):
        return x.mean(dim=1)


def watched_steps(model, compiled, steps):
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)
        with NeuralDbg(model) as dbg:
            train(model, compiled, steps, dbg)
    _, scale = dbg.history(None, "input_scale")
    return scale


def test_models_watched_one_after_another_share_one_graph_and_stay_compiled():
    """A sweep, or a notebook cell run again: each watched model of a class compiles nothing
    new. (Our traced hooks once held bound methods, which dynamo guards by identity: each
    watched model compiled its own graph, and past ``recompile_limit`` of them every compiled
    module of the process ran eagerly.)"""
    dynamo.reset()
    counters.clear()
    for _ in range(dynamo.config.recompile_limit + 2):
        model = Tiny()
        scale = watched_steps(model, torch.compile(model, backend="aot_eager"), 2)
        assert len(scale) == 2 and np.isfinite(scale).all(), "every watched model's inputs are seen"
    assert counters["stats"]["unique_graphs"] == 1
    plain = Tiny()
    train(plain, torch.compile(plain, backend="aot_eager"), 1)
    assert counters["stats"]["unique_graphs"] == 2, "an unwatched model compiles its own graph, without our hooks"


def test_a_model_whose_class_was_compiled_before_it_is_watched_is_traced_again():
    """Dynamo does not guard module hooks: a graph compiled for an unwatched model (this one, or
    another of its class) ran on without them, and the watched run saw no input, activation or
    NaN origin. One more graph while watched; none after."""

    def mlp():  # (Tiny's attention layer reads its hooks, which guards them)
        torch.manual_seed(0)
        return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 3), Mean())

    dynamo.reset()
    counters.clear()
    first = mlp()
    first_compiled = torch.compile(first, backend="aot_eager")
    train(first, first_compiled, 2)
    for how in ("new model", "same model"):
        model = mlp() if how == "new model" else first
        compiled = torch.compile(model, backend="aot_eager") if how == "new model" else first_compiled
        with NeuralDbg(model) as dbg:
            assert inspect.signature(model.forward) == inspect.signature(mlp().forward)
            assert "forward" not in copy.deepcopy(model).__dict__, "copies carry nothing of ours"
            train(model, compiled, 3, dbg)
        _, scale = dbg.history(None, "input_scale")
        assert len(scale) == 3 and np.isfinite(scale).all(), how
        assert "forward" not in model.__dict__
    graphs = counters["stats"]["unique_graphs"]
    assert graphs == 2, "one graph unwatched, one watched"
    train(first, first_compiled, 1)
    train(model, compiled, 1)
    assert counters["stats"]["unique_graphs"] == graphs, "unwatched again, the first graph runs"


def test_the_compiled_module_itself_can_be_watched():
    dynamo.reset()
    model = Tiny()
    compiled = torch.compile(model, backend="aot_eager")
    with NeuralDbg(compiled) as dbg:
        train(model, compiled, 3, dbg)
    steps, _ = dbg.history("embed")  # names are the model's own, not "_orig_mod.embed"
    assert list(steps) == [0, 1, 2]


def test_a_criterion_inside_a_compiled_train_step_adds_no_graph_break():
    """The loss module given as ``criterion`` and called inside the compiled function: its hook
    is traced too (it read the collector's state there: 3 graph breaks and 4 graphs where the
    unwatched step has 1), and every step's loss is the step's own."""

    def run(watch: bool):
        dynamo.reset()
        counters.clear()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        criterion = nn.CrossEntropyLoss()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        @torch.compile(backend="aot_eager")
        def loss_of(x, y):
            return criterion(model(x), y)

        losses, dbg = [], None

        def loop():
            for x, y in data(5):
                opt.zero_grad()
                loss = loss_of(x.flatten(1)[:, :8], y)
                loss.backward()
                opt.step()
                losses.append(float(loss))

        if watch:
            with NeuralDbg(model, criterion=criterion) as dbg:
                loop()
        else:
            loop()
        return dynamo_stats(), losses, dbg

    plain, plain_losses, _ = run(False)
    watched, losses, dbg = run(True)
    # (The hook's detach is one more captured call, inside the same graph.)
    assert watched[1] == 0 and watched[0]["unique_graphs"] == plain[0]["unique_graphs"] == 1, (plain, watched)
    assert watched[3] == plain[3], "the same graphs handed to the backend"
    assert losses == pytest.approx(plain_losses)
    _, seen = dbg.history(None, "loss")
    assert list(seen) == pytest.approx(losses, rel=1e-6)
