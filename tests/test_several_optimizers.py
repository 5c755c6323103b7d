"""A model trained by several optimizers (issue 22, item 6): an encoder in one, a decoder in
another, one of them stepping first only later. Every optimizer seen stepping tells the engine
which parameters it holds and at what lr, so no layer one of them holds is taken for a layer
"no optimizer holds" (``stalled_layer <- parameters_not_updated``), live or from the trace;
a layer genuinely left out of every optimizer still is."""

from __future__ import annotations

import json
from typing import Any, List, Optional

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import neuraldbg
from neuraldbg import NeuralDbg
from neuraldbg.testing import device_path, spy_engine

STEPS = 120


class LrSpy:
    """Passes every engine call through, keeping the lrs given at registration and at each
    amend, with the loop's iteration (``now``) at the time."""

    def __init__(self, engine: Any) -> None:
        self.__dict__.update(engine=engine, registered=[], amends=[], now=-1)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.engine, name)

    def __setattr__(self, name: str, value: Any) -> None:
        self.__dict__[name] = value

    def register_model(self, spec: str) -> Any:
        self.registered.append((self.now, json.loads(spec)["param_lr"]))
        return self.engine.register_model(spec)

    def amend_param_lr(self, lrs: Optional[List[Optional[float]]]) -> bool:
        self.amends.append((self.now, None if lrs is None else list(lrs)))
        return bool(self.engine.amend_param_lr(lrs))


def teacher(step: int):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(32, 16, generator=g)
    w = torch.randn(16, 4, generator=torch.Generator().manual_seed(7))
    return x, (x @ w).argmax(1)


def model_and_parts():
    """enc = layers 0 and 2, mid = layer 4, dec = layer 6 (ReLUs between)."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )
    enc = [*model[0].parameters(), *model[2].parameters()]
    mid = list(model[4].parameters())
    dec = list(model[6].parameters())
    return model, enc, mid, dec


def train(
    model: nn.Module,
    optimizers: List[torch.optim.Optimizer],
    starts: List[int],
    path: str = "host",
    trace: Any = None,
) -> NeuralDbg:
    """Each optimizer steps every iteration from its start step on."""
    with NeuralDbg(model, trace=trace) as dbg:
        if path == "device":
            device_path(dbg, deferred=False)
        for step in range(STEPS):
            x, y = teacher(step)
            for opt in optimizers:
                opt.zero_grad()
            F.cross_entropy(model(x), y).backward()
            for opt, start in zip(optimizers, starts):
                if step >= start:
                    opt.step()
    return dbg


def weight_norms(model: nn.Module) -> List[float]:
    return [float(m.weight.detach().norm()) for m in model if isinstance(m, nn.Linear)]


def layers_moved(model: nn.Module, before: List[float]) -> List[bool]:
    """Per Linear layer, whether its weight norm changed (the independent record of what the
    engine sees: Adam's 1e-9 steps change a few tiny elements, never the float32 norm)."""
    return [a != b for a, b in zip(weight_norms(model), before)]


def held_by_none(hypotheses: List[Any]) -> List[str]:
    return [str(h) for h in hypotheses if h.cause == "parameters_not_updated" or "no optimizer holds" in h.description]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("start", [0, 5])
def test_a_model_split_over_two_optimizers_has_no_layer_held_by_none(path, start):
    """The encoder trains in SGD; the decoder (and the middle layer) are fine-tuned in Adam at
    an lr so small that their steps do not show in float32: their weights stand still, as a
    layer no optimizer holds would, and only who holds them tells the two apart. Neither
    optimizer alone holds every parameter."""
    model, enc, mid, dec = model_and_parts()
    sgd = torch.optim.SGD(enc, lr=0.05)
    adam = torch.optim.Adam(mid + dec, lr=1e-9)
    before = weight_norms(model)
    dbg = train(model, [sgd, adam], [0, start], path)
    # The planted run: the encoder moved, the Adam layers stood still, every layer got
    # gradients, and each parameter is in exactly one optimizer.
    assert layers_moved(model, before) == [True, True, False, False]
    assert all(p.grad is not None and float(p.grad.norm()) > 1e-4 for p in model.parameters())
    held = {id(p) for opt in (sgd, adam) for g in opt.param_groups for p in g["params"]}
    assert held == {id(p) for p in model.parameters()}
    assert held_by_none(dbg.explain_failure()) == []


@pytest.mark.parametrize("start", [0, 5])
def test_a_layer_neither_optimizer_holds_is_still_named(start):
    """The same split with the middle layer left out of both optimizers (its parameters still
    require grad): it is the stalled layer, for parameters no optimizer updates; the decoder,
    which Adam holds, is not."""
    model, enc, mid, dec = model_and_parts()
    assert all(p.requires_grad for p in mid)
    sgd = torch.optim.SGD(enc, lr=0.05)
    adam = torch.optim.Adam(dec, lr=1e-9)
    before = weight_norms(model)
    dbg = train(model, [sgd, adam], [0, start])
    assert layers_moved(model, before) == [True, True, False, False]
    hs = dbg.explain_failure()
    top = hs[0]
    assert (top.failure, top.cause, top.layer) == ("stalled_layer", "parameters_not_updated", "4"), str(top)
    assert "no optimizer holds" in top.description
    assert [h for h in hs if h.layer == "6" and h.cause == "parameters_not_updated"] == []


def test_each_optimizer_gives_its_lrs_once_merged_at_the_largest():
    """Which lrs reach the engine, and when: the first optimizer's at registration, each other
    one's once, in the iteration it first steps (5 here), never again after."""
    model, enc, mid, _ = model_and_parts()
    sgd = torch.optim.SGD([{"params": enc[:2], "lr": 0.05}, {"params": enc[2:], "lr": 0.0}])
    # Adam holds the middle layer, and the second encoder layer that SGD holds at lr 0.
    adam = torch.optim.Adam([{"params": mid, "lr": 1e-3}, {"params": enc[2:], "lr": 1e-4}])
    with NeuralDbg(model) as dbg:
        spy = LrSpy(dbg._collector.engine)
        spy_engine(dbg, spy)
        for step in range(12):
            spy.now = step
            x, y = teacher(step)
            sgd.zero_grad()
            adam.zero_grad()
            F.cross_entropy(model(x), y).backward()
            sgd.step()
            if step >= 5:
                adam.step()
    # Parameters in model order: enc0.w, enc0.b, enc1.w, enc1.b, mid.w, mid.b, dec.w, dec.b.
    assert spy.registered == [(0, [0.05, 0.05, 0.0, 0.0, None, None, None, None])]
    assert spy.amends == [(5, [None, None, 1e-4, 1e-4, 1e-3, 1e-3, None, None])]


def test_a_trace_reloaded_analyses_the_split_the_same(tmp_path):
    """The second optimizer's lrs are in the trace: the loaded run says what the live one
    said, for the split without a mistake and for the layer left out."""
    for left_out in (False, True):
        model, enc, mid, dec = model_and_parts()
        sgd = torch.optim.SGD(enc, lr=0.05)
        adam = torch.optim.Adam(dec if left_out else mid + dec, lr=1e-9)
        path = tmp_path / f"split-{left_out}.ndbg"
        dbg = train(model, [sgd, adam], [0, 5], trace=path)
        live = [(h.failure, h.cause, h.layer, h.step, round(h.confidence, 6)) for h in dbg.explain_failure()]
        loaded = neuraldbg.load(path)
        again = [(h.failure, h.cause, h.layer, h.step, round(h.confidence, 6)) for h in loaded.explain_failure()]
        assert again == live
        if left_out:
            assert live[0][:3] == ("stalled_layer", "parameters_not_updated", "4")
        else:
            assert [h for h in live if h[1] == "parameters_not_updated"] == []
