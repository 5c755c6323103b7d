"""``--confirm``'s bookkeeping between the re-runs and the verdicts, with the re-runs replaced
by their ``--json`` objects (the re-runs themselves: tests/test_run_command.py)."""

from __future__ import annotations

import json
from typing import Any, Dict, List, Optional, Tuple

from neuraldbg._confirm import Confirm, remedy_for


def _h(failure: str, cause: str, confidence: float, layer: Optional[str] = None) -> Dict[str, Any]:
    return {"model": "Net", "failure": failure, "cause": cause, "layer": layer, "step": 3, "confidence": confidence}


def _run(
    loss: float, hyps: List[Dict[str, Any]], applied: Optional[List[str]] = None, trace: str = "/nonexistent.ndbg"
) -> Dict[str, Any]:
    return {
        "models": [{"name": "Net", "loss_steps": list(range(20)), "loss": [loss] * 20, "trace": trace}],
        "hypotheses": hyps,
        "applied": applied or [],
        "process_exit": 0,
        "log": "x.log",
    }


class _Replayed(Confirm):
    """A Confirm whose children are looked up by remedy instead of run: records what it ran."""

    def __init__(self, by_kind: Dict[Optional[str], Dict[str, Any]]) -> None:
        super().__init__(("script", "train.py"), [], [], None, 3, 1, 0, {})
        self.by_kind = by_kind
        self.ran: List[Tuple[str, Optional[Dict[str, Any]]]] = []

    def _run_child(self, cmd: List[str], folder: str) -> Dict[str, Any]:
        spec = json.loads(cmd[cmd.index("--apply") + 1]) if "--apply" in cmd else None
        self.ran.append((folder, spec))
        return json.loads(json.dumps(self.by_kind[None if spec is None else spec["kind"]]))


def test_remedies_that_ignore_the_layer_are_one_run_and_layered_ones_are_not() -> None:
    a = remedy_for(_h("exploding_gradients", "learning_rate_too_high", 0.9, "outputs"))
    b = remedy_for(_h("loss_divergence", "learning_rate_too_high", 0.6, None))
    assert a == b and a is not None and a["kind"] == "lr_scale"
    c = remedy_for(_h("dead_neurons", "poor_initialization", 0.9, "fc1"))
    d = remedy_for(_h("dead_neurons", "poor_initialization", 0.9, "fc2"))
    assert c != d and c is not None and c["layer"] == "fc1"


def test_one_re_run_gives_one_verdict_on_its_cause(tmp_path: Any) -> None:
    # The first run blames a too-high learning rate for an explosion (at a layer) and for a
    # diverging loss; a lower rate stops the explosion but the loss still diverges.
    first = _run(
        1e5,
        [
            _h("exploding_gradients", "learning_rate_too_high", 0.96, "outputs"),
            _h("loss_divergence", "learning_rate_too_high", 0.59),
            _h("loss_divergence", "unknown", 0.28),
        ],
        trace=str(tmp_path / "Net.ndbg"),
    )
    first["steps"] = 20
    unchanged = _run(
        1e5,
        [
            _h("exploding_gradients", "learning_rate_too_high", 0.96),
            _h("loss_divergence", "learning_rate_too_high", 0.6),
        ],
    )
    slower = _run(10.0, [_h("loss_divergence", "learning_rate_too_high", 0.7)], ["learning rate x0.1 in Adam"])
    confirm = _Replayed({None: unchanged, "lr_scale": slower})
    confirm.run(first, str(tmp_path))

    assert [spec["kind"] if spec else None for _, spec in confirm.ran] == [None, "lr_scale"]
    got = {(h["failure"], h["cause"]): h for h in first["hypotheses"]}
    explosion = got[("exploding_gradients", "learning_rate_too_high")]
    divergence = got[("loss_divergence", "learning_rate_too_high")]
    assert divergence["verdict"] == "refuted" and divergence["evidence"]["failure_recurred"]
    # Its own failure did not recur and the loss beat the unchanged re-run, but the run that
    # says so also says the cause's other failure came back: refuted too, saying which.
    assert not explosion["evidence"]["failure_recurred"]
    assert explosion["evidence"]["loss"] < explosion["evidence"]["loss_unchanged"]
    assert explosion["verdict"] == "refuted" and explosion["evidence"]["also_recurred"] == ["loss_divergence"]
    assert got[("loss_divergence", "unknown")]["verdict"] == "untested"

    # The same first run, and a remedy after which neither failure recurs: both confirmed.
    for h in first["hypotheses"]:
        for k in ("verdict", "intervention", "evidence"):
            h.pop(k, None)
    first.pop("confirm", None)
    healed = _run(0.5, [], ["learning rate x0.1 in Adam"])
    _Replayed({None: unchanged, "lr_scale": healed}).run(first, str(tmp_path))
    verdicts = {(h["failure"], h["cause"]): h["verdict"] for h in first["hypotheses"]}
    assert verdicts[("exploding_gradients", "learning_rate_too_high")] == "confirmed"
    assert verdicts[("loss_divergence", "learning_rate_too_high")] == "confirmed"


def test_a_remedy_that_changed_nothing_refutes_nothing(tmp_path: Any) -> None:
    # A layer re-initialized to the values it already had: the re-run's loss curve is the
    # unchanged re-run's, step for step, and its failure recurs; that tested nothing.
    first = _run(
        2.2, [_h("vanishing_gradients", "poor_initialization", 0.95, "norm")], trace=str(tmp_path / "Net.ndbg")
    )
    first["steps"] = 20
    unchanged = _run(2.2, [_h("vanishing_gradients", "poor_initialization", 0.95, "norm")])
    same = _run(2.2, [_h("vanishing_gradients", "poor_initialization", 0.95, "norm")], ["norm re-initialized"])
    _Replayed({None: unchanged, "reinit": same}).run(first, str(tmp_path))
    h = first["hypotheses"][0]
    assert h["evidence"]["failure_recurred"] and h["verdict"] == "untested", h
    assert "exactly as in the unchanged re-run" in h["evidence"]["why"]
    # One step different and the recurrence counts again.
    for h in first["hypotheses"]:
        for k in ("verdict", "intervention", "evidence"):
            h.pop(k, None)
    other = _run(2.2, [_h("vanishing_gradients", "poor_initialization", 0.95, "norm")], ["norm re-initialized"])
    other["models"][0]["loss"][7] = 2.3
    _Replayed({None: unchanged, "reinit": other}).run(first, str(tmp_path))
    assert first["hypotheses"][0]["verdict"] == "refuted"
