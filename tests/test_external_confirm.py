"""bench/external_confirm.py's pieces: the importable functions the ``--confirm`` re-runs call
train each program as the scoreboard does, and the totals count what they say they count."""

from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch
from bench.external import all_programs
from bench.external.common import train
from bench.external.targets import function_name
from bench.external_confirm import after_verdicts, assess, totals

from neuraldbg._function import resolve


def test_every_program_is_importable_by_name_and_trains_as_the_scoreboard_does() -> None:
    programs = all_programs()
    names = {function_name(p, b) for p in programs for b in (True, False)}
    assert len(names) == 2 * len(programs)
    for p in programs:
        for buggy in (True, False):
            fn = resolve(f"bench.external.targets:{function_name(p, buggy)}")
            assert fn.__module__ == "bench.external.targets" and fn.__qualname__ == function_name(p, buggy)
    # A small program whose initial weights come from torch's generator, both ways: the
    # scoreboard seeds just before the build.
    p = next(p for p in programs if p.name == "tpb/IPS-13_logreg_heart")
    threads = torch.get_num_threads()
    try:
        for buggy in (True, False):
            torch.manual_seed(0)
            expected = train(p.build(buggy, None)).losses
            torch.manual_seed(123)  # the function seeds for itself
            got = resolve(f"bench.external.targets:{function_name(p, buggy)}")().losses
            assert len(expected) > 0
            assert [repr(v) for v in got] == [repr(v) for v in expected]  # bit for bit, nan included
    finally:
        torch.set_num_threads(threads)


def _h(cause: str, confidence: float, verdict: Optional[str]) -> Dict[str, Any]:
    h: Dict[str, Any] = {"failure": "f", "cause": cause, "confidence": confidence}
    if verdict is not None:
        h["verdict"] = verdict
    return h


def _row(variant: str, cause: Optional[str], hyps: List[Dict[str, Any]], also: tuple = ()) -> Dict[str, Any]:
    return {"variant": variant, "cause": cause, "also": list(also), "hypotheses": hyps}


def test_top_after_verdicts_is_the_first_confirmed_else_the_most_confident() -> None:
    # As --confirm leaves them: the confirmed moved first.
    hyps = [_h("dying_relu", 0.3, "confirmed"), _h("learning_rate_too_high", 0.8, "refuted")]
    assert after_verdicts(hyps)["cause"] == "dying_relu"
    a = assess(_row("buggy", "learning_rate_too_high", hyps))
    assert a["top"]["cause"] == "learning_rate_too_high" and a["verdict"] == "refuted"
    assert a["top_names_cause"] and not a["after_names_cause"] and not a["cause_confirmed"]
    assert after_verdicts([_h("a", 0.2, "inconclusive"), _h("b", 0.7, "untested")])["cause"] == "b"
    assert after_verdicts([]) is None


def test_totals() -> None:
    rows = [
        # Detected, confirmed, names the label through `also`.
        _row(
            "buggy",
            "learning_rate_too_high",
            [_h("numerical_instability", 0.9, "confirmed")],
            ("numerical_instability",),
        ),
        # Detected, confirmed, names another cause; the label is confirmed at rank 2.
        _row(
            "buggy",
            "bad_input_data",
            [_h("learning_rate_too_high", 0.6, "confirmed"), _h("bad_input_data", 0.4, "confirmed")],
        ),
        # Detected, refuted; a low-confidence confirmed hypothesis of the label goes first after verdicts.
        _row(
            "buggy",
            "poor_initialization",
            [_h("poor_initialization", 0.2, "confirmed"), _h("dying_relu", 0.7, "refuted")],
        ),
        # Confirmed top, but the label has no name in the vocabulary: not in the precision.
        _row("buggy", None, [_h("learning_rate_too_high", 0.95, "confirmed")]),
        # Not detected (top below 0.5), nothing confirmed.
        _row("buggy", "output_loss_mismatch", [_h("unknown", 0.09, "untested")]),
        # Fixed: a false alarm that is not confirmed, and a quiet one with a confirmed remedy.
        _row("fixed", None, [_h("bad_input_data", 0.93, "inconclusive")]),
        _row("fixed", None, [_h("learning_rate_too_low", 0.1, "confirmed")]),
        _row("fixed", None, []),
    ]
    t = totals(rows)
    assert (t["buggy"], t["labelled"], t["detected"]) == (5, 4, 4)
    assert t["top_verdicts"] == {"confirmed": 3, "refuted": 1, "inconclusive": 0, "untested": 0}
    assert (t["top_confirmed_labelled"], t["top_confirmed_names_cause"]) == (2, 1)
    assert t["cause_confirmed_any_rank"] == 3
    assert (t["plain_names_cause"], t["after_names_cause"]) == (1, 2)
    assert t["confirmed_any_rank"] == 4
    assert (t["fixed"], t["fixed_confirmed"], t["fixed_alarms"]) == (3, 1, 1)
