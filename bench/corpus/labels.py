"""How a run of the mutation corpus is labelled: a mutant manifests when it loses more than a
quarter of what its base gained in held-out quality (accuracy or R^2, over chance), or when its
loss went non-finite or it crashed; it is then labelled with its planted causes, else healthy.

A mistake written in the program itself (an output that does not fit the loss, `.grad` never
zeroed, a layer that gets gradients but no optimizer step) is labelled with its cause whatever
the outcome: the issue asks for these to be named "even while the loss still falls", so a run
that hides them behind a good accuracy is not a healthy run to stay quiet on. Mutants whose
fault is a matter of degree (learning rate, initialization, activations, data scale) and
`eval()` mode (frozen BatchNorm statistics are also a fine-tuning practice) are labelled by their
outcome. ``quality-only`` labels every mutant by its outcome (the labelling before 2026-12-03).

``quality+loss`` also counts a mutant that loses more than a quarter of its base's gain in training
loss (on a log scale, from where the base's loss began, over the last tenth of the run): an
output that does not fit the loss can hold the loss far above its base's while the accuracy
stays. The loss is not compared for mutants that change its scale or its floor (raw targets,
label noise, a weight penalty in the loss)."""

from __future__ import annotations

import math
from typing import Dict, List, Optional

# A mutant manifests when it loses more than this share of its base's gain over chance.
MANIFEST_SHARE = 0.25
# Operators that change the training loss's scale (raw targets) or its floor (noisy labels): their
# loss says nothing against the base's.
LOSS_INCOMPARABLE = {"raw_targets", "label_noise", "labels_apart", "l2_penalty"}
# Operators that write a mistake into the program: labelled with their cause whatever the outcome.
PROGRAM_FAULTS = {
    "out_softmax",
    "out_relu",
    "out_sigmoid",
    "no_zero_grad",
    "zero_grad_late",
    "frozen_first",
    "loss_cut",
    "grads_negated",
}
CRITERIA = ("quality", "quality+loss", "quality-only")


def _tail(rec: Dict) -> Optional[float]:
    return rec.get("loss_tail", rec.get("loss_last"))


def loss_share(rec: Dict, base: Dict) -> Optional[float]:
    """The share of its base's training-loss gain the mutant kept, on a log scale from where the
    base's loss began (None where the loss says nothing: another scale or floor, no loss)."""
    if set(rec["ops"]) & LOSS_INCOMPARABLE or not rec["finite"]:
        return None
    start, end, mine = base.get("loss_first"), _tail(base), _tail(rec)
    if not (start and end and mine and start > end > 0 and mine > 0):
        return None
    return math.log(start / mine) / math.log(start / end)


def label(rec: Dict, base: Dict, criterion: str = "quality") -> None:
    """Sets `manifests` and `label` ('healthy' or the planted causes) against its base's run."""
    if not rec["ops"]:
        rec["manifests"], rec["label"] = False, ["healthy"]
        return
    gain = max(base["score"] - rec["chance"], 1e-6)
    bad = (not rec["finite"]) or rec["error"] is not None or rec["score"] < base["score"] - MANIFEST_SHARE * gain
    if criterion not in CRITERIA:
        raise ValueError(f"unknown criterion {criterion!r}: one of {', '.join(CRITERIA)}")
    if criterion == "quality+loss":
        share = loss_share(rec, base)
        bad = bad or (share is not None and share < 1.0 - MANIFEST_SHARE)
    written = [c for op, c in zip(rec["ops"], rec["causes"]) if op in PROGRAM_FAULTS]
    if criterion == "quality-only":
        written = []
    rec["manifests"] = bool(bad or written)
    rec["label"] = rec["causes"] if bad else (written or ["healthy"])


def relabel(records: List[Dict], criterion: str = "quality") -> None:
    """Labels every run of a corpus against the base run of its program and seed."""
    base_of = {(r["base"], r["seed"]): r for r in records if not r["ops"]}
    for r in records:
        label(r, base_of[(r["base"], r["seed"])], criterion)
