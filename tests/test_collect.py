"""The torch-side collector: crashed runs, loops without an optimizer, the NaN origin, the loss,
modules that sit out a step, several optimizers, and failures of the debugger itself."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from neuraldbg import NeuralDbg, NeuralDbgWarning


class Blowup(nn.Module):
    """Divides by a scale that the training loop sets to zero at a chosen step."""

    def __init__(self) -> None:
        super().__init__()
        self.scale = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.scale - x / self.scale  # 0/0 = NaN once scale is 0


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(8, 16)
        self.act = nn.ReLU()
        self.bad = Blowup()
        self.fc2 = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.act(self.fc1(x))
        return self.fc2(h + self.bad(h))


def batches(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    for _ in range(n):
        yield torch.randn(16, 8, generator=g), torch.randint(0, 3, (16,), generator=g)


def test_crashed_loop_still_leaves_the_diagnosis():
    """The loop raises on the first NaN loss, before backward: that step is still observed and
    the module that made the NaN is named, on that very step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(FloatingPointError), NeuralDbg(model) as dbg:
        for i, (x, y) in enumerate(batches(30)):
            if i == 12:
                model.bad.scale = 0.0
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if not torch.isfinite(loss):
                raise FloatingPointError(f"NaN loss at step {i}")
            loss.backward()
            opt.step()
    assert dbg.step == 12
    top = dbg.explain_failure()[0]
    assert top.failure == "non_finite"
    assert top.layer == "bad"
    assert top.step == 12
    assert top.cause == "numerical_instability"


def test_a_loop_that_stops_itself_on_nan_is_still_diagnosed():
    """`if not torch.isfinite(loss): break` before backward: no exception, no optimizer step,
    yet that last forward is observed on exit and names the module; a final healthy
    evaluation pass is not counted as a step."""
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model) as dbg:
        for i, (x, y) in enumerate(batches(30)):
            model.bad.scale = 0.0 if i == 8 else 1.0
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            if not torch.isfinite(loss):
                break
            loss.backward()
            opt.step()
    top = dbg.explain_failure()[0]
    assert (str(top.failure), top.layer, top.step) == ("non_finite", "bad", 8)

    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model) as dbg:
        for x, y in batches(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
        with torch.no_grad():
            model(torch.randn(4, 8))  # evaluation
    assert len(dbg.history("fc1")[0]) == 5


def test_nan_origin_on_the_step_it_happens_without_crash():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with NeuralDbg(model) as dbg:
        for i, (x, y) in enumerate(batches(30)):
            model.bad.scale = 0.0 if i >= 17 else 1.0
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    top = dbg.explain_failure()[0]
    assert (str(top.failure), top.layer, top.step) == ("non_finite", "bad", 17)
    origin = [e for e in dbg.events if e.event_type == "non_finite_output"]
    assert origin and origin[0].layer_name == "bad" and origin[0].step == 17


def test_forward_check_off_locates_the_nan_from_gradients():
    torch.manual_seed(0)
    model = Net()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model, forward_check="off") as dbg:
        for i, (x, y) in enumerate(batches(20)):
            model.bad.scale = 0.0 if i >= 9 else 1.0
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert not [e for e in dbg.events if e.event_type == "non_finite_output"]
    top = dbg.explain_failure()[0]
    assert (str(top.failure), top.step) == ("non_finite", 9)
    # NaN enters the backward pass at the last layer in forward order whose gradient is NaN.
    assert top.layer == "fc2"


def test_loops_without_an_optimizer_count_backward_passes():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 3))
    with NeuralDbg(model, step_on="backward") as dbg:
        for x, y in batches(7):
            loss = nn.functional.cross_entropy(model(x), y)
            model.zero_grad()
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.1 * p.grad
    assert dbg.step == 7
    steps, norms = dbg.history("0")
    assert list(steps) == list(range(7)) and np.isfinite(norms).all()


def test_loss_from_criterion_record_loss_and_backward_agree():
    def run(mode: str) -> np.ndarray:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        crit = nn.CrossEntropyLoss()
        expected = []
        with NeuralDbg(model, criterion=crit if mode == "criterion" else None) as dbg:
            for x, y in batches(10):
                opt.zero_grad()
                loss = crit(model(x), y)
                if mode == "record":
                    dbg.record_loss(loss)
                loss.backward()
                opt.step()
                expected.append(loss.item())
        _, got = dbg.history(None, "loss")
        np.testing.assert_allclose(got, expected, rtol=1e-6)
        return got

    a, b, c = run("criterion"), run("record"), run("backward")
    np.testing.assert_allclose(a, b)
    np.testing.assert_allclose(a, c)


def test_grad_scaler_loss_is_unscaled():
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    except (AttributeError, TypeError, RuntimeError):  # pragma: no cover - old torch
        pytest.skip("no CPU GradScaler in this torch")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    expected = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(6):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            expected.append(loss.item())
    _, got = dbg.history(None, "loss")
    np.testing.assert_allclose(got, expected, rtol=1e-5)
    # GradScaler unscales the gradients before optimizer.step(): healthy norms, not 1024x.
    _, g = dbg.history("0")
    assert (g < 10).all()


class Branchy(nn.Module):
    """An auxiliary head used only on even steps."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Linear(8, 16)
        self.main = nn.Linear(16, 3)
        self.aux = nn.Linear(16, 3)

    def forward(self, x: torch.Tensor, use_aux: bool = False) -> torch.Tensor:
        h = torch.relu(self.body(x))
        return self.main(h) + (self.aux(h) if use_aux else 0)


def test_a_module_that_sits_out_a_step_is_not_vanishing():
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with NeuralDbg(model) as dbg:
        for i, (x, y) in enumerate(batches(30)):
            opt.zero_grad(set_to_none=False)  # leaves zero-filled gradients behind
            nn.functional.cross_entropy(model(x, use_aux=i % 2 == 0), y).backward()
            opt.step()
    assert not [e for e in dbg.events if e.layer_name == "aux" and e.to_state == "VANISHING"]
    steps, values = dbg.history("aux")
    assert len(steps) == 30 and np.isfinite(values).sum() == 15  # NaN where it had no gradient


def test_two_optimizers_on_one_model_step_once_per_iteration():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt_a = torch.optim.SGD(model[0].parameters(), lr=0.05)
    opt_b = torch.optim.Adam(model[2].parameters(), lr=1e-3)
    with NeuralDbg(model) as dbg:
        for x, y in batches(9):
            opt_a.zero_grad()
            opt_b.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt_a.step()
            opt_b.step()
    assert dbg.step == 9
    steps, _ = dbg.history("2")
    assert list(steps) == list(range(9))


def test_an_internal_failure_warns_and_never_breaks_training(monkeypatch):
    from neuraldbg import _read_host

    def broken(self, *a, **k):
        raise RuntimeError("collector bug")

    monkeypatch.setattr(_read_host.HostReader, "observe", broken)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    before = [p.detach().clone() for p in model.parameters()]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NeuralDbg(model) as dbg:
            for x, y in batches(5):
                opt.zero_grad()
                nn.functional.cross_entropy(model(x), y).backward()
                opt.step()
    msgs = [w for w in caught if issubclass(w.category, NeuralDbgWarning)]
    assert len(msgs) == 1 and "collector bug" in str(msgs[0].message)
    assert any(not torch.equal(a, b) for a, b in zip(before, model.parameters())), "training went on"
    assert dbg.explain_failure() == []
    assert torch.autograd.backward.__module__ == "torch.autograd"  # the loss tap is gone too


def test_explain_on_an_unused_debugger_is_empty():
    model = nn.Linear(3, 3)
    dbg = NeuralDbg(model)
    assert dbg.explain_failure() == [] and dbg.events == [] and dbg.step == 0
    with NeuralDbg(model) as dbg:
        pass
    assert dbg.explain_failure() == []
    assert "graph TD" in dbg.export_mermaid_causal_graph()


def test_float64_and_half_inputs_are_measured():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 3)).double()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with NeuralDbg(model) as dbg:
        for x, y in batches(4):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x.double()), y).backward()
            opt.step()
    _, scale = dbg.history(None, "input_scale")
    assert len(scale) == 4 and all(math.isfinite(v) and v > 0 for v in scale)
