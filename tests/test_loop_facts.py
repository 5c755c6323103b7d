"""The loop facts the collector hands the engine (python/neuraldbg/_loop.py): training mode,
gradients accumulated across steps, the optimizer's param groups, and what the loss did with
the model's output. Checked against what the loop did, step by step."""

from __future__ import annotations

import math
import warnings
from typing import Any, Dict, List

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from neuraldbg import NeuralDbg


class Spy:
    """Passes every call through to the engine, keeping the facts of each observed step."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.facts: List[Dict[str, float]] = []
        self.measures: List[Dict[str, Any]] = []
        self.specs: List[dict] = []

    def observe(self, *args: Any, **kwargs: Any) -> Any:
        self.facts.append(dict(kwargs.get("facts") or {}))
        self.measures.append(dict(kwargs.get("measures") or {}))
        return self.engine.observe(*args, **kwargs)

    def register_model(self, spec: str) -> Any:
        import json

        self.specs.append(json.loads(spec))
        return self.engine.register_model(spec)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)


class watch:
    """``with watch(model) as spy:`` a NeuralDbg whose engine calls are spied on."""

    def __init__(self, model: nn.Module) -> None:
        self.dbg = NeuralDbg(model)

    def __enter__(self) -> Spy:
        self.dbg.__enter__()
        from neuraldbg.testing import spy_engine

        spy = Spy(self.dbg._engine)
        spy_engine(self.dbg, spy)
        return spy

    def __exit__(self, *exc: Any) -> Any:
        return self.dbg.__exit__(*exc)


def data(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)


@pytest.mark.parametrize("zeroing", ["none", "set_to_none", "zero_", "model"])
def test_grad_accumulated_says_whether_grads_were_zeroed(zeroing):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model) as spy:
        for step in range(5):
            if zeroing == "set_to_none":
                opt.zero_grad(set_to_none=True)
            elif zeroing == "zero_":
                opt.zero_grad(set_to_none=False)
            elif zeroing == "model":
                model.zero_grad()
            x, y = data(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
    # The first step has nothing before it; from the second on, the fact is known.
    got = [f.get("grad_accumulated") for f in spy.facts]
    assert got[0] is None
    assert got[1:] == [1.0 if zeroing == "none" else 0.0] * 4


def _by_layers(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in model:
        x = layer(x)
    return x


@pytest.mark.parametrize("call", [nn.Sequential.__call__, _by_layers], ids=["model", "its_layers"])
@pytest.mark.parametrize("zeroing", ["none", "model", "zero_"])
def test_grad_accumulated_in_a_loop_that_updates_the_weights_by_hand(zeroing, call):
    # The loop is found updating by hand at its second iteration; the gradient its first
    # update used is read after the loop went on (possibly zeroed), so the fact is known from
    # the third step on. A loop that never zeroes is a missing zero_grad, as with an optimizer.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    with watch(model) as spy:
        for step in range(6):
            x, y = data(step)
            F.mse_loss(call(model, x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.01 * p.grad
            if zeroing == "model":
                model.zero_grad()
            elif zeroing == "zero_":
                for p in model.parameters():
                    p.grad.zero_()
    got = [f.get("grad_accumulated") for f in spy.facts]
    assert got == [None, None] + [1.0 if zeroing == "none" else 0.0] * 4


@pytest.mark.parametrize("zeroing", ["none", "set_to_none"])
def test_grad_accumulated_is_read_on_a_trained_parameter_when_the_optimizer_also_holds_frozen_ones(zeroing):
    # As in LoRA or a frozen backbone: every parameter goes to the optimizer, the first layer's
    # need no gradient (they never get one, so they cannot show accumulation).
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    model[0].requires_grad_(False)
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    with watch(model) as spy:
        for step in range(5):
            if zeroing == "set_to_none":
                opt.zero_grad(set_to_none=True)
            x, y = data(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert model[0].weight.grad is None
    assert [f.get("grad_accumulated") for f in spy.facts][1:] == [1.0 if zeroing == "none" else 0.0] * 4


@pytest.mark.parametrize("set_to_none", [True, False])
def test_gradients_cleared_between_backward_and_step_reach_the_engine_as_none_received(set_to_none):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model) as spy:
        for step in range(4):
            x, y = data(step)
            F.mse_loss(model(x), y).backward()
            opt.zero_grad(set_to_none=set_to_none)  # the mistake: the step finds nothing
            opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "no step changed a weight"
    # (The parameter read again at the step is chosen once the first step is seen.)
    assert [f.get("clip_ratio") for f in spy.facts][1:] == [0.0] * 3


def test_the_same_loop_in_order_reports_the_gradient_received_whole():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with watch(model) as spy:
        for step in range(4):
            opt.zero_grad()
            x, y = data(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert [f.get("clip_ratio") for f in spy.facts][1:] == [1.0] * 3


@pytest.mark.parametrize("order", ["zero_grad late", "step first"])
def test_zero_grad_between_backward_and_step_is_named_with_its_fix(order):
    """The classic misplaced ``zero_grad()``, and ``step()`` before ``backward()`` (the same
    sequence of calls, seen from the optimizer): the loss sits at its chance level because no
    step changes a weight, and the measured step size (0) must not be read as a learning rate."""
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 20, generator=g)
    y = (x @ torch.randn(20, 5, generator=g)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NeuralDbg(model) as dbg:
        for _ in range(5):
            for i in range(0, 1024, 64):
                if order == "step first":
                    opt.zero_grad()
                    opt.step()
                    F.cross_entropy(model(x[i : i + 64]), y[i : i + 64]).backward()
                else:
                    F.cross_entropy(model(x[i : i + 64]), y[i : i + 64]).backward()
                    opt.zero_grad()
                    opt.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
    top = dbg.explain_failure()[0]
    assert top.confidence >= 0.5 and top.cause == "parameters_not_updated", top
    assert "cleared after backward() and before step()" in " ".join(top.description.split())
    assert any("never step() before backward()" in r for r in top.remedies), top.remedies
    assert not any(h.cause == "learning_rate_too_low" and h.confidence >= 0.5 for h in dbg.explain_failure())


def test_accumulation_over_micro_batches_within_a_step_is_not_a_missing_zero_grad():
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model) as spy:
        for step in range(4):
            opt.zero_grad()
            for micro in range(3):
                x, y = data(10 * step + micro)
                (F.mse_loss(model(x), y) / 3).backward()
            opt.step()
    assert [f.get("grad_accumulated") for f in spy.facts][1:] == [0.0] * 3


def test_training_mode_of_the_forward_passes_that_train():
    model = nn.Sequential(nn.Linear(4, 8), nn.Dropout(0.1), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with watch(model) as spy:
        for step in range(4):
            model.train(step >= 2)
            with torch.no_grad():  # an evaluation pass in eval mode does not count
                model.eval()
                model(data(99)[0])
                model.train(step >= 2)
            opt.zero_grad()
            x, y = data(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert [f["training"] for f in spy.facts] == [0.0, 0.0, 1.0, 1.0]


def test_param_lr_names_the_group_lr_or_no_optimizer():
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.Adam([{"params": model[2].parameters(), "lr": 0.0}], lr=1e-3)
    with watch(model) as spy:
        for step in range(2):
            opt.zero_grad()
            x, y = data(step)
            F.mse_loss(model(x), y).backward()
            opt.step()
    assert spy.specs[0]["param_lr"] == [None, None, 0.0, 0.0]


def first_loss(model: nn.Module, loss_fn, x, y) -> dict:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # PyTorch's own broadcasting warning
        with watch(model) as spy:
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
    return spy.specs[0]["loss"]


def test_loss_facts_cross_entropy_after_softmax():
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
    d = first_loss(model, nn.CrossEntropyLoss(), torch.randn(8, 4), torch.randint(0, 3, (8,)))
    assert d["ops"] == ["NllLoss", "LogSoftmax"] and d["output_op"] == "Softmax"
    assert d["output_units"] == 3 and d["output_numel"] == 24
    lo, hi = d["output_range"]
    assert 0.0 <= lo <= hi <= 1.0


@pytest.mark.parametrize("targets", ["one class", "mixed"])
def test_loss_facts_class_range_of_index_targets(targets):
    y = torch.full((16,), 2) if targets == "one class" else torch.tensor([0, 4, 1, 3] * 4)
    model = nn.Linear(4, 5)
    d = first_loss(model, nn.CrossEntropyLoss(), torch.randn(16, 4), y)
    assert d["class_range"] == ([2.0, 2.0] if targets == "one class" else [0.0, 4.0])
    assert "target_range" not in d, "class indices are no regression target"
    d = first_loss(nn.Linear(4, 1), nn.MSELoss(), torch.randn(16, 4), torch.randn(16, 1))
    assert "class_range" not in d


def test_loss_facts_broadcasting_mse_and_target_range():
    model = nn.Linear(4, 1)
    y = torch.linspace(5.0, 9.0, 8)  # (8,) against an (8, 1) output
    d = first_loss(model, nn.MSELoss(), torch.randn(8, 4), y)
    assert d["ops"][0] == "MseLoss" and "Expand" in d["ops"]
    assert d["output_numel"] == 8 and d["compared_numel"] == 64
    assert d["target_range"] == pytest.approx([5.0, 9.0])


def _raise(*args, **kwargs):
    raise RuntimeError("not on this device")


@pytest.mark.parametrize("broken", ["aminmax", "penalties", "batch softmax"])
def test_a_loss_fact_that_cannot_be_read_loses_only_itself(broken, monkeypatch):
    """Each loss statistic is read on its own: one that raises (an op a device or tensor type
    does not allow) leaves the loss's other facts to the engine. Before, any of them took the
    whole description (no output/loss mismatch, no chance level) with it."""
    import neuraldbg._loop as loop

    if broken == "aminmax":
        monkeypatch.setattr(torch, "aminmax", _raise)
    elif broken == "penalties":
        monkeypatch.setattr(loop, "_penalized_parameters", _raise)
    else:
        monkeypatch.setattr(loop, "_normalizes_dim0", _raise)
    model = nn.Sequential(nn.Linear(4, 3), nn.Softmax(dim=1))
    y = torch.tensor([0, 1, 2, 1] * 4)
    d = first_loss(model, nn.CrossEntropyLoss(), torch.randn(16, 4), y)
    assert d["ops"] == ["NllLoss", "LogSoftmax"] and d["output_op"] == "Softmax"
    assert d["output_units"] == 3 and d["output_numel"] == 48
    assert d["compared_numel"] == 48 and d["reduction"] == "mean"
    # The classes' entropy is measured apart from the ranges: [1/4, 1/2, 1/4] -> 1.5 ln 2.
    assert d["class_entropy"] == pytest.approx(1.5 * math.log(2), rel=1e-5)
    if broken == "aminmax":
        assert "output_range" not in d and "class_range" not in d
    else:
        assert d["class_range"] == [0.0, 2.0]
        lo, hi = d["output_range"]
        assert 0.0 <= lo <= hi <= 1.0


def test_loss_facts_see_a_functional_sigmoid_through_indexing():
    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(4, 1)

        def forward(self, x):
            return torch.sigmoid(self.fc(x))[:, 0]

    d = first_loss(Net(), nn.BCEWithLogitsLoss(), torch.randn(8, 4), torch.ones(8))
    assert d["output_op"] == "Sigmoid" and "BinaryCrossEntropyWithLogits" in d["ops"]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().reshape(-1), b.double().reshape(-1)
    return float(a @ b / (a.norm() * b.norm()))


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_update_direction_is_the_cosine_between_each_step_and_the_gradient_backward_gave(optimizer):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.05)
        if optimizer == "sgd"
        else torch.optim.Adam(model.parameters(), 1e-2)
    )
    truth = []
    with watch(model) as spy:
        for step in range(6):
            x, y = data(step)
            opt.zero_grad()
            F.mse_loss(model(x), y).backward()
            grad, before = model[0].weight.grad.clone(), model[0].weight.detach().clone()
            opt.step()
            truth.append(_cosine(model[0].weight.detach() - before, grad))
    measured = [m["update_direction"][0] for m in spy.measures[:6]]  # (parameter 0: model[0].weight)
    assert measured == pytest.approx(truth, abs=1e-5)
    assert max(truth) < 0 if optimizer == "adam" else truth == pytest.approx([-1.0] * 6, abs=1e-5)


def _blow_up(how: str) -> List[Any]:
    """A small regression whose steps go up the gradient: negated between backward and step
    (TheDeepChecker's flipped sign), or an optimizer told to maximize a loss written as the
    negative of the one to lower (a correct program, blown up by its learning rate)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    maximize = how == "maximize"
    opt = torch.optim.SGD(model.parameters(), lr=1.5 if maximize else 0.05, maximize=maximize)
    watched = watch(model)
    with watched as spy:
        for step in range(40):
            x, y = data(step)
            opt.zero_grad()
            loss = F.mse_loss(model(x), y)
            (-loss if maximize else loss).backward()
            if how == "negated":
                for p in model.parameters():
                    p.grad.neg_()
            opt.step()
    assert spy.measures[0]["update_direction"][0] == pytest.approx(1.0, abs=1e-5) or maximize
    return watched.dbg.explain_failure()


def test_steps_that_climb_the_gradient_are_named_a_flipped_update_sign():
    top = _blow_up("negated")[0]
    assert top.cause.value == "flipped_update_sign" and top.confidence >= 0.8, top
    assert "up their gradients" in top.description and "step down the gradient" in top.remedies[0]


def test_an_optimizer_told_to_maximize_climbs_on_purpose():
    hypotheses = _blow_up("maximize")
    assert hypotheses and hypotheses[0].confidence >= 0.5, "the learning rate blew it up"
    assert all(h.cause.value != "flipped_update_sign" for h in hypotheses), hypotheses[0]
