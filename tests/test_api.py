"""The Python API contract of design.md: lifecycle, step tracking, isolation, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn as nn

import neuraldbg
from neuraldbg import (
    CausalHypothesis,
    ConfigError,
    EventType,
    GradientHealth,
    ModelError,
    NeuralDbg,
    NeuralDbgError,
    SemanticEvent,
    UnknownNameError,
)


def mlp(depth: int = 3, width: int = 16, act: type = nn.ReLU) -> nn.Sequential:
    layers: list[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), act()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def train(model, dbg_model=None, steps=5, lr=0.01, accumulate=1, loss_fn=None, seed=0, width=16):
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    crit = loss_fn or nn.CrossEntropyLoss()
    for _ in range(steps):
        opt.zero_grad()
        for _ in range(accumulate):
            x = torch.randn(32, width)
            y = torch.randint(0, 4, (32,))
            crit(model(x), y).backward()
        opt.step()
    return opt


def hook_counts(model: nn.Module) -> int:
    return sum(len(m._forward_hooks) + len(m._forward_pre_hooks) + len(m._backward_hooks) for m in model.modules())


def global_optimizer_hooks() -> int:
    from torch.optim import optimizer as o

    return len(o._global_optimizer_pre_hooks) + len(o._global_optimizer_post_hooks)


def test_step_counts_optimizer_steps_and_accumulation_is_one_step():
    model = mlp()
    with NeuralDbg(model) as dbg:
        assert dbg.step == 0
        train(model, steps=7, accumulate=3)
        assert dbg.step == 7
    assert dbg.step == 7


def test_hooks_removed_on_exit_and_on_exception():
    model = mlp()
    before_model, before_global = hook_counts(model), global_optimizer_hooks()
    with NeuralDbg(model):
        assert hook_counts(model) > before_model
        assert global_optimizer_hooks() > before_global
        train(model, steps=2)
    assert hook_counts(model) == before_model
    assert global_optimizer_hooks() == before_global

    class Boom(RuntimeError):
        pass

    with pytest.raises(Boom, match="user error"), NeuralDbg(model):
        train(model, steps=2)
        raise Boom("user error")
    assert hook_counts(model) == before_model
    assert global_optimizer_hooks() == before_global


def test_other_models_are_not_observed():
    watched, other = mlp(), mlp(depth=2)
    before = hook_counts(other)
    with NeuralDbg(watched) as dbg:
        train(watched, steps=3)
        assert hook_counts(other) == before
        # A second model and its optimizer stepping in the same process do not move the step.
        train(other, steps=4)
        assert dbg.step == 3
    names = {e.layer_name for e in dbg.events}
    watched_names = {n for n, _ in watched.named_modules()} | {"(loss)", "(input)"}
    assert names <= watched_names


def test_training_is_unchanged_by_monitoring():
    """Same seed, same loop: identical weights with and without the debugger."""
    a, b = mlp(), mlp()
    b.load_state_dict(a.state_dict())
    train(a, steps=10, seed=3)
    with NeuralDbg(b, activation_every=1, weight_every=1):
        train(b, steps=10, seed=3)
    for pa, pb in zip(a.parameters(), b.parameters()):
        assert torch.equal(pa, pb)


def test_bad_configuration_raises_package_errors():
    model = mlp()
    with pytest.raises(ConfigError, match="threshold_vanishing"):
        NeuralDbg(model, threshold_vanishing=-1.0)
    with pytest.raises(ConfigError, match="threshold_vanishing.*threshold_exploding"):
        NeuralDbg(model, threshold_vanishing=1e4, threshold_exploding=1e3)
    with pytest.raises(ValueError):  # ConfigError is also a ValueError
        NeuralDbg(model, threshold_exploding=float("nan"))
    with pytest.raises(ModelError, match="torch.nn.Module"):
        NeuralDbg("not a model")  # type: ignore[arg-type]
    with pytest.raises(TypeError):  # ModelError is also a TypeError
        NeuralDbg(42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="unknown option"):
        NeuralDbg(model, threshold_vanish=1e-7)
    with pytest.raises(ConfigError, match="activation_every"):
        NeuralDbg(model, activation_every=0)
    with pytest.raises(ConfigError, match="forward_check"):
        NeuralDbg(model, forward_check="sometimes")
    with pytest.raises(ConfigError, match="criterion"):
        NeuralDbg(model, criterion=lambda a, b: a)  # type: ignore[arg-type]
    assert issubclass(ConfigError, NeuralDbgError)


def test_unknown_names_raise_clear_errors():
    model = mlp()
    with NeuralDbg(model) as dbg:
        train(model, steps=3)
    with pytest.raises(UnknownNameError, match="vanishing_gradient.*expected one of"):
        dbg.explain_failure("vanishing_gradient")
    with pytest.raises(UnknownNameError, match="nope"):
        dbg.history("nope")
    with pytest.raises(UnknownNameError, match="metric"):
        dbg.history("0", metric="wobble")
    with pytest.raises(UnknownNameError, match="reduce"):
        dbg.history("0", reduce="median")


def test_reentry_is_refused():
    model = mlp()
    dbg = NeuralDbg(model)
    with dbg, pytest.raises(NeuralDbgError, match="already active"):
        dbg.__enter__()
    with pytest.raises(NeuralDbgError, match="one training run"), dbg:
        pass


def test_history_is_per_step_and_matches_torch():
    torch.manual_seed(0)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    crit = nn.CrossEntropyLoss()
    expected = []
    with NeuralDbg(model, criterion=crit) as dbg:
        for _ in range(12):
            opt.zero_grad()
            loss = crit(model(torch.randn(32, 16)), torch.randint(0, 4, (32,)))
            loss.backward()
            first = model[0]
            expected.append(math.sqrt(first.weight.grad.norm().item() ** 2 + first.bias.grad.norm().item() ** 2))
            opt.step()
    steps, values = dbg.history("0", "grad_norm")
    assert list(steps) == list(range(12))
    np.testing.assert_allclose(values, expected, rtol=1e-5)
    steps, loss = dbg.history(None, "loss")
    assert len(loss) == 12 and np.isfinite(loss).all()
    steps, lr = dbg.history(None, "lr")
    np.testing.assert_allclose(lr, 0.01, rtol=1e-6)


def test_result_types_and_printing():
    model = mlp(depth=2)
    with torch.no_grad():
        model[0].weight.mul_(0)  # nothing flows: gradients of the first layer vanish
        model[0].bias.fill_(-1.0)
    with NeuralDbg(model) as dbg:
        train(model, steps=20)
    events = dbg.events
    assert events and all(isinstance(e, SemanticEvent) for e in events)
    assert [e.step for e in events] == sorted(e.step for e in events)
    vanish = [e for e in events if e.to_state == GradientHealth.VANISHING]
    assert vanish and vanish[0].event_type == EventType.GRADIENT_HEALTH
    assert 0.0 <= vanish[0].confidence <= 1.0
    assert "VANISHING" in str(vanish[0])
    hyps = dbg.explain_failure()
    assert hyps and all(isinstance(h, CausalHypothesis) for h in hyps)
    assert [h.confidence for h in hyps] == sorted((h.confidence for h in hyps), reverse=True)
    line = str(hyps[0])
    assert "\n" not in line and hyps[0].description in line
    assert isinstance(hyps[0].remedies, list) and hyps[0].remedies
    only = dbg.explain_failure("vanishing_gradients")
    assert only and all(h.failure == "vanishing_gradients" for h in only)
    graph = dbg.export_mermaid_causal_graph()
    assert graph.startswith("graph TD") and "dead_neurons" in graph
    # relu(0 * x - 1) = 0: the ReLU after the zeroed layer is dead, and it is the root of the
    # vanishing gradient of the layer before it.
    roots = dbg.get_root_causes()
    assert [(str(r.failure), r.layer, r.step) for r in roots] == [("dead_neurons", "1", 0)]
    assert roots[0].consequences == ["vanishing_gradients"]
    couplings = dbg.detect_coupled_failures(window=5)
    assert any(c.coupling == "structural" and c.layers == ("0", "1") and c.lag == 0 for c in couplings)
    assert all(c.coupling == "temporal" for c in couplings if c.layers != ("0", "1"))
    chain = dbg.trace_causal_chain("vanishing_gradients")
    assert (chain[0].layer_name, chain[0].to_state) == ("1", "DEAD"), "the chain starts at its root"
    assert any(e.layer_name == "0" and e.to_state == "VANISHING" for e in chain[1:])


def test_version_and_stubs_present():
    import importlib.resources as r

    assert neuraldbg.__version__
    files = {p.name for p in r.files("neuraldbg").iterdir()}
    assert {"py.typed", "_native.pyi"} <= files
