"""The external suite's ports build and train (not their score: that is
`bench/external_scoreboard.py`, run by `make bench-diagnosis`)."""

from __future__ import annotations

import math

import pytest
import torch
from bench.external import all_programs
from bench.external.common import (
    Program,
    auto_mpg,
    digits_as_cifar,
    digits_as_mnist,
    he_normal_tf1,
    train,
)

PROGRAMS = all_programs()


def _versions() -> list:
    """(program, buggy) for every buggy version and every distinct fixed version (several
    TheDeepChecker programs share one clean control: it is stepped once)."""
    out, seen = [], set()
    for p in PROGRAMS:
        out.append((p, True))
        if p.fixed_key is None or p.fixed_key not in seen:
            seen.add(p.fixed_key)
            out.append((p, False))
    return out


def test_registry_is_complete_and_labelled() -> None:
    names = [p.name for p in PROGRAMS]
    assert len(names) == len(set(names)), "program names are unique"
    assert len(PROGRAMS) >= 15
    for p in PROGRAMS:
        assert p.source.count("@") == 1 and ":" in p.source, p.name
        assert p.label and p.fix and p.data, p.name


@pytest.mark.parametrize(
    "p,buggy", _versions(), ids=lambda v: v.name if isinstance(v, Program) else ("buggy" if v else "fixed")
)
def test_buggy_and_fixed_build_and_step(p: Program, buggy: bool) -> None:
    """Every port builds both versions, and each takes a training step; where a gradient is
    non-zero, the step changes a weight (the optimizer really holds the model's parameters)."""
    torch.manual_seed(0)
    run = p.build(buggy, 1)
    before = [q.detach().clone() for q in run.model.parameters()]
    res = train(run)
    assert res.error is None, f"{p.name} buggy={buggy}: {res.error!r}"
    assert len(res.losses) == 1
    params = list(run.model.parameters())
    moved = any(not torch.equal(a, b.detach()) for a, b in zip(before, params))
    had_grad = any(q.grad is not None and bool(q.grad.abs().sum() > 0) for q in params)
    assert moved or not had_grad, f"{p.name} buggy={buggy}: one optimizer step changed no parameter"


def test_one_pair_under_neuraldbg() -> None:
    """A buggy/fixed pair trains for a few steps under NeuralDbg: the regression that forgot to
    normalise its features, and its fix."""
    from neuraldbg import NeuralDbg

    p = next(q for q in PROGRAMS if q.name == "tdc/regrNN_miss_norm")
    losses = {}
    for buggy in (True, False):
        torch.manual_seed(0)
        run = p.build(buggy, 12)
        with NeuralDbg(run.model) as dbg:
            res = train(run)
        assert res.error is None and len(res.losses) == 12
        assert dbg.step == 12
        dbg.explain_failure()
        losses[buggy] = res.losses
    # Unnormalised features (weights in the thousands of lbs) against [0, 1] targets: the first
    # loss is orders of magnitude above the normalised program's.
    assert losses[True][0] > 1e3 * losses[False][0]


def test_data_keeps_the_originals_schema_and_scale() -> None:
    x, y = digits_as_mnist()
    assert x.shape[1:] == (28, 28) and x.min() == 0 and x.max() == 255 and set(y) == set(range(10))
    c, cy = digits_as_cifar()
    assert c.shape[1:] == (3, 32, 32) and c.min() >= 0 and c.max() <= 255 and set(cy) == set(range(10))
    f, mpg = auto_mpg()
    assert f.shape == (392, 9) and not math.isnan(float(f.sum()))
    assert mpg.min() >= 9 and mpg.max() <= 47  # Auto MPG's range
    assert f[:, 3].max() > 4000  # raw weight in lbs: the missing-normalization fault needs it
    assert (f[:, 6:].sum(1) == 1).all()  # origin one-hot


def test_tf1_he_normal_matches_its_variance() -> None:
    """TF 1.x's he_normal truncates at 2 sigma and rescales by 1/0.8796: variance 2 / fan_in."""
    torch.manual_seed(0)
    w = torch.empty(256, 400)
    he_normal_tf1(w)
    assert abs(float(w.var()) - 2 / 400) < 0.05 * 2 / 400
    std = math.sqrt(2 / 400) / 0.87962566103423978
    assert float(w.abs().max()) <= 2 * std + 1e-6
