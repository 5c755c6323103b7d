"""The collector's hot path: how many host reads a step costs, where hooks live, the deferred
(CUDA-style) transfer, and that batching changed no number the engine sees."""

from __future__ import annotations

import copy
import sys
from collections import Counter
from contextlib import contextmanager
from typing import Iterator, List, Tuple

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from neuraldbg import NeuralDbg
from neuraldbg.testing import device_path, read_path, spy_engine, steps_in_flight

PACKAGE = "/neuraldbg/"
# Everything that moves a tensor's values to the host (or blocks on a device).
READS = ("item", "tolist", "numpy", "cpu", "__bool__", "__float__", "__int__", "__index__")


@contextmanager
def count_reads() -> Iterator[Counter]:
    """Counts host reads of tensor values made by NeuralDBG's own code (not by torch or the
    test's loop)."""
    counts: Counter = Counter()
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def wrap(name: str, fn):  # type: ignore[no-untyped-def]
        def wrapper(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            caller = sys._getframe(1).f_code.co_filename
            if PACKAGE in caller.replace("\\", "/"):
                counts[name] += 1
            return fn(self, *args, **kwargs)

        return wrapper

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield counts
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def mlp(depth: int, width: int = 16) -> nn.Sequential:
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.ReLU()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def step(model: nn.Module, opt: torch.optim.Optimizer, width: int = 16, device: str = "cpu") -> torch.Tensor:
    opt.zero_grad()
    x = torch.randn(32, width, device=device)
    y = torch.randint(0, 4, (32,), device=device)
    loss = nn.functional.cross_entropy(model(x), y)
    loss.backward()
    opt.step()
    return loss


class CountOps(TorchDispatchMode):
    """Counts the aten operations that reach torch's dispatcher (the autograd engine's too)."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        self.count += 1
        return func(*args, **(kwargs or {}))


def ops_per_step(model: nn.Module, steps: int, watched: bool, **options: object) -> Tuple[List[int], Counter]:
    """Aten operations of each of ``steps`` steps (after 12 steps of warm-up and registration),
    with or without NeuralDBG watching, and NeuralDBG's host reads in those steps."""
    torch.manual_seed(0)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    counts: List[int] = []
    dbg = NeuralDbg(model, **options) if watched else None
    if dbg is not None:
        dbg.__enter__()
    try:
        for _ in range(12):
            step(model, opt)
        with count_reads() as reads:
            for _ in range(steps):
                with CountOps() as mode:
                    step(model, opt)
                counts.append(mode.count)
    finally:
        if dbg is not None:
            dbg.__exit__(None, None, None)
    return counts, reads


@pytest.mark.parametrize("depth", [2, 24])
def test_a_cpu_step_runs_no_torch_operation_of_ours(depth):
    """A CPU model: every statistic of a step (gradient and weight norms, input statistics, the
    loss, the sampled activation and output statistics, zero-gradient shares) is read from the
    tensors' memory by the extension. Watched or not, a step runs the same torch operations,
    on sampled steps too (20 steps: two sample periods), and NeuralDBG reads no tensor value
    through torch."""
    base = mlp(depth)
    plain, _ = ops_per_step(copy.deepcopy(base), 20, watched=False)
    watched, reads = ops_per_step(copy.deepcopy(base), 20, watched=True)
    assert plain[0] > 10 * depth and plain == [plain[0]] * 20, plain  # the count is real
    assert watched == plain, (watched, plain)
    assert not reads, reads


def test_deferred_transfer_reads_nothing_inside_the_step():
    """The CUDA path, exercised on CPU: the step's vector is copied out once (no host read of
    a device value) and handed to the engine when the next forward starts; the engine lags by
    less than a step, results read mid-training include everything, and the numbers are those
    of the direct path."""
    torch.manual_seed(0)
    base = mlp(3)
    runs = {}
    for mode in ("host", "direct", "deferred"):
        model = mlp(3)
        model.load_state_dict(base.state_dict())
        torch.manual_seed(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        with NeuralDbg(model, activation_every=1) as dbg:
            if mode != "host":
                device_path(dbg, deferred=mode == "deferred")
            for i in range(15):
                step(model, opt)
                if mode == "deferred" and i >= 1:
                    # Observed at optimizer.step(), not yet handed over.
                    assert dbg._engine.last_step == i - 1
                    assert steps_in_flight(dbg) > 0
            steps, values = dbg.history("0", "grad_norm")  # flushes
            assert list(steps) == list(range(15))
            runs[mode] = (values, dbg.history(None, "loss")[1], dbg.history("1", "dead_fraction")[1])
        assert steps_in_flight(dbg) == 0
    for a, b in zip(runs["direct"], runs["deferred"]):
        np.testing.assert_array_equal(a, b)
    # The host path (a CPU model: statistics read from memory by the extension) agrees with
    # the device path's torch reductions.
    for a, b in zip(runs["host"], runs["direct"]):
        np.testing.assert_allclose(a, b, rtol=1e-5)


def test_deferred_transfer_has_no_host_read_in_the_step():
    torch.manual_seed(0)
    model = mlp(6)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with NeuralDbg(model) as dbg:
        device_path(dbg, deferred=True)
        for _ in range(12):
            step(model, opt)
        with count_reads() as counts:
            for _ in range(20):
                step(model, opt)
    # The CPU stand-in for the pinned copy is the only call, once per step.
    assert counts == Counter(numpy=20), counts


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_steps_never_synchronize():
    """With a GPU: no synchronizing call in a monitored healthy step."""
    torch.manual_seed(0)
    model = mlp(8).cuda()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with NeuralDbg(model) as dbg:
        for _ in range(12):
            step(model, opt, device="cuda")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(25):
                step(model, opt, device="cuda")
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert read_path(dbg) == "deferred"
    assert len(dbg.history("0", "grad_norm")[0]) == 37


class Normalize(nn.Module):
    """Divides each sample by its norm, without an epsilon: 0/0 on an all-zero sample."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=1, keepdim=True)


def nan_model() -> nn.Module:
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), Normalize(), nn.Linear(16, 4))


@pytest.mark.parametrize("mode", ["direct", "deferred"])
def test_nan_origin_is_named_on_its_step(mode):
    torch.manual_seed(0)
    model = nan_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model) as dbg:
        device_path(dbg, deferred=mode == "deferred")
        for i in range(20):
            opt.zero_grad()
            x = torch.randn(16, 8)
            if i == 15:
                x[3] = -1.0  # ReLU(Linear(x)) can be all zero for this sample: force it below
                with torch.no_grad():
                    model[0].bias.fill_(-100.0)
            loss = nn.functional.cross_entropy(model(x), torch.randint(0, 4, (16,)))
            loss.backward()
            opt.step()
    top = dbg.explain_failure()[0]
    assert (top.failure, top.layer, top.step) == ("non_finite", "2", 15), top


@pytest.mark.parametrize("mode", ["direct", "deferred"])
def test_crash_after_a_nan_forward_is_still_diagnosed(mode):
    """The loop raises before optimizer.step(): exit observes that step and scans it."""
    torch.manual_seed(0)
    model = nan_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with pytest.raises(FloatingPointError), NeuralDbg(model) as dbg:
        device_path(dbg, deferred=mode == "deferred")
        for i in range(10):
            opt.zero_grad()
            if i == 7:
                with torch.no_grad():
                    model[0].bias.fill_(-100.0)
            loss = nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 4, (16,)))
            if not torch.isfinite(loss):
                raise FloatingPointError("loss is NaN")
            loss.backward()
            opt.step()
    # The dead ReLU that feeds it zeros is the deeper cause; the non-finite origin is named too.
    top = dbg.explain_failure("non_finite")[0]
    assert (top.failure, top.layer, top.step) == ("non_finite", "2", 7), top


def forward_hooked(model: nn.Module) -> set:
    """Modules whose calls NeuralDBG sees: a forward hook, or its call recorder."""
    from neuraldbg._hooks import CALL_RECORDER

    return {name for name, m in model.named_modules() if m._forward_hooks or CALL_RECORDER.is_watched(m)}


@pytest.mark.parametrize("path", ["host", "device"])
def test_hooks_only_where_a_nan_can_start_and_probes_only_when_sampled(path):
    """After the first step, the modules that can create a NaN/Inf (and parameter owners) are
    seen on the device path; in host mode (a CPU model) only on sampled steps: an unmeasured
    step has no forward hook or record on any module, the model itself keeping its pre-hook
    (a forward pass starts) alone."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(16, 16), nn.ReLU(), nn.Dropout(0.1), nn.Sequential(nn.Linear(16, 16), nn.Tanh()), nn.Linear(16, 4)
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model, activation_every=5, dense_steps=2) as dbg:
        if path == "device":
            device_path(dbg, deferred=False)
        for _ in range(3):
            step(model, opt)
        assert dbg.step == 3
        # Step 3 is not sampled.
        assert forward_hooked(model) == ({"", "0", "3.0", "4"} if path == "device" else set())
        assert len(model._forward_pre_hooks) == 1
        step(model, opt)
        step(model, opt)
        # Step 5 is sampled: the activation modules are hooked for it.
        assert forward_hooked(model) == {"", "0", "3.0", "4", "1", "3.1"}
        step(model, opt)
        assert forward_hooked(model) == ({"", "0", "3.0", "4"} if path == "device" else set())
    assert forward_hooked(model) == set() and not model._forward_pre_hooks


def test_activation_sampling_measures_densely_while_a_change_is_unconfirmed():
    torch.manual_seed(0)
    model = mlp(2)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    with NeuralDbg(model, activation_every=10, dense_steps=0) as dbg:
        for i in range(45):
            if i == 21:
                with torch.no_grad():
                    model[2].bias[:11] = -1e3  # 11 of 16 units of the second ReLU die
            step(model, opt)
    steps, dead = dbg.history("3", "dead_fraction")
    # Every 10th step until the first sample that sees it (30), then every step until the
    # change is confirmed (3 observations: 69% dead is not far enough past 50% to be confirmed
    # at once), then every 10th again.
    assert list(steps) == [0, 10, 20, 30, 31, 32, 40], list(steps)
    np.testing.assert_allclose(dead[3:], 11 / 16)
    dead_events = [e for e in dbg.events if e.layer_name == "3" and str(e.to_state).endswith("DEAD")]
    assert [e.step for e in dead_events] == [30]


def test_conv_bn_relu_units_are_channels():
    """Dead units after Conv -> BatchNorm -> ReLU are channels, not image columns."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.BatchNorm2d(8), nn.ReLU(), nn.Flatten(), nn.Linear(8 * 64, 4)
    )
    with torch.no_grad():
        model[1].bias[:4] = -50.0  # four of eight channels are off everywhere
    opt = torch.optim.SGD(model.parameters(), lr=1e-4)
    with NeuralDbg(model, activation_every=1) as dbg:
        for _ in range(3):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(torch.randn(16, 3, 8, 8)), torch.randint(0, 4, (16,)))
            loss.backward()
            opt.step()
    _, dead = dbg.history("2", "dead_fraction")
    np.testing.assert_allclose(dead, 0.5)


class Branchy(nn.Module):
    """A sparse embedding, and a branch that runs on odd calls only: gradients go missing and
    come back, and one of them is sparse."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(50, 16, sparse=True)
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        h = self.embed(x).mean(dim=1)
        h = self.a(h)
        if self.calls % 2:
            h = self.b(h)
        return self.head(torch.relu(h))


def test_gradient_norms_match_torch_when_gradients_come_and_go():
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    expected = {"a": [], "b": [], "embed": []}
    with NeuralDbg(model) as dbg:
        for _ in range(12):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(torch.randint(0, 50, (8, 5))), torch.randint(0, 4, (8,)))
            loss.backward()
            for name in expected:
                grads = [p.grad for p in getattr(model, name).parameters() if p.grad is not None]
                if grads:
                    dense = [g.coalesce().values() if g.is_sparse else g for g in grads]
                    expected[name].append(float(torch.sqrt(sum(torch.sum(g * g) for g in dense))))
            opt.step()
    for name, values in expected.items():
        _, got = dbg.history(name, "grad_norm")
        np.testing.assert_allclose(got[np.isfinite(got)], values, rtol=1e-5)  # NaN: no gradient
    assert len(expected["b"]) == 6


@pytest.mark.parametrize("shape", [(64, 32), (16, 3, 32, 32)])  # one op path each (fused / four passes)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_input_statistics_match_numpy(shape, dtype):
    from neuraldbg._measure import INPUT_FUSED_LIMIT, input_stats

    assert (int(np.prod(shape)) <= INPUT_FUSED_LIMIT) == (len(shape) == 2)
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(shape, generator=g) * 3 + 5).to(dtype)
    got = input_stats(x).numpy()
    ref = x.double().numpy()
    assert got.dtype == np.float32
    np.testing.assert_allclose(got, [ref.min(), ref.max(), ref.mean(), ref.std()], rtol=1e-5)


def test_norm_plan_matches_torch_for_every_kind_of_group():
    """Groups of matrices, vectors and scalars (stacked) and single tensors, in list order."""
    from neuraldbg._measure import STACK_LIMIT, NormPlan

    g = torch.Generator().manual_seed(0)
    shapes = [(8, 4), (3,), (), (8, 4), (), (3,), (5, 2, 2), (7,), (8, 4)]
    tensors = [torch.randn(s, generator=g) for s in shapes]
    tensors.append(torch.randn(4, dtype=torch.float64, generator=g))  # a single of its own kind
    plan = NormPlan(tensors, STACK_LIMIT)
    assert len(plan.groups) == 3
    out: List[torch.Tensor] = []
    plan(tensors, out)
    got = np.empty(len(tensors))
    got[plan.order] = torch.cat(out).numpy()
    assert torch.cat(out).dtype == torch.float32
    expected = [np.sqrt((t.double().numpy() ** 2).sum()) for t in tensors]
    np.testing.assert_allclose(got, expected, rtol=1e-6)


def test_layers_are_recorded_without_hooks_and_the_classes_restored_on_exit():
    """Linear/BatchNorm layers keep torch's fast call path (no forward hook); their calls are
    recorded through a wrapper of the class's forward, which records nothing for other
    instances (an unwatched twin computes the same) and is gone after exit, also on an
    exception."""
    import copy

    from neuraldbg._hooks import CALL_RECORDER

    linear_forward = nn.Linear.forward
    assert "forward" not in nn.BatchNorm1d.__dict__
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    twin = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    with pytest.raises(RuntimeError, match="boom"), NeuralDbg(model) as dbg:
        device_path(dbg, deferred=False)  # (host mode keeps no tensor of a recorded call)
        for _ in range(3):
            step(model, opt)
        assert not any(m._forward_hooks for m in model)  # the ReLU (a probe) too
        assert nn.Linear.forward is not linear_forward
        twin.load_state_dict(model.state_dict())
        refs = dbg._collector.refs
        refs.clear()
        model.eval()
        twin.eval()
        with torch.no_grad():
            got = twin(x)
            assert refs == []  # another model: not recorded
            expected = model(x)
        np.testing.assert_array_equal(got.numpy(), expected.numpy())
        names = dbg._collector.watched.names
        assert [names[i] for i, _, _ in refs] == ["0", "1", "3", ""]
        assert refs[0][1] is not None and refs[0][2][0] is x  # output and args, as a hook sees them
        raise RuntimeError("boom")
    assert nn.Linear.forward is linear_forward
    assert "forward" not in nn.BatchNorm1d.__dict__
    assert not CALL_RECORDER.watched and not CALL_RECORDER.records and not CALL_RECORDER.wrappers
    assert forward_hooked(model) == set()


def grad_hook_count(model: nn.Module) -> int:
    return sum(len(p._post_accumulate_grad_hooks or {}) for p in model.parameters())


@pytest.mark.parametrize("where", ["tap", "hooks"])
def test_gradients_are_read_where_each_backward_ends_and_new_sentinels_when_a_sentinel_is_frozen(where):
    """Gradients are read where each backward pass ends, before clipping: on a CPU model
    whose loss is taken at the backward tap (no criterion), when ``torch.autograd.backward``
    returns, with no hook inside the backward (``tap``); otherwise (a criterion given) through
    two sentinel hooks, the first and last trainable parameter, never one hook per parameter:
    a parameter that ever had a post-accumulate-grad hook keeps torch's shim for it, which
    costs on every backward even after the hook is removed. When later steps give neither
    sentinel a gradient (frozen), the step is still read, and new sentinels are chosen among
    the parameters that have one: the gradient norms are still those of the backward pass."""
    torch.manual_seed(0)
    model = mlp(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    middle = list(model[4].parameters())
    unclipped: List[float] = []
    criterion = nn.CrossEntropyLoss()
    hooked = 2 if where == "hooks" else 0
    with NeuralDbg(model, criterion=criterion if where == "hooks" else None) as dbg:
        for i in range(16):
            if i == 3:
                assert grad_hook_count(model) == hooked
            if i == 6:  # freeze both ends of the model: the sentinels get no gradient now
                for m in (model[0], model[-1]):
                    for p in m.parameters():
                        p.requires_grad_(False)
            opt.zero_grad()
            x = torch.randn(32, 16)
            loss = criterion(model(x), torch.randint(0, 4, (32,)))
            loss.backward()
            unclipped.append(float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in middle]))))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
        assert grad_hook_count(model) == hooked and dbg.step == 16
        assert dbg._collector.hooks.sentinels == [2, 7]  # 2.weight, 6.bias
        steps, values = dbg.history("4", "grad_norm")
    # Only the two first sentinels and the two that replaced them were ever hooked; read at
    # the tap, only the first two, until the first step was observed.
    ever = [n for n, p in model.named_parameters() if p._post_accumulate_grad_hooks is not None]
    assert ever == (["0.weight", "2.weight", "6.bias", "8.bias"] if hooked else ["0.weight", "8.bias"]), ever
    assert list(steps) == list(range(16))
    # Step 6 is read at the optimizer step (after clipping: its backward reached no sentinel);
    # every other step at the end of its backward, before clipping.
    read = [i for i in range(16) if i != 6]
    np.testing.assert_allclose(values[read], np.asarray(unclipped)[read], rtol=1e-5)
    assert values[6] < unclipped[6]


def test_a_backward_the_tap_does_not_see_has_the_sentinels_hooked_again():
    """Gradients read at the backward tap: a loop that calls ``torch.autograd.backward`` under
    a name taken before NeuralDBG was entered gives the model gradients the tap never sees.
    That first step is read at the optimizer step (after clipping); from the next one on the
    sentinels' hooks say where each backward ends, and the norms are the backward's again."""
    from torch.autograd import backward as raw_backward  # bound before the tap is installed

    torch.manual_seed(0)
    model = mlp(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    middle = list(model[2].parameters())
    unclipped: List[float] = []
    with NeuralDbg(model) as dbg:
        for i in range(12):
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 4, (32,)))
            if i < 5:
                loss.backward()
            else:
                raw_backward(loss)
            unclipped.append(float(torch.linalg.vector_norm(torch.cat([p.grad.reshape(-1) for p in middle]))))
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            opt.step()
            if i == 3:
                assert dbg._collector.hooks.tap_reads and grad_hook_count(model) == 0
        assert not dbg._collector.hooks.tap_reads and grad_hook_count(model) == 2
        steps, values = dbg.history("2", "grad_norm")
    assert list(steps) == list(range(12))
    read = [i for i in range(12) if i != 5]
    np.testing.assert_allclose(values[read], np.asarray(unclipped)[read], rtol=1e-5)
    assert values[5] < unclipped[5]


class Probe(nn.Module):
    """Runs after layer ``2`` and looks at what the collector keeps of that layer's call."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: List[object] = []
        self.collector = None

    def forward(self, x):
        if self.collector is not None:
            self.kept.append([out for i, out, _ in self.collector.refs if i == 3])
        return x


def test_unmeasured_steps_record_no_module_call_and_the_origin_is_still_found():
    """On a CPU model, a step whose module outputs are not measured records no module call at
    all (nothing per layer); a sampled step records the calls and keeps no tensor of them.
    When an unmeasured step goes non-finite, its forward pass is computed again while the
    parameters are still its own, so the module where the Inf first appeared is still named,
    on that very step."""
    torch.manual_seed(0)
    probe = Probe()
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), probe, nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model, activation_every=10) as dbg:
        probe.collector = dbg._collector
        for i in range(25):
            if i == 23:
                with torch.no_grad():
                    model[2].weight[0, 0] = float("inf")  # layer "2" makes the first Inf
            opt.zero_grad()
            x = torch.randn(32, 16)
            nn.functional.cross_entropy(model(x), torch.randint(0, 4, (32,))).backward()
            opt.step()
    kept = probe.kept[12:23]  # steps 12..22: step 20 is a sampled one
    assert all(k == [] for j, k in enumerate(kept) if 12 + j != 20), kept
    assert kept[20 - 12] == [None]  # sampled: the call is recorded, its output read, not kept
    hyps = dbg.explain_failure("non_finite")
    assert hyps and hyps[0].layer == "2" and hyps[0].step == 23, hyps[:1]


def test_a_replayed_forward_leaves_the_model_and_the_random_stream_as_they_were():
    """The replay behind an unrecorded step's NaN origin runs the model's forward again on its
    own inputs, every module call seen in completion order: BatchNorm's running statistics (values and version counters: autograd may have
    saved them) and the CPU random generator are as before, and the origin is the layer whose
    output first went non-finite."""
    from neuraldbg._model import WatchedModel

    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.Dropout(0.5), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4)
    ).train()
    with torch.no_grad():
        model[3].weight[0, 0] = float("inf")
    watched = WatchedModel(model)
    watched.spec(list(range(1, len(watched.modules))) + [0], None)
    x = torch.randn(32, 8)
    buffers = [(b.clone(), b._version) for b in model.buffers()]
    rng = torch.get_rng_state()
    calls = watched.replay(model, [((x,), {})])
    assert calls is not None
    assert [watched.names[i] for i, _, _ in calls] == ["0", "1", "2", "3", "4", "5", ""]
    origin = watched.first_nonfinite(calls)
    assert origin is not None and watched.names[watched.spec_order[origin]] == "3"
    assert torch.equal(torch.get_rng_state(), rng)
    for b, (value, version) in zip(model.buffers(), buffers):
        assert torch.equal(b, value) and b._version == version
    assert not any(m._forward_hooks for m in model.modules())
    # A call that raises: nothing is known, and the model is left as it was.
    assert watched.replay(model, [((torch.randn(32, 5),), {})]) is None
    assert not any(m._forward_hooks for m in model.modules())


def test_a_nan_step_replayed_for_its_origin_leaves_training_as_an_unwatched_run_has_it():
    """End to end: a model with BatchNorm and Dropout goes non-finite on an unmeasured step;
    the origin is named on that step, and the replay behind it changed nothing the training
    sees: the running statistics, the parameters and the random stream after the step are
    those of an unwatched twin run on the same data."""
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 16), nn.Linear(16, 4)
    )
    twin = copy.deepcopy(model)
    data = [(torch.randn(32, 8), torch.randint(0, 4, (32,))) for _ in range(16)]

    def run(m: nn.Module) -> Tuple[List[torch.Tensor], torch.Tensor]:
        opt = torch.optim.SGD(m.parameters(), lr=0.01)
        torch.manual_seed(1)
        for i, (x, y) in enumerate(data):
            if i == 13:
                with torch.no_grad():
                    m[4].weight[0, 0] = float("inf")  # layer "4" makes the first Inf
            opt.zero_grad()
            nn.functional.cross_entropy(m(x), y).backward()
            opt.step()
        return [t.detach().clone() for t in [*m.parameters(), *m.buffers()]], torch.rand(4)

    want, want_rng = run(twin)
    with NeuralDbg(model, activation_every=10) as dbg:
        got, got_rng = run(model)
        assert not dbg._collector.hooks.modules_armed  # step 13 recorded no module call
    for a, b in zip(got, want):
        torch.testing.assert_close(a, b, equal_nan=True)
    torch.testing.assert_close(got_rng, want_rng)
    hyps = dbg.explain_failure("non_finite")
    assert hyps and hyps[0].layer == "4" and hyps[0].step == 13, hyps[:1]


class Measures:
    """Stands in for the engine: passes every call through and keeps each step's measures."""

    def __init__(self, engine) -> None:
        self.__dict__["engine"] = engine
        self.__dict__["seen"] = {}

    def __getattr__(self, name):
        return getattr(self.engine, name)

    def observe(self, step, *args, **kwargs):
        self.seen[step] = kwargs.get("measures")
        return self.engine.observe(step, *args, **kwargs)


@pytest.mark.parametrize("path", ["host", "device"])
def test_a_sampled_steps_output_maxima_are_each_layers(path):
    """The largest magnitude of every module's output on a sampled step (the engine's forward
    growth): read as each recorded layer returns in host mode, from the kept outputs on the
    device path; both are what a forward hook on an unwatched twin sees."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.LayerNorm(16), nn.ReLU(), Normalize(), nn.Linear(16, 4)).eval()
    twin = copy.deepcopy(model)
    seen = {}
    for name, m in twin.named_modules():
        if name:
            m.register_forward_hook(lambda m, a, out, name=name: seen.__setitem__(name, float(out.abs().max())))
    x = [torch.randn(32, 8) for _ in range(24)]
    with NeuralDbg(model, activation_every=10, dense_steps=2) as dbg:
        if path == "device":
            device_path(dbg, deferred=False)
        c = dbg._collector
        spy_engine(dbg, Measures(c.engine))
        opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the twin keeps the same weights
        for xi in x:
            opt.zero_grad()
            model(xi).square().mean().backward()
            opt.step()
        names = [c.watched.names[i] for i in c.watched.spec_order]
        measured = c.engine.seen
    twin(x[20])
    table = measured[20]["output_absmax"]
    got = {n: float(v) for n, v in zip(names, table) if n and not np.isnan(v)}
    # Linear and LayerNorm are recorded layers, Normalize has a forward hook; the ReLU is
    # passive (it cannot create a NaN): no output of it is measured.
    assert set(got) == {"0", "1", "3", "4"}, got
    for name, v in got.items():
        np.testing.assert_allclose(v, seen[name], rtol=1e-6)
    assert measured[15] is None or "output_absmax" not in measured[15]  # not a sampled step


class Gated(nn.Module):
    """Runs its second branch only when told to (a conditional module)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(16, 16)
        self.b = nn.Linear(16, 16)
        self.head = nn.Linear(16, 4)
        self.use_b = True

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.use_b:
            h = torch.relu(self.b(h))
        return self.head(h)


def test_exact_zero_gradients_have_the_coming_steps_record_which_modules_ran():
    """With zero_grad(set_to_none=False), a module that did not run keeps an all-zero
    gradient: "no gradient", not a vanishing one, which only the modules' calls tell. An
    unmeasured host step records none: its zeros are read as "no gradient" (a single zero would
    confirm a vanishing gradient), and the steps after it record which modules ran."""
    torch.manual_seed(0)
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model, activation_every=1000, weight_every=1000, dense_steps=2) as dbg:
        for i in range(12):
            model.use_b = i < 5
            opt.zero_grad(set_to_none=False)
            nn.functional.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 4, (32,))).backward()
            opt.step()
        assert dbg._collector.hooks.modules_armed  # still recording: zeros keep coming
    steps, norms = dbg.history("b", "grad_norm")
    assert list(steps[:5]) == [0, 1, 2, 3, 4] and (norms[:5] > 0).all()
    # From step 5 on "b" sits out: step 5 recorded no module call (its zero is read as "no
    # gradient"), the steps after it record which modules ran.
    assert list(steps) == list(range(12)) and np.isnan(norms[5:]).all(), (steps, norms)


def test_zero_gradients_made_anew_each_step_are_real_zeros_without_a_replay(monkeypatch):
    """With zero_grad() (set_to_none=True), a module that does not run keeps no gradient at
    all, so an exact-zero gradient is a real one (a dead layer): read as such on an unmeasured
    step, with no replay and no recording."""
    from neuraldbg._model import WatchedModel

    replays = []
    replay = WatchedModel.replay
    monkeypatch.setattr(WatchedModel, "replay", lambda self, *a: replays.append(1) or replay(self, *a))
    torch.manual_seed(0)
    model = Gated()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model, activation_every=1000, weight_every=1000, dense_steps=2) as dbg:
        for i in range(12):
            if i == 5:
                with torch.no_grad():
                    model.a.bias.fill_(-1e3)  # every unit after "a" dies: "a" gets exact zeros
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 4, (32,))).backward()
            opt.step()
            if i >= 5:
                assert not dbg._collector.hooks.modules_armed
    steps, norms = dbg.history("a", "grad_norm")
    assert list(steps) == list(range(12)) and (norms[5:] == 0.0).all() and (norms[:5] > 0).all(), norms
    assert not replays


def test_a_model_whose_own_forward_is_not_called_keeps_recording_its_layers():
    """When the loop calls the model's submodules but never the model itself (a
    LightningModule whose step calls its layers), there is no call to replay: the layers' calls
    are recorded on every step, and the NaN origin is named as before."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model, activation_every=10) as dbg:
        for i in range(16):
            if i == 14:
                with torch.no_grad():
                    model[2].weight[0, 0] = float("inf")
            opt.zero_grad()
            h = torch.randn(32, 16)
            for layer in model:
                h = layer(h)
            nn.functional.cross_entropy(h, torch.randint(0, 4, (32,))).backward()
            opt.step()
            if i == 12:
                assert dbg._collector.hooks.modules_armed and not dbg._collector.replay_ok
    hyps = dbg.explain_failure("non_finite")
    assert hyps and hyps[0].layer == "2" and hyps[0].step == 14, hyps[:1]


def test_recomputing_a_layer_leaves_it_untouched():
    """The NaN scan's recomputation of a recorded layer gives the output of the call it replays
    and writes nothing of the module: BatchNorm's running statistics keep their values and
    version counters (autograd may have saved them); an Embedding that renormalizes its
    weight when called is not recomputed."""
    from neuraldbg._hooks import CALL_RECORDER

    torch.manual_seed(0)
    bn = nn.BatchNorm1d(4).train()
    x = torch.randn(8, 4)
    expected = copy.deepcopy(bn)(x)
    before = [(b.clone(), b._version) for b in bn.buffers()]
    got = CALL_RECORDER.recompute(bn, (x,))
    torch.testing.assert_close(got, expected)
    for b, (value, version) in zip(bn.buffers(), before):
        assert torch.equal(b, value) and b._version == version
    emb = nn.Embedding(10, 4, max_norm=0.1)
    weight = emb.weight.detach().clone()
    assert CALL_RECORDER.recompute(emb, (torch.arange(10),)) is None
    assert torch.equal(emb.weight.detach(), weight)


class FactsSpy:
    """Stands in for the collector's engine: keeps each step's facts, forwards every call."""

    def __init__(self, engine: object) -> None:
        self.engine = engine
        self.facts: List[dict] = []

    def observe(self, *args: object, **kwargs: object) -> bool:
        self.facts.append(dict(kwargs.get("facts") or {}))
        return self.engine.observe(*args, **kwargs)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.engine, name)


@pytest.mark.parametrize("edit", ["none", "clip_norm", "unscale_like", "new_tensor"])
def test_clip_ratio_fact_says_what_happened_to_the_gradient_between_backward_and_step(edit):
    """The clip_ratio fact (the checked gradient's norm at the optimizer step over its norm at
    the end of backward) is 1 when nothing touched the gradients, and the true ratio when they
    were rescaled in place (clip_grad_norm_, an unscale-like multiply) or replaced."""
    torch.manual_seed(0)
    model = mlp(4)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model) as dbg:
        c = dbg._collector
        spy = FactsSpy(c.engine)
        spy_engine(dbg, spy)
        expected = []
        for _ in range(6):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            k = c.clip_index
            before = float(list(model.parameters())[k].grad.norm()) if k is not None else None
            if edit == "clip_norm":
                torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
            elif edit == "unscale_like":
                torch._foreach_mul_([p.grad for p in model.parameters()], 0.25)
            elif edit == "new_tensor":
                for p in model.parameters():
                    p.grad = p.grad * 0.5
            after = float(list(model.parameters())[k].grad.norm()) if k is not None else None
            expected.append(None if k is None else after / before)
            opt.step()
    got = [f.get("clip_ratio") for f in spy.facts[: len(expected)]]
    # The first step registers the model (the checked gradient is chosen then).
    assert all(g is not None for g in got[1:]), got
    np.testing.assert_allclose(got[1:], expected[1:], rtol=1e-4)
    if edit == "none":
        assert got[1:] == [1.0] * (len(got) - 1)
    else:
        assert max(got[1:]) < 0.9


def test_record_groups_and_single_records_on_shared_modules_stay_consistent():
    """The call recorder's fast group path (two dict updates in, a key loop out) and its
    one-by-one path give the same records whatever order groups and single records on the
    same modules come and go in; a class's forward is put back when its last record goes."""
    from neuraldbg._hooks import CALL_RECORDER, RecordGroup

    class Seen:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, output: object, args: object) -> None:
            self.calls += 1

    layers = [nn.Linear(3, 3), nn.Linear(3, 3), nn.GELU()]
    own = {cls: cls.__dict__.get("forward") for cls in (nn.Linear, nn.GELU)}
    a, b, single = Seen(), Seen(), Seen()
    group_a = RecordGroup([(m, a, [a]) for m in layers])
    group_b = RecordGroup([(layers[1], b, [b])])

    def run() -> Tuple[int, int, int]:
        before = (a.calls, b.calls, single.calls)
        x = torch.randn(2, 3)
        for m in layers:
            x = m(x)
        return (a.calls - before[0], b.calls - before[1], single.calls - before[2])

    assert run() == (0, 0, 0)
    for _ in range(2):  # the groups are re-used, as each sampled step re-arms them
        ha = CALL_RECORDER.add_group(group_a)
        assert group_a.added >= 0  # fast: none of its modules had a record
        assert run() == (3, 0, 0)
        hs = CALL_RECORDER.add(layers[0], single)  # one by one, on a module of the group
        hb = CALL_RECORDER.add_group(group_b)  # shares layers[1] with group a: slow path
        assert group_b.added == -1
        assert run() == (3, 1, 1)
        ha.remove()  # slow way out (changes were made since)
        assert run() == (0, 1, 1)
        assert nn.Linear.__dict__.get("forward") is not own[nn.Linear]  # still wrapped
        assert nn.GELU.__dict__.get("forward") is own[nn.GELU]  # its last record went
        hs.remove()
        ha = CALL_RECORDER.add_group(group_a)  # shares layers[1] with group b
        assert run() == (3, 1, 0)
        hb.remove()
        ha.remove()
        assert run() == (0, 0, 0)
        assert all(cls.__dict__.get("forward") is f for cls, f in own.items())
        assert all(len(alone) == 1 for _, _, alone in group_a.pairs + group_b.pairs)
        ha = CALL_RECORDER.add_group(group_a)
        assert group_a.added >= 0
        ha.remove()  # fast way out
        assert run() == (0, 0, 0)
        assert all(cls.__dict__.get("forward") is f for cls, f in own.items())


def test_every_step_ends_with_the_state_of_a_step_not_yet_begun():
    """The common host step is reset by the part of the step's reset it needs
    (``Collector.end_step``): after every step, sampled or not, with a product loss and
    a clipped gradient, whatever path observed it, the per-step state is that of a step not
    yet begun."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    torch.manual_seed(0)
    model = mlp(3)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen: List[int] = []
    with NeuralDbg(model, activation_every=4, weight_every=3, dense_steps=2) as dbg:
        c = dbg._collector

        def check(optimizer, args, kwargs):  # runs after NeuralDBG's own post hook
            seen.append(dbg.step)
            s = c.cur
            assert not s.forwards and not s.grad_read and s.grad_host is None
            assert s.grad_parts == [] and not s.raw_inputs and not s.inputs and not s.output_fns
            assert all(a is None for a in c.act_out) and s.act_staged is None and s.out_staged is None
            assert not c.reader.out_kept and not len(c.reader.maxima) and s.zeros_read is None
            assert not s.losses and not s.auto_losses and not s.host_inputs and s.loss_read is None
            assert s.tap_product is None and s.clip_after is None and s.clip_seen is None
            assert s.origin is None and s.ran is None and not c.refs and not s.root_calls

        handle = register_optimizer_step_post_hook(check)
        try:
            for i in range(14):
                opt.zero_grad()
                loss = nn.functional.cross_entropy(model(torch.randn(32, 16)), torch.randint(0, 4, (32,)))
                (loss * 0.5 if i % 3 == 0 else loss).backward()
                if i % 5 == 0:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
                opt.step()
        finally:
            handle.remove()
    assert seen == list(range(1, 15))


def _step_records(trace: bytes) -> List[bytes]:
    """The payloads of a trace's step records (docs/trace-format.md: a 16-byte preamble, then
    records of ``len:u32 kind:u8 zero[3] header_crc:u32 payload[len] payload_crc:u32``; kind
    2 a step). The header record (run metadata: times, versions) is left out."""
    import struct

    steps, at = [], 16
    while at < len(trace):
        n, kind = struct.unpack_from("<IB", trace, at)
        if kind == 2:
            steps.append(trace[at + 12 : at + 12 + n])
        at += 16 + n
    return steps


def _train(loop: str, tmp_path, name: str, plain: bool, monkeypatch) -> Tuple[List[bytes], str, str, int]:
    """A 40-step run of one loop kind, with the extension's PlainStep taking the plain steps or
    (``plain`` False) the collector's Python doing everything; its trace's bytes, events,
    ranked explanation, and the steps PlainStep observed."""
    from neuraldbg import _read_host

    if not plain:
        monkeypatch.setattr(_read_host.HostReader, "make_plain", lambda self: setattr(self, "plain", None))
    else:
        monkeypatch.undo()
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    if loop == "tokens":  # token ids in: no float input, no input statistics
        model = nn.Sequential(nn.Embedding(50, 8), nn.Flatten(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 4))
        data = [
            (torch.randint(0, 50, (32, 2), generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(40)
        ]
    else:
        model = mlp(3)
        data = [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(40)]
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    other = nn.Linear(16, 1)  # another model: its backward reaches none of ours
    path = tmp_path / f"{name}.ndbg"
    dbg = NeuralDbg(model, trace=path)
    taken = 0
    try:
        with dbg:
            for i, (x, y) in enumerate(data):
                if loop == "crash" and i == 23:
                    model(x)
                    raise RuntimeError("the loop fails after a forward")
                opt.zero_grad()
                if loop == "eval_between" and i % 4 == 2:
                    with torch.no_grad():
                        model.eval()
                        model(x)
                        model.train()
                if loop == "nan" and i >= 27:
                    with torch.no_grad():
                        model[0].weight[0, 0] = float("nan")
                if loop == "other_backward" and i % 3 == 1:  # before our forward
                    other(x).pow(2).mean().backward()
                loss = nn.functional.cross_entropy(model(x), y)
                if loop == "other_backward" and i % 3 == 2:  # between our forward and backward
                    other(x).pow(2).mean().backward()
                if loop == "accumulate" and i % 2 == 1:
                    (loss / 2).backward()
                    loss = nn.functional.cross_entropy(model(x.flip(0)), y) / 2
                loss.backward()
                if loop == "clip":
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
                if loop == "lr_tensor":
                    opt.param_groups[0]["lr"] = torch.tensor(0.05)
                opt.step()
                plain_step = dbg._collector.reader.plain
                taken = plain_step.taken if plain_step is not None else taken
    except RuntimeError:
        assert loop == "crash"
    return _step_records(path.read_bytes()), dbg._engine.events_json(), dbg._engine.explain_json(None), taken


@pytest.mark.parametrize(
    "loop", ["plain", "tokens", "accumulate", "clip", "eval_between", "nan", "other_backward", "lr_tensor", "crash"]
)
def test_the_extensions_plain_steps_give_the_engine_what_the_collector_would(loop, tmp_path, monkeypatch):
    """PlainStep (the unmeasured host steps observed by the extension) feeds the engine exactly
    what the collector's own Python does, step for step (the trace records every input the
    engine got), on float inputs and token ids, also where a step is handed back to the
    collector midway: gradient
    accumulation, clipping, evaluation forwards between steps, a NaN from step 27 on, another
    model's backward, a tensor learning rate, a loop that raises after a forward."""
    ours = _train(loop, tmp_path, "ours", True, monkeypatch)
    python = _train(loop, tmp_path, "python", False, monkeypatch)
    assert len(ours[0]) >= 23 and len(ours[0]) == len(python[0])
    for k, (a, b) in enumerate(zip(ours[0], python[0])):
        assert a == b, f"step record {k} differs"
    assert ours[1] == python[1]
    assert ours[2] == python[2]
    assert python[3] == 0
    # The steps the extension observed: of the 40, the plain ones are 11-19, 21-29 and 31-39
    # (0-9 are dense, 10, 20 and 30 sampled): 27. Handed back to the collector: the steps
    # with a second backward (odd ones: 15 of them), an evaluation forward (i % 4 == 2: 6),
    # another model's backward (i % 3 != 0: 18), a NaN (27 on), a tensor learning rate (all),
    # and those after the crash at 23.
    expected = {
        "plain": 27,
        "tokens": 27,
        "accumulate": 12,
        "clip": 27,
        "eval_between": 21,
        "nan": 15,
        "other_backward": 9,
        "lr_tensor": 0,
        "crash": 11,
    }
    assert ours[3] == expected[loop]
