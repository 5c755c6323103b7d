"""Reading points inside real training loops: every optimizer step observed on its own step,
with the gradients the backward pass produced (before clipping, after unscaling), for closures,
LBFGS, gradient accumulation, clipping, GradScaler (fp16 and bf16 CPU autocast), copies of a
watched model and torch.compile.

Ground truth is computed in the loop itself, directly from ``p.grad`` at the point the contract
names, never from the engine."""

from __future__ import annotations

import copy
import io
import json
import math
import os
import pickle
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn as nn

from neuraldbg import NeuralDbg, NeuralDbgWarning


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 3))


def batches(n: int, seed: int = 0, size: int = 16):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(size, 8, generator=g), torch.randint(0, 3, (size,), generator=g)) for _ in range(n)]


def layer_norms(model: nn.Module, name: str) -> float:
    """L2 norm of one layer's gradient (all its parameters), as the engine defines it."""
    m = dict(model.named_modules())[name]
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in m.parameters(recurse=False)))


def recorded(dbg: NeuralDbg, name: str) -> np.ndarray:
    steps, values = dbg.history(name)
    assert list(steps) == list(range(len(steps)))
    return values


def test_clipped_gradients_are_read_before_clipping():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    truth, after = [], []
    with NeuralDbg(model) as dbg:
        for x, y in batches(6):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            truth.append(layer_norms(model, "0"))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            after.append(layer_norms(model, "0"))
            opt.step()
            assert dbg.step == len(truth)
    assert max(after) < 1.1e-3 < min(truth), "clipping bit on every step"
    np.testing.assert_allclose(recorded(dbg, "0"), truth, rtol=1e-4)


def test_clip_grad_value_and_manual_edits_do_not_change_the_reading():
    model = mlp()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    truth = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            truth.append(layer_norms(model, "2"))
            torch.nn.utils.clip_grad_value_(model.parameters(), 1e-4)
            for p in model.parameters():
                p.grad.mul_(0.5)
            opt.step()
    np.testing.assert_allclose(recorded(dbg, "2"), truth, rtol=1e-4)


def test_closure_steps_are_observed_on_their_own_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    truth = []
    data = batches(7)
    with NeuralDbg(model) as dbg:
        for x, y in data:

            def closure():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                truth.append(layer_norms(model, "4"))
                return loss

            opt.step(closure)
            assert dbg.step == len(truth)
    np.testing.assert_allclose(recorded(dbg, "4"), truth, rtol=1e-4)
    _, losses = dbg.history(None, "loss")
    assert len(losses) == 7 and np.all(np.isfinite(losses))


def test_lbfgs_counts_one_step_per_optimizer_step():
    model = mlp()
    opt = torch.optim.LBFGS(model.parameters(), lr=0.5, max_iter=4)
    evaluations = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(5):

            def closure():
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(x), y)
                loss.backward()
                evaluations.append(layer_norms(model, "0"))
                return loss

            before = len(evaluations)
            opt.step(closure)
            assert len(evaluations) - before > 1, "LBFGS evaluated the closure several times"
    assert dbg.step == 5
    assert len(recorded(dbg, "0")) == 5


def through_layers(model: nn.Sequential, x: torch.Tensor) -> torch.Tensor:
    for layer in model:  # (the model's own forward never runs, as in a VAE's encode/decode)
        x = layer(x)
    return x


@pytest.mark.parametrize(
    "call", [nn.Sequential.__call__, nn.Sequential.forward, through_layers], ids=["model", "its_forward", "its_layers"]
)
@pytest.mark.parametrize("how", ["no_grad", "data"])
def test_a_loop_that_updates_the_weights_by_hand_is_observed_step_for_step(how, call):
    # PyTorch's "What is torch.nn really?" tutorial (no_grad), and `p.data -= ...` (which
    # leaves the parameter's version counter as it was); the model called, its `forward`
    # called (no forward hook of the model runs), or its layers one by one.
    model = mlp()
    data = batches(10)
    data[6][0][3, 2] = float("nan")
    truth = []
    with NeuralDbg(model) as dbg:
        for x, y in data:
            nn.functional.cross_entropy(call(model, x), y).backward()
            truth.append(layer_norms(model, "0"))
            if how == "data":
                for p in model.parameters():
                    p.data -= 0.1 * p.grad.data
            else:
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.1 * p.grad
            model.zero_grad()
    assert dbg.step == 10
    np.testing.assert_allclose(recorded(dbg, "0")[:6], truth[:6], rtol=1e-5)
    top = dbg.explain_failure()[0]
    assert (top.failure.value, top.cause.value, top.step) == ("data_anomaly", "bad_input_data", 6), top


def test_a_loop_that_updates_by_hand_and_never_zeroes_its_gradients_is_named_a_missing_zero_grad():
    # The tutorial's loop without its `model.zero_grad()`: each update uses every gradient so
    # far. Named as the same loop with an optimizer and no `optimizer.zero_grad()` is (before
    # the loop facts read a loop stepped by hand, it was called dying ReLUs).
    torch.manual_seed(0)
    x = torch.randn(512, 20)
    y = (x @ torch.randn(20, 3)).argmax(1)
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 3))
    with NeuralDbg(model) as dbg:
        for _ in range(4):
            for i in range(0, 512, 16):
                nn.functional.cross_entropy(model(x[i : i + 16]), y[i : i + 16]).backward()
                with torch.no_grad():
                    for p in model.parameters():
                        p -= 0.05 * p.grad
    assert dbg.step == 128
    top = dbg.explain_failure()[0]
    assert top.cause.value == "missing_zero_grad" and top.confidence >= 0.5, top


@pytest.mark.parametrize("call", [nn.Sequential.__call__, through_layers], ids=["model", "its_layers"])
def test_a_loop_that_updates_by_hand_up_the_gradient_is_observed_and_named_a_flipped_update_sign(call):
    # `p += lr * p.grad`: with no torch optimizer holding the weights, a move up the gradients
    # is the loop's own update (with one, it is an ascent before the optimizer steps: SAM's,
    # below). It was never observed: 0 steps, "it did not train".
    model = mlp()
    with NeuralDbg(model) as dbg:
        for x, y in batches(20):
            nn.functional.cross_entropy(call(model, x), y).backward()
            with torch.no_grad():
                for p in model.parameters():
                    p += 0.5 * p.grad
            model.zero_grad()
    assert dbg.step == 20
    top = dbg.explain_failure()[0]
    assert (top.failure.value, top.cause.value) == ("loss_divergence", "flipped_update_sign"), top
    assert top.confidence >= 0.5, top


def test_sam_moving_the_weights_up_their_gradients_is_no_update_by_hand():
    # Sharpness-aware minimization: an ascent step by hand, a second backward there, the
    # optimizer's step from the first point. The weights moved between two backward passes
    # with no optimizer step, but up the gradients: not an update by hand.
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    truth = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(8):
            nn.functional.cross_entropy(model(x), y).backward()
            with torch.no_grad():
                moves = [0.05 * p.grad / p.grad.norm() for p in model.parameters()]
                torch._foreach_add_(list(model.parameters()), moves)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            truth.append(layer_norms(model, "0"))
            with torch.no_grad():
                torch._foreach_sub_(list(model.parameters()), moves)
            opt.step()
            opt.zero_grad()
    assert dbg.step == 8
    np.testing.assert_allclose(recorded(dbg, "0"), truth, rtol=1e-5)


def test_weights_moved_between_steps_the_debugger_did_not_see_are_no_update_by_hand():
    # bench/overhead.py's shared model: another arm steps it with NeuralDBG's hooks set aside,
    # so the debugger meets gradients of no forward pass of the model and weights that moved
    # before its first step. That is no loop stepped by hand (it once cost a step, and the
    # host fast path for the rest of the run: a forward that cannot be replayed).
    from bench.overhead import suspended, unwrapped

    model = mlp()
    mine, other = torch.optim.SGD(model.parameters(), lr=0.05), torch.optim.SGD(model.parameters(), lr=0.05)

    def step(opt, x, y):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        opt.step()

    with NeuralDbg(model) as dbg:
        for x, y in batches(12):
            with unwrapped(), suspended(model):
                step(other, x, y)
            step(mine, x, y)
        c = dbg._collector
        assert (dbg.step, c.by_hand, c.step_on, c.replay_ok) == (12, False, "optimizer", True)


def test_gradient_accumulation_is_one_step_with_the_accumulated_gradient():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    truth = []
    data = batches(12, size=4)
    with NeuralDbg(model) as dbg:
        for k in range(0, 12, 4):
            opt.zero_grad()
            for x, y in data[k : k + 4]:
                (nn.functional.cross_entropy(model(x), y) / 4).backward()
            truth.append(layer_norms(model, "2"))
            opt.step()
    assert dbg.step == 3
    np.testing.assert_allclose(recorded(dbg, "2"), truth, rtol=1e-4)


def test_step_counter_follows_the_optimizer_inside_the_loop():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(4):
            seen.append(dbg.step)
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert seen == [0, 1, 2, 3] and dbg.step == 4


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_grad_scaler_steps_are_unscaled_and_skipped_steps_still_count(dtype):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    # A huge initial scale overflows the fp16 backward: the scaler skips steps and halves its
    # scale until the scaled gradients fit (bf16 has fp32's range: it does not overflow).
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**28, growth_interval=1000)
    unscaled, skipped = [], []
    with NeuralDbg(model) as dbg:
        for x, y in batches(16):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            unscaled.append(layer_norms(model, "0"))
            scale = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < scale)
            assert dbg.step == len(unscaled)
    values = recorded(dbg, "0")
    assert len(values) == 16
    finite = [i for i, s in enumerate(skipped) if not s]
    assert finite, "some steps ran"
    np.testing.assert_allclose(values[finite], np.asarray(unscaled)[finite], rtol=1e-3)
    if dtype == torch.float16:
        assert any(skipped), "the planted overflow made the scaler skip steps"
        _, total = dbg.history(None, "grad_norm")
        assert all(not np.isfinite(total[i]) for i, s in enumerate(skipped) if s)
    _, losses = dbg.history(None, "loss")
    assert np.all(np.isfinite(losses)) and float(losses.max()) < 10.0, "the loss is unscaled"


def user_forward_hook(module, args, output):
    return None


def test_a_watched_model_can_be_copied_pickled_and_saved_and_copies_carry_no_hooks():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def hooks(m: nn.Module) -> int:
        return sum(
            len(getattr(s, a))
            for s in m.modules()
            for a in ("_forward_hooks", "_forward_pre_hooks", "_forward_hooks_with_kwargs")
        )

    user_hook = model[0].register_forward_hook(user_forward_hook)
    with NeuralDbg(model) as dbg:
        for i, (x, y) in enumerate(batches(6)):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
            if i == 1:
                ema = copy.deepcopy(model)
            if i == 2:
                pickled = pickle.loads(pickle.dumps(model))
                buf = io.BytesIO()
                torch.save(model, buf)
        assert hooks(model) > 1, "the watched model is hooked"
    buf.seek(0)
    saved = torch.load(buf, weights_only=False)
    for copy_ in (ema, pickled, saved):
        assert hooks(copy_) == 1, "only the user's own hook travels with a copy"
        copy_(torch.randn(2, 8)).sum().backward()  # usable
    assert dbg.step == 6
    user_hook.remove()
    assert hooks(model) == 0
    # Nothing of ours is left on torch either.
    assert nn.Module.__getstate__.__module__ == "torch.nn.modules.module"


def test_ema_copy_in_the_loop_does_not_disturb_the_observation():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    ema = copy.deepcopy(model)
    truth = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            truth.append(layer_norms(model, "0"))
            opt.step()
            ema = copy.deepcopy(model)  # as timm's ModelEmaV1 does each step
            with torch.no_grad():
                ema(x)
    assert dbg.step == 5
    np.testing.assert_allclose(recorded(dbg, "0"), truth, rtol=1e-4)


def test_gradients_set_by_hand_are_read_at_the_step():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with NeuralDbg(model) as dbg:
        for x, y in batches(3):
            loss = nn.functional.cross_entropy(model(x), y)
            grads = torch.autograd.grad(loss, list(model.parameters()))
            for p, g in zip(model.parameters(), grads):
                p.grad = g
            truth = layer_norms(model, "0")
            opt.step()
    assert dbg.step == 3
    assert recorded(dbg, "0")[-1] == pytest.approx(truth, rel=1e-4)


def test_model_called_through_a_submodule_is_still_observed():
    """A LightningModule's training_step often calls ``self.net(x)``, never ``self(x)``."""

    class Wrapper(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.net = mlp()

        def forward(self, x):  # pragma: no cover - never called
            return self.net(x)

    model = Wrapper()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    truth = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)
        with NeuralDbg(model) as dbg:
            for x, y in batches(5):
                opt.zero_grad()
                nn.functional.cross_entropy(model.net(x), y).backward()
                truth.append(layer_norms(model, "net.0"))
                opt.step()
    assert dbg.step == 5
    np.testing.assert_allclose(recorded(dbg, "net.0"), truth, rtol=1e-4)
    _, losses = dbg.history(None, "loss")
    assert len(losses) == 5


def tanh_regression(seed: int = 0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(64, 8, generator=g)
    return model, x, x.sum(1, keepdim=True)


def test_an_explosion_under_clipping_is_diagnosed_at_its_layer_and_step():
    """A learning-rate jump (0.01 -> 100 at step 15) with clip_grad_norm_(1.0) on: the update
    stays bounded, yet the gradients the backward produces explode."""
    model, x, y = tanh_regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    pre, post = [], []
    with NeuralDbg(model) as dbg:
        for step in range(40):
            if step == 15:
                for group in opt.param_groups:
                    group["lr"] = 100.0
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            pre.append({n: layer_norms(model, n) for n in ("0", "2", "4")})
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            post.append(math.sqrt(sum(float(p.grad.pow(2).sum()) for p in model.parameters())))
            opt.step()
    assert max(post) <= 1.0 + 1e-4, "what the optimizer saw never exploded"
    onset = next(s for s, norms in enumerate(pre) if max(norms.values()) > 1e3)
    hyps = dbg.explain_failure("exploding_gradients")
    assert hyps and hyps[0].confidence >= 0.5, dbg.explain_failure()
    h = hyps[0]
    assert h.step == onset
    assert pre[onset][h.layer] > 1e3, "the named layer exploded at the onset"
    assert "clipping" in h.description
    assert any("clipping" in line for line in h.causal_chain)
    assert not any(r.startswith("clip gradients") for r in h.remedies)


def test_a_healthy_clipped_run_raises_no_alarm():
    model, x, y = tanh_regression()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model) as dbg:
        for _ in range(30):
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5], dbg.explain_failure()[:2]


class Overflow(nn.Module):
    """Multiplies by 1e5: under float16 autocast its own output overflows to inf."""

    def forward(self, x):
        return x * 1e5


def test_routine_overflow_skips_are_not_a_failure():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**28)
    skips = 0
    with NeuralDbg(model) as dbg:
        for x, y in batches(24):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            before = scaler.get_scale()
            scaler.step(opt)
            scaler.update()
            skips += scaler.get_scale() < before
    assert skips >= 2 and dbg.step == 24
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5], dbg.explain_failure()[:2]


def test_a_collapsing_loss_scale_is_a_failure_at_the_overflowing_module():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), Overflow(), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu")
    scales = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(24):
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                out = model(x)
                loss = nn.functional.cross_entropy(out, y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            scales.append(scaler.get_scale())
    # Ground truth from the scaler itself: it skipped every step, halving the scale each time.
    assert scales[-1] < 1.0 and all(b < a for a, b in zip(scales, scales[1:]))
    assert dbg.step == 24
    hyps = dbg.explain_failure("loss_scale_collapse")
    assert hyps and hyps[0].confidence >= 0.5
    assert hyps[0].layer == "3" and hyps[0].step == 0
    assert "bfloat16" in " ".join(hyps[0].remedies)
    assert not dbg.explain_failure("non_finite"), "overflow skips are not a non_finite failure"


class NanAfter(nn.Module):
    def __init__(self, step: int) -> None:
        super().__init__()
        self.calls, self.at = 0, step

    def forward(self, x):
        self.calls += 1
        return x * float("nan") if self.calls > self.at else x


def test_halt_on_counting_backward_passes_raises_from_the_confirming_backward():
    """``step_on="backward"`` on a CPU model read at the backward tap: the step is observed
    when ``loss.backward()`` returns, and a halt it confirms is raised from that call."""
    from neuraldbg import TrainingFailure

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), NanAfter(5), nn.Linear(16, 3))
    backwards = 0
    with pytest.raises(TrainingFailure) as info, NeuralDbg(model, step_on="backward", halt_on="non_finite") as dbg:
        for x, y in batches(20):
            loss = nn.functional.cross_entropy(model(x), y)
            model.zero_grad()
            backwards += 1
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
    assert backwards == 6 and info.value.step == 5
    assert info.value.hypotheses[0].failure == "non_finite" and info.value.hypotheses[0].layer == "2"
    assert dbg._collector.hooks.tap_reads


def test_halt_on_raises_training_failure_from_the_confirming_step(tmp_path):
    from neuraldbg import TrainingFailure

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), NanAfter(5), nn.Linear(16, 3))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    iterations = 0
    with (
        pytest.raises(TrainingFailure) as info,
        NeuralDbg(
            model,
            halt_on="non_finite",
            on_failure=seen.append,
            trace=tmp_path / "run.ndbg",
            report=tmp_path / "report.html",
        ) as dbg,
    ):
        for x, y in batches(20):
            iterations += 1
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    err = info.value
    assert iterations == 6, "raised from the step that confirmed it, the loop went no further"
    assert err.step == 5 and err.hypotheses[0].failure == "non_finite"
    assert err.hypotheses[0].layer == "2"
    assert dbg.halted == err.hypotheses
    assert seen and seen[0][0].failure == "non_finite"
    assert (tmp_path / "report.html").stat().st_size > 1000
    # The trace holds the failure step: the CLI replays the same diagnosis.
    cli = subprocess.run(
        [os.path.join(os.path.dirname(sys.executable), "neuraldbg"), "explain", str(tmp_path / "run.ndbg"), "--json"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)[0]["failure"] == "non_finite"
    assert all(not m._forward_hooks for m in model.modules()), "hooks removed"


def test_halt_on_never_fires_on_a_healthy_run():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    with NeuralDbg(model, halt_on=True, on_failure=seen.append) as dbg:
        for x, y in batches(20):
            opt.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            opt.step()
    assert dbg.step == 20 and dbg.halted is None and seen == []


def test_halt_on_rejects_unknown_failures():
    from neuraldbg import ConfigError

    with pytest.raises(ConfigError, match="unknown failure 'exploding'"):
        NeuralDbg(mlp(), halt_on=["exploding"])
    with pytest.raises(ConfigError):
        NeuralDbg(mlp(), halt_on=1.5)
