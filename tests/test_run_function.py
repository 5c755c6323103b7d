"""``neuraldbg.run(fn)``: a function that builds and trains, run, diagnosed and confirmed as
``neuraldbg run`` does a script.

The training functions live in a module written to a temporary folder (as a notebook's helper
file would be); ground truth is what each function returned itself (its own losses).
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any, Iterator, List

import pytest

import neuraldbg

TRAINING = """
    import torch, torch.nn as nn

    calls = []

    def train(lr=0.05, steps=15, raise_at=-1):
        calls.append(lr)
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        seen = []
        for step in range(steps):
            if step == raise_at:
                raise RuntimeError("planted failure in the function")
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            seen.append(loss.item())
        return seen

    def healthy():
        return train()

    def exploding():
        # lr 1.0 is 20x this regression's working 0.05: gradients explode within a few steps.
        return train(lr=1.0, steps=30)

    def raising():
        return train(raise_at=5)

    def by_hand(steps=15):
        # No optimizer: the weights updated in the loop itself.
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 1))
        x = torch.randn(64, 8); y = x.sum(1, keepdim=True)
        seen = []
        for step in range(steps):
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            with torch.no_grad():
                for p in model.parameters():
                    p -= 0.05 * p.grad
            model.zero_grad()
            seen.append(loss.item())
        return seen
"""


@pytest.fixture
def training(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ModuleType]:
    """The module of training functions, importable here and (through ``neuraldbg.run``) in the
    fresh processes of ``confirm=True``; the test's working folder is elsewhere."""
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "ndbg_training.py").write_text(textwrap.dedent(TRAINING))
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("PYTHONWARNINGS", "ignore")
    monkeypatch.syspath_prepend(str(tmp_path / "lib"))
    sys.modules.pop("ndbg_training", None)
    yield importlib.import_module("ndbg_training")
    sys.modules.pop("ndbg_training", None)


def test_a_function_is_run_watched_and_diagnosed_with_its_own_losses(training: ModuleType, tmp_path: Path) -> None:
    r = neuraldbg.run(training.healthy, out="o", quiet=True)
    losses = r.value
    assert isinstance(r, neuraldbg.RunResult) and len(losses) == 15
    assert r.steps == 15 and r.exit_code == 0 and r.exception is None and r.stopped is None
    (model,) = r.models
    assert model["name"] == "Sequential" and model["loss"] == pytest.approx(losses, rel=1e-6)
    assert r.traces == {"Sequential": str(Path("o", "Sequential.ndbg"))}
    assert (tmp_path / r.reports["Sequential"]).read_text().startswith("<!")
    loaded = r.load()
    assert loaded.step == 15 and list(loaded.history(None, "loss")[1]) == pytest.approx(losses, rel=1e-6)
    assert not [h for h in r.hypotheses if h["confidence"] >= 0.5]
    assert r.confirm is None and all("verdict" not in h for h in r.hypotheses)

    # steps=N stops the function cleanly at its Nth optimizer step; it returns nothing.
    stopped = neuraldbg.run(training.healthy, steps=7, out="s", quiet=True)
    assert stopped.steps == 7 and stopped.stopped == "--steps 7" and stopped.value is None
    assert stopped.exit_code == 0 and stopped.load().step == 7
    assert stopped.models[0]["loss"][:7] == pytest.approx(losses[:7], rel=1e-6)


def test_a_function_that_updates_its_weights_by_hand_is_watched_with_nothing_to_warn(training: ModuleType) -> None:
    # Its model is found at its first backward pass, after that iteration's forward: that
    # forward is not "a forward the hooks did not see" (it once said so).
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always", neuraldbg.NeuralDbgWarning)
        r = neuraldbg.run(training.by_hand, out="o", quiet=True)
    assert [str(w.message) for w in said if issubclass(w.category, neuraldbg.NeuralDbgWarning)] == []
    assert r.steps == 15 and r.models[0]["loss"] == pytest.approx(r.value, rel=1e-6)


def test_an_exception_in_the_function_is_kept_with_the_diagnosis(
    training: ModuleType, capsys: pytest.CaptureFixture[str]
) -> None:
    r = neuraldbg.run(training.raising, out="o")
    err = capsys.readouterr().err
    assert isinstance(r.exception, RuntimeError) and str(r.exception) == "planted failure in the function"
    assert r.exit_code == 1 and r.value is None and r.steps == 5
    assert "Traceback" in err and "ndbg_training.py" in err and "Sequential: 5 steps" in err
    assert r.load().step == 5


def test_confirm_reruns_the_function_fresh_and_confirms_the_planted_learning_rate(
    training: ModuleType, tmp_path: Path
) -> None:
    r = neuraldbg.run(training.exploding, confirm=True, confirm_top=5, jobs=2, out="o", quiet=True)
    assert r.steps == 30 and training.calls == [1.0]  # the re-runs were other processes
    top = r.hypotheses[0]
    assert top["cause"] == "learning_rate_too_high" and top["verdict"] == "confirmed", r.hypotheses
    assert top["intervention"].startswith("learning rate x0.1")
    assert top["evidence"]["failure_in_unchanged"] and not top["evidence"]["failure_recurred"]
    others = [h for h in r.hypotheses if h["cause"] not in ("learning_rate_too_high", "numerical_instability")]
    assert others and all(h["verdict"] in ("untested", "refuted", "inconclusive") for h in others), r.hypotheses
    # The unchanged re-run is the same training as the function's own run: same seeds, same losses.
    assert r.confirm is not None and r.confirm["runs"][0]["intervention"] is None
    unchanged = json.loads((tmp_path / "o" / "confirm" / "unchanged.json").read_text())
    finite = [v for v in r.value if v == v and abs(v) != float("inf")]
    assert unchanged["models"][0]["loss"][: len(finite)] == pytest.approx(finite, rel=1e-6)


def test_confirm_needs_a_function_a_fresh_process_can_import(training: ModuleType) -> None:
    called: List[Any] = []

    def nested() -> None:
        called.append(1)

    main: dict = {"__name__": "__main__", "called": called}
    exec("def cell():\n    called.append(1)\n", main)
    for fn in (nested, lambda: called.append(1), main["cell"]):
        with pytest.raises(neuraldbg.ConfigError, match="fresh processes"):
            neuraldbg.run(fn, confirm=True, quiet=True)
    assert not called  # refused before anything ran
    with pytest.raises(neuraldbg.ConfigError, match="cannot import"):
        neuraldbg.run("ndbg_no_such_module:train", quiet=True)
    import torch

    with pytest.raises(neuraldbg.ConfigError, match="as text"):
        neuraldbg.run(training.healthy, confirm=True, quiet=True, criterion=torch.nn.MSELoss())
    assert training.calls == []
    # By name, the same function runs (and could be re-run).
    assert neuraldbg.run("ndbg_training:healthy", steps=2, out="n", quiet=True).steps == 2
