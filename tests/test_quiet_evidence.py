"""Evidence for runs that train badly without blowing up (issue 22): how far each optimizer
step moves the weights, and the loss a model that learned nothing would have."""

from __future__ import annotations

from typing import Dict, List

import numpy as np
import pytest
import torch
import torch.nn as nn

from neuraldbg import NeuralDbg
from neuraldbg.testing import device_path, spy_engine


class Measures:
    """Stands in for the collector's engine: keeps each step's measures, forwards every call."""

    def __init__(self, engine: object) -> None:
        self.__dict__["engine"] = engine
        self.__dict__["seen"] = {}

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)

    def observe(self, step: int, *args: object, **kwargs: object) -> object:
        self.seen[step] = kwargs.get("measures")
        return self.engine.observe(step, *args, **kwargs)  # type: ignore[attr-defined]


@pytest.mark.parametrize("path", ["host", "device"])
@pytest.mark.parametrize("optimizer", ["sgd_momentum", "adam"])
def test_update_ratio_is_how_far_each_optimizer_step_moved_each_parameter(path, optimizer):
    """On the steps whose parameter norms are measured, ``update_ratio`` is |W_after - W_before|
    / |W_before| of each parameter, as the loop itself sees it around ``opt.step()``: exact for
    parameters of up to 4,096 elements, a strided-sample estimate for larger ones; not sent on
    other steps."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(100, 64), nn.ReLU(), nn.Linear(64, 16), nn.ReLU(), nn.Linear(16, 4))
    if optimizer == "adam":
        opt: torch.optim.Optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    truth: Dict[int, List[float]] = {}
    with NeuralDbg(model, weight_every=5, dense_steps=2) as dbg:
        if path == "device":
            device_path(dbg, deferred=False)
        c = dbg._collector
        spy_engine(dbg, Measures(c.engine))
        for step in range(12):
            x, y = torch.randn(32, 100), torch.randn(32, 4)
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            before = [p.detach().clone() for p in c.params]
            opt.step()
            truth[step] = [float((p.detach() - b).norm() / b.norm()) for p, b in zip(c.params, before)]
        seen = c.engine.seen
        sizes = [p.numel() for p in c.params]
    for step in range(12):
        measured = (seen.get(step) or {}).get("update_ratio")
        if step < 2 or step % 5 == 0:
            assert measured is not None, f"step {step}: no update ratio on a sampled step"
            for k, (got, want) in enumerate(zip(measured, truth[step])):
                assert want > 0
                # Small parameters are sampled whole; the 6,400-element weight by a stride.
                np.testing.assert_allclose(got, want, rtol=1e-5 if sizes[k] <= 4096 else 0.25, err_msg=f"param {k}")
        else:
            assert measured is None, f"step {step}: update ratio on an unsampled step"


def test_a_learning_rate_far_too_low_is_said_with_the_measured_step_size():
    """SGD at lr 1e-6 on a classifier: the loss does not move, and the learning-rate hypothesis
    quotes the measured update-to-weight ratio, which the loop's own reading confirms."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 5))
    opt = torch.optim.SGD(model.parameters(), lr=1e-6)
    x = torch.randn(512, 20)
    y = (x[:, :5].argmax(1)).long()
    ratios = []
    with NeuralDbg(model) as dbg:
        for step in range(200):
            i = torch.randint(0, 512, (64,))
            opt.zero_grad()
            nn.functional.cross_entropy(model(x[i]), y[i]).backward()
            w = model[2].weight.detach().clone()
            opt.step()
            if step < 5:
                ratios.append(float((model[2].weight.detach() - w).norm() / w.norm()))
    top = dbg.explain_failure()[0]
    assert str(top.cause) == "learning_rate_too_low", top
    assert max(ratios) < 1e-5  # the loop's own reading: far below ~1e-3
    assert "(measured)" in top.description, top.description
