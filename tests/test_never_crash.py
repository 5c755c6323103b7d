"""NeuralDBG never ends the user's run: setups people have (tied and late-trainable weights,
scripted and lazy modules, a module called twice, training on other threads, torch.func) are
observed step for step, and an internal error anywhere we run inside the training loop turns
monitoring off with one warning while training goes on (the fault-injection suite: every entry
point of ``neuraldbg.testing.ENTRY_POINTS`` made to raise in turn)."""

from __future__ import annotations

import math
import threading
import warnings
import weakref
from typing import Any, List

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import neuraldbg
from neuraldbg import ModelError, NeuralDbg, NeuralDbgWarning
from neuraldbg.testing import ENTRY_POINTS, fault_at, read_path


def grad_norm(module: nn.Module) -> float:
    """The layer's gradient norm as the engine defines it: over its own parameters."""
    grads = [p.grad.double().reshape(-1) for p in module.parameters(recurse=False) if p.grad is not None]
    return math.sqrt(sum(float(g.pow(2).sum()) for g in grads)) if grads else float("nan")


def mlp(seed: int = 0) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 1))


def batches(n: int, seed: int = 1) -> List[tuple]:
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(16, 8, generator=g)
        out.append((x, x.sum(1, keepdim=True) * 0.3))
    return out


def train(model: nn.Module, data, *, lr: float = 0.05, criterion=None, truth=None, layers=()):
    """A plain loop: returns the losses; ``truth`` collects each step's layer norms."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    loss_fn = criterion or nn.functional.mse_loss
    losses = []
    for x, y in data:
        opt.zero_grad()
        loss = loss_fn(model(x), y)
        loss.backward()
        if truth is not None:
            truth.append([grad_norm(model.get_submodule(n)) for n in layers])
        opt.step()
        losses.append(float(loss.detach()))
    return losses


def no_hooks_left(model: nn.Module) -> bool:
    return (
        all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
        and torch.autograd.backward.__module__ == "torch.autograd"
    )


# ----------------------------------------------------------------------- shared parameters


class TiedLM(nn.Module):
    """An embedding and an output head sharing one weight, as language models do."""

    def __init__(self, vocab: int = 32, dim: int = 16) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(vocab, dim)
        self.mix = nn.Linear(dim, dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.emb.weight

    def forward(self, tokens):
        return self.head(torch.tanh(self.mix(self.emb(tokens))))


def test_tied_head_resolves_to_the_embedding_it_shares():
    model = TiedLM()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    g = torch.Generator().manual_seed(0)
    truth = []
    with NeuralDbg(model) as dbg:
        for _ in range(12):
            tokens = torch.randint(0, 32, (8, 6), generator=g)
            opt.zero_grad()
            loss = nn.functional.cross_entropy(model(tokens).reshape(-1, 32), tokens.reshape(-1))
            loss.backward()
            truth.append(float(model.emb.weight.grad.norm()))  # both uses, summed by autograd
            opt.step()
    steps, emb = dbg.history("emb")
    _, head = dbg.history("head")
    assert list(steps) == list(range(12))
    np.testing.assert_allclose(emb, truth, rtol=1e-5)
    np.testing.assert_array_equal(head, emb)  # the head reports the gradient it shares
    assert not [h for h in dbg.explain_failure() if h.confidence >= 0.5]


def test_a_module_called_twice_per_forward_is_one_layer_with_both_gradients():
    torch.manual_seed(0)

    class Twice(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inp = nn.Linear(8, 16)
            self.block = nn.Linear(16, 16)
            self.out = nn.Linear(16, 1)

        def forward(self, x):
            h = torch.tanh(self.inp(x))
            h = torch.tanh(self.block(h))
            h = torch.tanh(self.block(h))  # the same weights again
            return self.out(h)

    model = Twice()
    truth: List[list] = []
    with NeuralDbg(model) as dbg:
        train(model, batches(15), truth=truth, layers=["block", "inp"])
    steps, block = dbg.history("block")
    assert list(steps) == list(range(15)) and dbg.step == 15
    np.testing.assert_allclose(block, [t[0] for t in truth], rtol=1e-5)


# --------------------------------------------------------------- late-trainable parameters


def test_a_layer_unfrozen_mid_run_is_observed_from_then_on_and_its_blow_up_is_blamed_on_it():
    model = mlp()
    first = model[0]
    first.requires_grad_(False)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.01)
    boost = {"on": False}
    truth = []
    with NeuralDbg(model) as dbg:
        for step, (x, y) in enumerate(batches(40)):
            if step == 10:
                first.requires_grad_(True)
                # A blow-up planted in the unfrozen layer only: its gradient multiplied as made.
                first.weight.register_hook(lambda g: g * 1e7 if boost["on"] else g)
                opt.add_param_group({"params": list(first.parameters())})
            boost["on"] = step >= 25
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            truth.append(grad_norm(first))
            opt.step()
    steps, values = dbg.history("0")
    observed = steps[values >= 0]
    assert list(observed) == list(range(10, 40)), "observed from its first gradient on"
    np.testing.assert_allclose(values[values >= 0], truth[10:], rtol=1e-5)
    h = dbg.explain_failure("exploding_gradients")[0]
    assert h.confidence >= 0.5 and h.layer == "0" and h.step == 25
    # Frozen on purpose for 10 steps: not a stalled layer.
    assert not [h for h in dbg.explain_failure("stalled_layer") if h.confidence >= 0.5]


# -------------------------------------------------------------- scripted and lazy modules


def test_a_scripted_submodule_is_watched_around():
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(8, 16), nn.Tanh(), torch.jit.script(nn.Sequential(nn.Linear(16, 16), nn.Tanh())), nn.Linear(16, 1)
    )
    truth: List[list] = []
    with NeuralDbg(model) as dbg:
        train(model, batches(12), truth=truth, layers=["0", "2.0", "3"])
    assert dbg.step == 12
    for k, name in enumerate(["0", "2.0", "3"]):
        steps, values = dbg.history(name)
        assert list(steps) == list(range(12))
        np.testing.assert_allclose(values, [t[k] for t in truth], rtol=1e-5)
    assert no_hooks_left(model)


def test_a_scripted_model_is_refused_with_our_error_and_nothing_left_behind():
    torch.manual_seed(0)
    model = torch.jit.script(nn.Sequential(nn.Linear(8, 4), nn.Tanh()))
    with pytest.raises(ModelError, match="TorchScript"):
        NeuralDbg(model)


def test_a_failed_enter_leaves_no_hook_and_keeps_no_output():
    """A model whose root refuses hooks (as a ScriptModule does): our ModelError, and nothing
    of ours stays installed or keeps a tensor."""

    class Refusing(nn.Sequential):
        def register_forward_pre_hook(self, *args, **kwargs):
            raise RuntimeError("register_forward_pre_hook is not supported here")

    torch.manual_seed(0)
    model = Refusing(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    original_backward = torch.autograd.backward
    with pytest.raises(ModelError, match="hook"), NeuralDbg(model, trace=None):
        pass
    assert torch.autograd.backward is original_backward
    assert no_hooks_left(model)
    out = model(torch.randn(4, 8))
    ref = weakref.ref(out)
    del out
    assert ref() is None, "an output is still referenced"


def test_lazy_modules_are_watched_from_their_first_step():
    torch.manual_seed(0)
    model = nn.Sequential(nn.LazyLinear(16), nn.Tanh(), nn.LazyLinear(1))
    opt = None
    truth = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(12):
            out = model(x)
            if opt is None:
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
            opt.zero_grad()
            nn.functional.mse_loss(out, y).backward()
            truth.append(grad_norm(model[0]))
            opt.step()
    steps, values = dbg.history("0")
    assert dbg.step == 12 and list(steps) == list(range(12))
    np.testing.assert_allclose(values, truth, rtol=1e-5)
    assert no_hooks_left(model)


# ------------------------------------------------------------------------------- threads


def _run_on_thread(fn):
    errors: List[BaseException] = []

    def target():
        try:
            fn()
        except BaseException as e:
            errors.append(e)

    t = threading.Thread(target=target)
    t.start()
    t.join(120)
    assert not t.is_alive()
    if errors:
        raise errors[0]


def test_entered_on_the_main_thread_and_trained_on_a_worker():
    model = mlp()
    truth: List[list] = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)
        with NeuralDbg(model) as dbg:
            _run_on_thread(lambda: train(model, batches(20), truth=truth, layers=["0"]))
    steps, values = dbg.history("0")
    assert dbg.step == 20 and list(steps) == list(range(20))
    np.testing.assert_allclose(values, [t[0] for t in truth], rtol=1e-5)


def test_steps_alternating_between_threads_are_all_observed():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    truth = []

    def one(x, y):
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        truth.append(grad_norm(model[2]))
        opt.step()

    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)
        with NeuralDbg(model) as dbg:
            for i, (x, y) in enumerate(batches(24)):
                if i % 2:
                    _run_on_thread(lambda: one(x, y))
                else:
                    one(x, y)
    steps, values = dbg.history("2")
    assert dbg.step == 24 and list(steps) == list(range(24))
    np.testing.assert_allclose(values, truth, rtol=1e-5)


def test_two_models_on_two_threads_at_once_are_both_observed():
    """Each thread enters its own debugger and trains its own model, at the same time; then a
    third model later in the process, on yet another thread (after the others are done)."""
    results = {}
    start = threading.Barrier(2)

    def job(name: str, seed: int) -> None:
        model = mlp(seed)
        truth: List[list] = []
        start.wait(30)
        with NeuralDbg(model) as dbg:
            train(model, batches(30, seed), truth=truth, layers=["0", "4"])
        results[name] = (dbg, truth)

    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)
        threads = [threading.Thread(target=job, args=(n, s)) for n, s in (("a", 0), ("b", 1))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
    assert set(results) == {"a", "b"}
    for dbg, truth in results.values():
        assert dbg.step == 30
        for k, name in enumerate(["0", "4"]):
            steps, values = dbg.history(name)
            assert list(steps) == list(range(30))
            np.testing.assert_allclose(values, [t[k] for t in truth], rtol=1e-5)

    # A later model on another thread, after the two are done.
    late = {}

    def later() -> None:
        model = mlp(3)
        truth: List[list] = []
        with NeuralDbg(model) as dbg:
            train(model, batches(10, 3), truth=truth, layers=["2"])
        late["r"] = (dbg, truth)

    _run_on_thread(later)
    dbg, truth = late["r"]
    np.testing.assert_allclose(dbg.history("2")[1], [t[0] for t in truth], rtol=1e-5)


def test_a_debugger_entering_and_leaving_while_another_thread_steps_leaves_that_step_alone():
    """torch walks its global optimizer step hooks (an OrderedDict) while a step runs; a hook
    registered or removed then, from another thread, ended that thread's step with "OrderedDict
    mutated during iteration" (seen in CI on the two-thread test above). Made deterministic: the
    user's own global hook holds thread B inside its step while thread A watches, trains and
    leaves a model of its own."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    inside, done = threading.Event(), threading.Event()
    b_opt: list = []

    def users_hook(optimizer, args, kwargs) -> None:
        if b_opt and optimizer is b_opt[0] and not inside.is_set():
            inside.set()
            assert done.wait(60)

    results: dict = {}

    def b_job() -> None:
        model = mlp(1)
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        b_opt.append(opt)
        losses = []
        with NeuralDbg(model) as dbg:
            for x, y in batches(10, 1):
                opt.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                opt.step()
                losses.append(float(loss.detach()))
        results["b"] = (dbg, losses)

    def a_job() -> None:
        assert inside.wait(60)
        try:
            model = mlp(2)
            with NeuralDbg(model) as dbg:
                train(model, batches(5, 2))
            results["a"] = dbg
        finally:
            done.set()

    handle = register_optimizer_step_post_hook(users_hook)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", NeuralDbgWarning)
            threads = [threading.Thread(target=f) for f in (b_job, a_job)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(120)
    finally:
        handle.remove()
    assert set(results) == {"a", "b"}  # B's step went on (it raised in B's thread before)
    dbg, losses = results["b"]
    assert dbg.step == 10 and len(losses) == 10
    assert results["a"].step == 5


# --------------------------------------------------------------------------- torch.func


def test_functional_training_with_vmap_and_grad_is_observed_without_an_internal_error():
    from torch.func import functional_call, grad, vmap

    model = mlp()
    params = {k: v.detach() for k, v in model.named_parameters()}
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def loss_of(p, x, y):
        out = functional_call(model, p, (x.unsqueeze(0),))
        return nn.functional.mse_loss(out, y.unsqueeze(0))

    per_example = vmap(grad(loss_of), in_dims=(None, 0, 0))
    truth = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", NeuralDbgWarning)
        with NeuralDbg(model) as dbg:
            for x, y in batches(12):
                grads = per_example(params, x, y)
                opt.zero_grad()
                for name, p in model.named_parameters():
                    p.grad = grads[name].mean(0)
                truth.append(grad_norm(model[0]))
                opt.step()
    said = [str(w.message) for w in caught if issubclass(w.category, NeuralDbgWarning)]
    assert len(said) == 1 and "torch.func" in said[0], said  # what is not observed, once
    steps, values = dbg.history("0")
    assert dbg.step == 12 and list(steps) == list(range(12))
    np.testing.assert_allclose(values, truth, rtol=1e-5)


class SpectralConv(nn.Module):
    """A Fourier layer as Fourier neural operators write it: complex weights on the lowest
    modes of the signal's FFT."""

    def __init__(self, channels: int, modes: int) -> None:
        super().__init__()
        self.modes = modes
        self.weight = nn.Parameter(0.1 * torch.randn(channels, channels, modes, dtype=torch.cfloat))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        z = torch.einsum("bix,iox->box", torch.fft.rfft(x, dim=-1)[..., : self.modes], self.weight)
        return torch.fft.irfft(z, n=x.shape[-1], dim=-1)


@pytest.mark.parametrize("path", ["host", "deferred"])
def test_a_model_with_complex_weights_is_observed_at_every_step(path, monkeypatch):
    if path == "deferred":
        monkeypatch.setenv("NEURALDBG_DEVICE_PATH", "deferred")  # the CUDA path's CPU stand-in
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv1d(1, 4, 1), SpectralConv(4, 5), nn.GELU(), nn.Flatten(), nn.Linear(64, 1))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    truth = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)  # (an internal error would stop observing, with a warning)
        with NeuralDbg(model, activation_every=1, weight_every=1) as dbg:
            for x, y in batches(12):
                opt.zero_grad()
                nn.functional.mse_loss(model(x.reshape(-1, 1, 8).repeat(1, 1, 2)), y).backward()
                truth.append(float(model[1].weight.grad.abs().pow(2).sum().sqrt()))
                opt.step()
    assert dbg.step == 12
    steps, values = dbg.history("1")
    assert list(steps) == list(range(12))
    np.testing.assert_allclose(values, truth, rtol=1e-5)
    # (|w|, as torch's norm of a complex tensor)
    assert dbg.history("1", "weight_norm")[1][-1] == pytest.approx(float(model[1].weight.detach().norm()), rel=1e-5)


# ----------------------------------------------------------------- the fault-injection suite


def _fault_cases():
    """(entry, loop kind): a plain loop that reaches the entry point."""
    kinds = {
        "forward_pre": "tap",
        "forward_post": "tap",
        "backward_start": "tap",
        "backward_done": "tap",
        "optimizer_step": "tap",
        "record_loss": "record",
        "criterion": "criterion",
        "grad_ready": "criterion",
        "backward_end": "criterion",
        "loop_probe": "criterion",
        "scaler_step": "scaler",
        "scaler_step_done": "scaler",
        "exit": "tap",
    }
    return sorted(kinds.items())


FAULT_STEP = 6


def _plain_loop(kind: str, dbg_on: bool, entry=None, trace=None):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.MSELoss()
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**4) if kind == "scaler" else None
    options = {"criterion": criterion} if kind in ("criterion", "scaler") else {}
    dbg = NeuralDbg(model, trace=trace, **options) if dbg_on else None
    import contextlib

    with contextlib.ExitStack() as stack:
        if entry == "exit":
            stack.enter_context(fault_at(entry))  # (still active when the block exits)
        if dbg is not None:
            stack.enter_context(dbg)
        for step, (x, y) in enumerate(batches(16)):
            if step == FAULT_STEP and entry not in (None, "exit"):
                stack.enter_context(fault_at(entry))
            opt.zero_grad()
            loss = criterion(model(x), y)
            if dbg is not None and kind == "record":
                dbg.record_loss(loss)
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            else:
                loss.backward()
                opt.step()
    return model, dbg


def test_every_entry_point_is_covered_by_the_fault_suite():
    covered = {e for e, _ in _fault_cases()} | {"callback", "log_metrics"}
    assert covered == set(ENTRY_POINTS)


@pytest.mark.parametrize("entry,kind", _fault_cases())
def test_a_fault_in_a_plain_loop_switches_monitoring_off_and_training_goes_on(tmp_path, entry, kind):
    unwatched, _ = _plain_loop(kind, dbg_on=False)
    trace = tmp_path / "run.ndbg"
    with pytest.warns(NeuralDbgWarning, match=f"internal error in {entry}") as caught:
        watched, dbg = _plain_loop(kind, dbg_on=True, entry=entry, trace=trace)
    assert sum("stopped observing" in str(w.message) for w in caught) == 1, "one warning"
    for a, b in zip(unwatched.parameters(), watched.parameters()):
        assert torch.equal(a, b), "training went on exactly as without the debugger"
    assert no_hooks_left(watched)
    # What was observed before the fault is diagnosed, live and from the trace.
    run = neuraldbg.load(trace)
    steps, _ = run.history("0")
    assert list(steps) == list(range(len(steps)))
    if entry == "exit":
        assert len(steps) == 16  # every step observed; the fault came after them
    else:
        assert FAULT_STEP - 1 <= len(steps) <= FAULT_STEP + 1
    assert isinstance(run.explain_failure(), list) and isinstance(dbg.explain_failure(), list)


def test_the_halt_still_reaches_the_loop_through_the_guard():
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    with pytest.raises(neuraldbg.TrainingFailure), NeuralDbg(model, halt_on="non_finite"):
        for step, (x, y) in enumerate(batches(30)):
            if step == 5:
                x = x * float("nan")
            opt.zero_grad()
            nn.functional.mse_loss(model(x), y).backward()
            opt.step()


# ------------------------------------------------------- the deferred (CUDA) path, on the CPU


@pytest.mark.parametrize("how", ["submodule", "compiled"])
def test_the_deferred_path_hands_every_step_over(how, monkeypatch):
    """Where no forward pre-hook of the model runs in Python (its submodule is what the loop
    calls, or the hook is traced into a compiled graph), each step is handed over before the
    next replaces it."""
    model = mlp()
    run = model if how == "submodule" else torch.compile(model, backend="eager")
    outer = nn.Sequential(model) if how == "submodule" else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    truth = []
    monkeypatch.setenv("NEURALDBG_DEVICE_PATH", "deferred")  # the CUDA path's CPU stand-in
    with NeuralDbg(outer) as dbg:
        assert read_path(dbg) == "deferred"
        for x, y in batches(8):
            opt.zero_grad()
            nn.functional.mse_loss(run(x), y).backward()
            truth.append(grad_norm(model[0]))
            opt.step()
    name = "0.0" if how == "submodule" else "0"
    steps, values = dbg.history(name)
    assert list(steps) == list(range(8))
    np.testing.assert_allclose(values, truth, rtol=1e-5)


@pytest.mark.parametrize("path", ["deferred", "auto"])
def test_numbers_given_to_record_loss_stay_on_the_host(path, monkeypatch):
    """``dbg.record_loss(float)``: the step's loss, kept on the host (on a GPU a tensor made of
    it would be copied from pageable memory, a wait for the device's queue)."""
    monkeypatch.setenv("NEURALDBG_DEVICE_PATH", path)
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    seen = []
    with NeuralDbg(model) as dbg:
        for x, y in batches(6):
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            dbg.record_loss(float(loss) * 2.0)  # a number of the loop's own: it is the loss
            dbg.record_loss(loss.detach() * 3.0)  # and a tensor: the step's mean of both
            opt.step()
            seen.append(float(loss) * 2.5)
    steps, values = dbg.history(None, "loss")
    assert list(steps) == list(range(6))
    np.testing.assert_allclose(values, seen, rtol=1e-5)


def test_a_copy_the_device_has_not_finished_is_not_waited_for_at_the_forward(monkeypatch):
    """The GPU behind the CPU (its copy of the last step not done when the next forward
    starts): that step is handed over at the next step's observation instead, and no step is
    lost. A stand-in event says "not done" the first time it is asked."""
    from neuraldbg import _transfer

    class Event:
        made: List[Event] = []

        def __init__(self) -> None:
            self.asked = 0
            self.waited = 0
            Event.made.append(self)

        def query(self) -> bool:
            self.asked += 1
            return self.asked > 1

        def synchronize(self) -> None:
            self.waited += 1

    start = _transfer.HostCopy.start
    monkeypatch.setattr(_transfer.HostCopy, "start", lambda self, flat: (start(self, flat)[0], Event()))
    monkeypatch.setenv("NEURALDBG_DEVICE_PATH", "deferred")
    model = mlp()
    truth: List[list] = []
    with NeuralDbg(model) as dbg:
        train(model, batches(8), truth=truth, layers=["0"])
    steps, values = dbg.history("0")
    assert list(steps) == list(range(8))
    np.testing.assert_allclose(values, [t[0] for t in truth], rtol=1e-5)
    assert len(Event.made) == 8
    # Inside training nothing waited: each copy was done when its step was handed over (only the
    # last step's, handed over as the block exits, may be waited for).
    assert [e.waited for e in Event.made[:-1]] == [0] * 7


def test_step_on_backward_when_the_backward_ends_on_another_thread(monkeypatch):
    """On CUDA the end-of-backward callback runs on autograd's device thread: the step is
    observed back on the training thread (when ``backward()`` returns, or at the next forward),
    every step, with the same gradients. Here the callback is made to run on a thread of its own."""
    monkeypatch.setenv("NEURALDBG_DEVICE_PATH", "deferred")
    model = mlp()
    criterion = nn.MSELoss()
    threads: List[int] = []
    truth = []
    with NeuralDbg(model, step_on="backward", criterion=criterion) as dbg:
        c = dbg._collector
        queue = c._queue_callback

        def on_a_thread(callback):
            def run():
                t = threading.Thread(target=lambda: (threads.append(threading.get_ident()), callback()))
                t.start()
                t.join()

            queue(run)

        c._queue_callback = on_a_thread  # what CUDA's autograd does with the callback
        fed: List[int] = []

        class Engine:  # the engine, noting which thread calls it
            def __init__(self, engine):
                self.engine = engine

            def __getattr__(self, name):
                member = getattr(self.engine, name)
                if not callable(member):
                    return member

                def call(*args, **kwargs):
                    fed.append(threading.get_ident())
                    return member(*args, **kwargs)

                return call

        c.engine = Engine(c.engine)
        for x, y in batches(10):
            model.zero_grad()
            criterion(model(x), y).backward()
            truth.append(grad_norm(model[0]))
            with torch.no_grad():  # no torch optimizer: the reason for step_on="backward"
                for p in model.parameters():
                    p -= 0.05 * p.grad
    assert len(threads) == 10 and threading.get_ident() not in threads
    assert fed and set(fed) == {threading.get_ident()}, "the engine is called from the training thread only"
    steps, values = dbg.history("0")
    assert dbg.step == 10 and list(steps) == list(range(10))
    np.testing.assert_allclose(values, truth, rtol=1e-5)


def test_on_the_cuda_path_a_recorded_call_keeps_no_tensor(monkeypatch):
    """The CUDA path (its stand-in): a recorded layer's call is summarized on the device as it
    returns (the largest magnitude of its output, then of its input), and nothing of it is kept."""
    monkeypatch.setenv("NEURALDBG_DEVICE_PATH", "deferred")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(8, 16)
    with NeuralDbg(model) as dbg:
        for _ in range(3):
            opt.zero_grad()
            model(torch.randn(8, 16)).pow(2).mean().backward()
            opt.step()
        c = dbg._collector
        names = c.watched.names
        model.eval()
        with torch.no_grad():
            first = model[0](x)
            c.refs.clear()
            c.summaries.clear()
            model(x)
        assert [names[i] for i, _, _ in c.refs] == ["0", "1", "3", ""]
        assert all(out is None and args is None for _, out, args in c.refs)
        assert [names[i] for i, _, _ in c.summaries.calls] == ["0", "1", "3", ""]
        values = c.summaries.vector().numpy()
        assert values[0] == pytest.approx(float(first.abs().max()))
        assert values[1] == pytest.approx(float(x.abs().max()))


def _ctrl_c_in_the_fast_path_at_step_15(monkeypatch: Any) -> List[int]:
    """Plants a KeyboardInterrupt in ``HostReader.plain_done`` (Python code the extension's fast
    path calls during an optimizer step) at step 15, a step the fast path takes, once; returns
    the steps it fired at."""
    from neuraldbg._read_host import HostReader

    real = HostReader.plain_done
    fired: List[int] = []

    def plain_done(self: Any, pending: Any, step: int) -> bool:
        if step == 15 and not fired:
            fired.append(step)
            raise KeyboardInterrupt
        return real(self, pending, step)

    monkeypatch.setattr(HostReader, "plain_done", plain_done)
    torch.manual_seed(0)
    return fired


def _one_step(model: nn.Module, opt: torch.optim.Optimizer, x: torch.Tensor, y: torch.Tensor) -> None:
    opt.zero_grad()
    F.mse_loss(model(x), y).backward()
    opt.step()


def test_ctrl_c_landing_in_the_fast_path_stops_the_loop_with_the_diagnosis_kept(monkeypatch):
    """A Ctrl-C whose KeyboardInterrupt is raised inside Python code the extension's fast path
    calls ends the loop from that ``optimizer.step()``, the steps until it observed (before:
    taken for an internal error, it stopped monitoring and was swallowed, so Ctrl-C did not stop
    training; then re-signalled, which does nothing where SIGINT is ignored)."""
    fired = _ctrl_c_in_the_fast_path_at_step_15(monkeypatch)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    stepped: List[int] = []
    with warnings.catch_warnings(record=True) as said, pytest.raises(KeyboardInterrupt):
        warnings.simplefilter("always")
        with NeuralDbg(model) as dbg:
            for i in range(24):
                _one_step(model, opt, x, y)
                stepped.append(i)
    assert fired == [15] and stepped == list(range(15))
    assert not [w for w in said if issubclass(w.category, NeuralDbgWarning)], [str(w.message) for w in said]
    assert dbg.step == 16 and list(dbg.history("0")[0]) == list(range(16))


def test_a_loop_that_catches_a_ctrl_c_in_the_fast_path_and_trains_on_stays_observed(monkeypatch):
    """A loop that catches the KeyboardInterrupt of a Ctrl-C (a notebook cell's own handler, a
    "save and go on" loop) and trains on: the step the Ctrl-C cut short had reached the engine,
    so it counts, and the steps after it are observed (before: "step 15 is not after the last
    step", monitoring stopped)."""
    fired = _ctrl_c_in_the_fast_path_at_step_15(monkeypatch)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    interrupted: List[int] = []
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        with NeuralDbg(model) as dbg:
            for i in range(24):
                try:
                    _one_step(model, opt, x, y)
                except KeyboardInterrupt:
                    interrupted.append(i)
    assert fired == [15] and interrupted == [15]
    assert not [w for w in said if issubclass(w.category, NeuralDbgWarning)], [str(w.message) for w in said]
    assert dbg.step == 24 and list(dbg.history("0")[0]) == list(range(24))
