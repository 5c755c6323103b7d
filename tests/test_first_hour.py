"""The first hour of a new user (issue 25): each rough edge reproduced as it was met, in the REPL,
with ordinary mistakes, and in torchrun jobs (gloo on CPU, 2 processes, bounded in time)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import time
import warnings
from typing import Any, Dict, List

import numpy as np
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import neuraldbg
from neuraldbg import ConfigError, NeuralDbg, NeuralDbgWarning, UnknownNameError

HERE = os.path.dirname(os.path.abspath(__file__))


def deep_tanh(depth: int = 12, width: int = 16) -> nn.Sequential:
    torch.manual_seed(0)
    layers: List[nn.Module] = []
    for _ in range(depth):
        lin = nn.Linear(width, width)
        nn.init.normal_(lin.weight, std=0.05)  # gradients vanish along the depth
        layers += [lin, nn.Tanh()]
    layers.append(nn.Linear(width, 1))
    return nn.Sequential(*layers)


def train(model: nn.Module, steps: int, **options: Any) -> NeuralDbg:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model, **options) as dbg:
        for _ in range(steps):
            opt.zero_grad()
            nn.functional.mse_loss(model(torch.randn(16, 16)), torch.randn(16, 1)).backward()
            opt.step()
    return dbg


def test_hypotheses_print_as_one_line_each_and_repr_stays_short(capsys: Any) -> None:
    dbg = train(deep_tanh(), 20)
    hyps = dbg.explain_failure()
    assert hyps
    print(hyps)  # as the user did
    out = capsys.readouterr().out
    assert out.splitlines() == [str(h) for h in hyps]
    two = neuraldbg.Hypotheses([hyps[0], hyps[0]])
    print(two)
    assert capsys.readouterr().out.splitlines() == [str(hyps[0])] * 2
    assert all(len(repr(h)) < 200 and "\n" not in repr(h) for h in hyps)
    assert repr(hyps) == str(hyps)  # the REPL shows the same lines
    assert repr(hyps[0]).startswith("CausalHypothesis(failure=")
    events = dbg.events
    assert events and all(len(repr(e)) < 200 for e in events)
    print(events)
    assert len(capsys.readouterr().out) < 200 * len(events)
    assert str(neuraldbg.Hypotheses()) == "[]"


def test_a_trace_damaged_before_its_first_step_is_an_error_not_zero_steps(tmp_path: Any) -> None:
    path = tmp_path / "x.ndbg"
    train(deep_tanh(depth=2), 3, trace=path)
    data = bytearray(path.read_bytes())
    header_len = int.from_bytes(data[16:20], "little")
    data[16 + 12 + header_len + 4 + 20] ^= 0x55  # inside the first step's payload
    path.write_bytes(bytes(data))
    with pytest.raises(neuraldbg.TraceError, match="damaged before its first step"):
        neuraldbg.load(path)
    cli = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "explain", str(path)], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 3 and "before its first step" in cli.stderr, cli.stderr


def test_loaded_trace_counts_steps_as_the_live_debugger(tmp_path: Any) -> None:
    path = tmp_path / "run.ndbg"
    dbg = train(deep_tanh(), 60, trace=path)
    assert dbg.step == 60
    assert neuraldbg.load(path).step == 60


@pytest.mark.parametrize(
    "option, value, message",
    [
        ("threshold_vanishing", np.float32(1e-6), None),
        ("threshold_exploding", np.float64(1e4), None),
        ("persistence", np.int64(3), None),
        ("history_capacity", np.int32(64), None),
        ("threshold_vanishing", math.nan, "threshold_vanishing must be a number, got nan"),
        ("threshold_vanishing", np.float32("nan"), "threshold_vanishing must be a number, got nan"),
        ("hysteresis", math.inf, r"hysteresis must be a finite number \(default 2.0\), got inf"),
        ("persistence", 2.5, r"persistence must be a whole number .*got float 2.5"),
        ("history_capacity", -1, r"history_capacity must be an integer >= 0 \(default \d+\), got -1"),
        ("history_capacity", 8, r"history_capacity must be at least 16, got 8"),
        ("persistence", 2**40, r"persistence = 1099511627776: .*u32"),
        ("threshold_saturated", "1.0", "threshold_saturated must be a number, got str '1.0'"),
    ],
)
def test_options_name_the_option_the_value_and_the_range(option: str, value: Any, message: Any) -> None:
    model = deep_tanh(depth=2)
    if message is None:
        assert NeuralDbg(model, **{option: value}) is not None
        return
    with pytest.raises(ConfigError, match=message) as e:
        NeuralDbg(model, **{option: value})
    assert "line 1 column" not in str(e.value) and "JSON" not in str(e.value)


def noise_run(steps: int, spike_at: int | None = None) -> NeuralDbg:
    """A small MLP regressing pure noise (its loss stays near 1, the user's 500-step run); the
    learning rate is multiplied by 1000 at ``spike_at``."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    crit = nn.MSELoss()
    g = torch.Generator().manual_seed(1)
    with NeuralDbg(model, criterion=crit) as dbg:
        for step in range(steps):
            if step == spike_at:
                for group in opt.param_groups:
                    group["lr"] *= 1000
            opt.zero_grad()
            crit(model(torch.randn(16, 8, generator=g)), torch.randn(16, 1, generator=g)).backward()
            opt.step()
    return dbg


def test_a_noisy_flat_loss_gives_one_plateau_not_a_flip_flop() -> None:
    dbg = noise_run(500)
    loss = [e for e in dbg.events if e.layer_name == "(loss)"]
    assert 1 <= len(loss) <= 2, [str(e) for e in loss]
    assert loss[0].to_state == "PLATEAU"
    for a, b in zip(loss, loss[1:]):
        assert a.to_state == b.from_state and a.step < b.step, [str(e) for e in loss]


def test_a_plateau_sentence_quotes_its_own_steps_not_a_later_jump() -> None:
    dbg = noise_run(3000, spike_at=2000)
    plateau = [h for h in dbg.explain_failure() if h.failure == "loss_plateau"]
    assert plateau and plateau[0].step is not None and plateau[0].step < 2000
    # Figures from the steps it names: the loss before step 2,000 never jumped (noise), so no
    # "jumped to 4099x its best before it flattened".
    assert "jumped" not in plateau[0].description, plateau[0].description
    steps, values = dbg.history(None, "loss")
    assert float(np.nanmax(values[steps >= 2000])) > 100 * float(np.nanmax(values[steps < 2000]))


def test_the_notebook_display_is_no_larger_than_the_report() -> None:
    torch.manual_seed(0)
    model = nn.Sequential(*[m for _ in range(500) for m in (nn.Linear(4, 4), nn.ReLU())])  # 1,001 modules
    dbg = train_width(model, 5, width=4)
    page = dbg.report_html()
    shown = dbg._repr_html_()
    assert shown.startswith("<iframe") and len(shown) < len(page), (len(shown), len(page))
    hyps_shown = dbg.explain_failure()._repr_html_()
    assert hyps_shown is not None and len(hyps_shown) < len(page)


def train_width(model: nn.Module, steps: int, width: int) -> NeuralDbg:
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model) as dbg:
        for _ in range(steps):
            opt.zero_grad()
            model(torch.randn(8, width)).square().mean().backward()
            opt.step()
    return dbg


def test_save_report_creates_its_directory(tmp_path: Any) -> None:
    dbg = train(deep_tanh(depth=2), 5)
    path = tmp_path / "newdir" / "deeper" / "r.html"
    dbg.save_report(path)
    assert path.read_text(encoding="utf-8").startswith("<!DOCTYPE html>")


def test_history_errors_say_what_was_wrong_and_list_candidates() -> None:
    model = nn.Sequential()
    model.add_module("encoder", nn.Sequential(nn.Linear(16, 16), nn.ReLU()))
    model.add_module("head", nn.Linear(16, 1))
    dbg = train(model, 3)
    with pytest.raises(
        ConfigError, match=r"layer must be a qualified module name \(a str such as 'encoder.0'\).*int 0"
    ):
        dbg.history(0)  # type: ignore[arg-type]
    # An unknown name lists the model's names, the closest first (DDP's `module.` prefix...).
    with pytest.raises(UnknownNameError, match=r'unknown layer "0"; expected one of: "encoder.0", .*"head"'):
        dbg.history("0")
    # An activation module asked for a layer metric: the candidates, said once.
    with pytest.raises(UnknownNameError) as e:
        dbg.history("encoder.1")
    assert "one of: one of" not in str(e.value) and '"encoder.0", "head"' in str(e.value)
    with pytest.raises(UnknownNameError) as e:
        dbg.history("head", "dead_fraction")
    assert "one of: one of" not in str(e.value) and '"encoder.1"' in str(e.value)


def test_steps_not_observed_are_in_the_trace_and_load_says_so(tmp_path: Any) -> None:
    """Monitoring breaks at step 8 of 20 (an internal error, planted): training goes on, the
    trace records that steps 8 to 19 were not observed, and readers say so."""
    path = tmp_path / "gap.ndbg"
    model = deep_tanh(depth=2)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NeuralDbg(model, trace=path) as dbg:
            for step in range(20):
                if step == 8:

                    def broken(*a: Any, **k: Any) -> Any:
                        raise RuntimeError("planted internal error")

                    dbg._collector.reader.read_gradients = broken
                    dbg._collector.reader.plain = None  # (the extension's fast path reads them itself)
                    dbg._collector.reader.plain_optimizer = None
                opt.zero_grad()
                nn.functional.mse_loss(model(torch.randn(16, 16)), torch.randn(16, 1)).backward()
                opt.step()
    ours = [str(w.message) for w in caught if issubclass(w.category, NeuralDbgWarning)]
    assert len(ours) == 1 and "planted internal error" in ours[0], ours
    assert dbg.step == 20
    with pytest.warns(NeuralDbgWarning, match=r"steps 8 to 19 were not observed: .*planted internal error"):
        run = neuraldbg.load(path)
    assert run.step == 8 and run.closed
    assert len(run.unobserved) == 1 and run.unobserved[0].startswith("steps 8 to 19 were not observed")
    cli = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "explain", str(path)], capture_output=True, text=True, timeout=60
    )
    assert cli.returncode == 0 and "steps 8 to 19 were not observed" in cli.stderr, cli.stderr


# ------------------------------------------------------------------ torchrun mistakes

_MISTAKES = os.path.join(HERE, "distributed_mistakes.py")


def _torchrun(scenario: str, out: str, timeout: float = 120) -> Dict[str, Any]:
    """Runs one scenario of tests/distributed_mistakes.py as a 2-process torchrun job; returns
    what each rank reported and the job's wall time."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node=2",
        "--standalone",
        _MISTAKES,
        out,
        scenario,
    ]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
    wall = time.monotonic() - t0
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    ranks = []
    for r in range(2):
        with open(os.path.join(out, f"rank{r}.json")) as f:
            ranks.append(json.load(f))
    return {"wall": wall, "ranks": ranks, "stderr": proc.stderr}


def _plain_job_seconds(tmp_path_factory: Any) -> float:
    out = str(tmp_path_factory.mktemp("plain"))
    return float(_torchrun("plain", out)["wall"])


@pytest.fixture(scope="module")
def plain_seconds(tmp_path_factory: Any) -> float:
    return _plain_job_seconds(tmp_path_factory)


def _readable(path: str) -> neuraldbg.TraceRun:
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)  # damage would warn: fail instead
        return neuraldbg.load(path)


def test_distributed_off_with_one_trace_path(tmp_path: Any, plain_seconds: float) -> None:
    job = _torchrun("off_one_trace", str(tmp_path))
    assert job["wall"] < plain_seconds + 10
    r0, r1 = job["ranks"]
    assert len(r0["warnings"]) == 1 and "trace_rank=None" in r0["warnings"][0], r0
    assert r1["warnings"] == []
    run = _readable(os.path.join(str(tmp_path), "x.ndbg"))
    assert run.steps_observed == 12 and run.meta["rank"] == 0 and run.closed
    assert not os.path.exists(os.path.join(str(tmp_path), "x.rank1.ndbg"))
    # trace_rank=None: one readable trace per rank.
    job = _torchrun("off_per_rank", str(tmp_path))
    for r in range(2):
        run = _readable(os.path.join(str(tmp_path), f"y.rank{r}.ndbg"))
        assert run.steps_observed == 12 and run.meta["rank"] == r


def test_trace_rank_beyond_the_world(tmp_path: Any, plain_seconds: float) -> None:
    job = _torchrun("trace_rank_5", str(tmp_path))
    assert job["wall"] < plain_seconds + 10
    r0, r1 = job["ranks"]
    assert len(r0["warnings"]) == 1 and "trace_rank=5 is not a rank of this job (ranks 0 to 1)" in r0["warnings"][0]
    assert r1["warnings"] == []
    run = _readable(os.path.join(str(tmp_path), "x.ndbg"))
    assert run.steps_observed == 12 and run.meta["world_size"] == 2


def test_block_entered_on_rank_0_only(tmp_path: Any, plain_seconds: float) -> None:
    job = _torchrun("rank0_only", str(tmp_path))
    # The wait at __enter__ is bounded (3 s here: min(10 s, distributed_timeout)), not 60 s.
    assert job["wall"] < plain_seconds + 10, job["wall"]
    r0, r1 = job["ranks"]
    assert r0["loop_steps"] == r1["loop_steps"] == 12
    assert len(r0["warnings"]) == 1, r0
    assert "rank 1 did not enter its `with NeuralDbg(...)` block" in r0["warnings"][0]
    assert "Every rank of the job must enter the block" in r0["warnings"][0]
    run = _readable(os.path.join(str(tmp_path), "x.ndbg"))
    assert run.steps_observed == 12 and run.closed


def test_a_rank_that_raises_and_lives_on_is_named_and_the_gap_recorded(tmp_path: Any) -> None:
    job = _torchrun("raises_lives_on", str(tmp_path))
    r0, r1 = job["ranks"]
    assert r0["loop_steps"] == 20 and r1["loop_steps"] == 8
    assert r0["seconds"] < 15, r0  # not the 60 s collective timeout
    assert len(r0["warnings"]) == 1, r0
    w = r0["warnings"][0]
    assert "rank 1 left its `with NeuralDbg(...)` block after step 8 (it raised KeyError('planted'))" in w, w
    assert "internal error" not in w
    with pytest.warns(NeuralDbgWarning, match="were not observed: rank 1 left"):
        run = neuraldbg.load(os.path.join(str(tmp_path), "x.ndbg"))
    assert run.closed and run.step < 20
    assert len(run.unobserved) == 1
    assert run.unobserved[0].startswith(f"steps {run.step} to 19 were not observed: rank 1 left its"), run.unobserved
    cli = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "explain", os.path.join(str(tmp_path), "x.ndbg")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert f"steps {run.step} to 19 were not observed" in cli.stderr, cli.stderr


# ------------------------------------------------------------------ the report in a browser


@pytest.fixture(scope="module")
def chromium() -> str:
    from bench import browser

    found = browser.find_chromium()
    if found is None:
        if os.environ.get("NEURALDBG_CHROMIUM"):
            pytest.fail("NEURALDBG_CHROMIUM is set but not found")
        pytest.skip("no Chromium on PATH (make browser installs Debian's chromium)")
    return found


def test_report_legend_threshold_labels_do_not_touch(tmp_path: Any, chromium: str) -> None:
    from bench import browser

    path = tmp_path / "r.html"
    train(deep_tanh(), 10).save_report(path)  # default thresholds: 1e-6, 1 and 1e3
    for width in (1280, 900):
        boxes = browser.layout(chromium, path, width=width)["thresholds"]
        assert len(boxes) == 3
        boxes.sort(key=lambda b: b["left"])
        for a, b in zip(boxes, boxes[1:]):
            assert a["left"] + a["width"] + 4 <= b["left"], (width, boxes)


def test_a_relu_root_after_the_last_layer_keeps_its_label_off_the_axis(tmp_path: Any, chromium: str) -> None:
    """The root is the output ReLU (no heatmap row of its own, after the last row): its label
    stays beside the map, clear of the step axis below it."""
    from bench import browser

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4), nn.ReLU())
    with torch.no_grad():
        model[4].bias.fill_(-10.0)  # every output unit dead
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with NeuralDbg(model) as dbg:
        for _ in range(20):
            opt.zero_grad()
            nn.MSELoss()(model(torch.randn(32, 16)), torch.randn(32, 4)).backward()
            opt.step()
    top = dbg.explain_failure()[0]
    assert (str(top.failure), top.layer) == ("dead_neurons", "5")
    path = tmp_path / "r.html"
    dbg.save_report(path)
    layout = browser.layout(chromium, path)
    _, plot_top, _, plot_h = layout["heatmap_plot"]
    y = layout["root_label"]
    assert plot_top + 6 <= y <= plot_top + plot_h - 6, layout


def test_a_loop_without_optimizer_step_is_told_it_did_not_train(tmp_path: Any) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    with (
        pytest.warns(NeuralDbgWarning, match=r"no optimizer.step\(\) on its parameters followed: it did not train"),
        NeuralDbg(model, trace=str(tmp_path / "t.ndbg")) as dbg,
    ):
        for _ in range(5):
            model.zero_grad()
            model(x).pow(2).mean().backward()
    assert model[0].weight.grad is not None and dbg.step == 0
    steps, loss = dbg.history(None, "loss")
    assert len(steps) == 0 and len(loss) == 0, "a run of no step has an empty history"
    with pytest.raises(UnknownNameError, match="no training step was observed"):
        dbg.history("0")
    assert dbg._untrained is not None and dbg._untrained.startswith("backward passes gave Sequential gradients")


def test_a_loop_whose_gradients_never_reach_grad_is_told_what_is_read() -> None:
    # A meta-learning style loop: torch.autograd.grad and an update by hand, no .grad at all.
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    with (
        pytest.warns(NeuralDbgWarning, match=r"ran 5 forward passes with gradients on, but no backward pass reached"),
        NeuralDbg(model) as dbg,
    ):
        for _ in range(5):
            grads = torch.autograd.grad(model(x).pow(2).mean(), list(model.parameters()))
            with torch.no_grad():
                for p, g in zip(model.parameters(), grads):
                    p -= 0.1 * g
    assert dbg.step == 0 and model[0].weight.grad is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)
        with NeuralDbg(model), torch.no_grad():
            model(x)  # evaluation alone: nothing to say


@pytest.mark.parametrize("cut", ["item", "detach"])
def test_a_loss_cut_from_the_models_output_is_named(cut: str) -> None:
    # The loss rebuilt from a Python float, or computed on a detached output: backward() runs,
    # reaches no parameter, and Adam skips every parameter (no .grad).
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1024, 20, generator=g)
    y = (x @ torch.randn(20, 5, generator=g)).argmax(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(20, 64), nn.ReLU(), nn.Linear(64, 5))
    before = [p.detach().clone() for p in model.parameters()]
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    with NeuralDbg(model) as dbg:
        for _ in range(3):
            for i in range(0, 1024, 64):
                opt.zero_grad()
                out = model(x[i : i + 64])
                if cut == "item":
                    loss = torch.tensor(nn.functional.cross_entropy(out, y[i : i + 64]).item(), requires_grad=True)
                else:
                    loss = nn.functional.cross_entropy(out.detach().requires_grad_(), y[i : i + 64])
                loss.backward()
                opt.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters())), "nothing trained"
    top = dbg.explain_failure()[0]
    assert (top.failure, top.cause) == ("stalled_layer", "parameters_not_updated"), top
    assert top.confidence >= 0.8, top
    assert "the optimizer stepped 48 times, but no parameter received a gradient" in " ".join(top.description.split())
    assert "no .item(), .detach()" in top.remedies[0], top.remedies


def test_a_frozen_model_watched_while_its_head_trains_is_told_it_has_nothing_that_trains() -> None:
    """A pretrained backbone frozen and watched by mistake, the loop training a head of its
    own: the run ends with no step, and the warning says why (before: "no backward pass reached
    its parameters' .grad ... torch.autograd.grad(...) are not seen", which is not this loop)."""
    torch.manual_seed(0)
    backbone = nn.Sequential(nn.Linear(4, 8), nn.ReLU()).requires_grad_(False)
    head = nn.Linear(8, 1)
    opt = torch.optim.SGD(head.parameters(), lr=0.1)
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    with (
        pytest.warns(
            NeuralDbgWarning, match=r"Sequential has no parameter that requires a gradient .*NeuralDbg\(head\)"
        ),
        NeuralDbg(backbone) as dbg,
    ):
        for _ in range(5):
            opt.zero_grad()
            F.mse_loss(head(backbone(x)), y).backward()
            opt.step()
    assert dbg.step == 0 and head.weight.grad is not None


def _foreign(module: str) -> Any:
    """An instance of a class defined in ``module`` (another framework's model, as its type says)."""
    return type("Model", (), {"__module__": module})()


@pytest.mark.parametrize(
    "model, says",
    [
        ([torch.zeros(784, 10, requires_grad=True), torch.zeros(10, requires_grad=True)], "bare tensors have none"),
        (torch.zeros(3, requires_grad=True), "bare tensors have none"),
        ({"w": torch.zeros(3, requires_grad=True)}, "bare tensors have none"),
        ([nn.Linear(2, 2), nn.Linear(2, 2)], "NeuralDbg(torch.nn.ModuleList([encoder, decoder]))"),
        (_foreign("flax.nnx.nn.linear"), "from neuraldbg.jax import NeuralDbg"),
        (_foreign("keras.src.models.sequential"), "neuraldbg.keras.NeuralDbgCallback()"),
    ],
    ids=["tensor_list", "tensor", "tensor_dict", "module_list", "flax", "keras"],
)
def test_what_is_not_a_torch_module_is_told_what_to_watch_instead(model: Any, says: str) -> None:
    # A first hour: the tensors of "What is torch.nn really?", [encoder, decoder], a flax or
    # Keras model given to the PyTorch debugger.
    with pytest.raises(neuraldbg.ModelError, match="NeuralDbg watches a torch.nn.Module, got") as e:
        NeuralDbg(model)
    assert says in str(e.value), e.value


def test_modules_trained_together_are_watched_as_one_module_list() -> None:
    # What the message above says to do, done: an encoder and a decoder called one after the
    # other, never a model of both.
    torch.manual_seed(0)
    enc, dec = nn.Sequential(nn.Linear(8, 4), nn.Tanh()), nn.Linear(4, 8)
    opt = torch.optim.Adam([*enc.parameters(), *dec.parameters()], 1e-2)
    x = torch.randn(64, 8)
    truth = []
    with warnings.catch_warnings():
        warnings.simplefilter("error", NeuralDbgWarning)
        with NeuralDbg(nn.ModuleList([enc, dec])) as dbg:
            for i in range(12):
                batch = x.clone()
                if i == 7:
                    batch[2, 2] = float("nan")
                loss = ((dec(enc(batch)) - batch) ** 2).mean()
                opt.zero_grad()
                loss.backward()
                truth.append(math.hypot(float(dec.weight.grad.norm()), float(dec.bias.grad.norm())))
                opt.step()
    assert dbg.step == 12
    steps, norms = dbg.history("1")  # the decoder's gradient norms
    assert list(steps) == list(range(12))
    np.testing.assert_allclose(norms[:7], truth[:7], rtol=1e-5)
    top = dbg.explain_failure()[0]
    assert (top.failure.value, top.cause.value, top.step) == ("data_anomaly", "bad_input_data", 7), top
