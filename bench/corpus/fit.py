#!/usr/bin/env python3
"""Fits the causes' evidence weights on the mutation corpus and reports how well they rank.

A multinomial logistic model (numpy, L2-regularised, full-batch gradient descent) predicts the
planted cause of a run, or ``healthy``, from the engine's own evidence features (what
``Engine.evidence_json`` exports: every candidate cause's evidence score for the run's primary
failure episode, that failure, how likely it is to be real, and the run-wide facts the rules
weigh). Runs of the held-out base programs (``--held-out``) are never used in fitting; neither is
the external suite (``--external``, written by ``bench/external_scoreboard.py --evidence``).

Reported for the held-out bases, next to the engine's current ranking on the same runs:
- planted cause top: among mutants that manifest, the top prediction is a planted cause (the
  engine's: its top hypothesis at confidence >= 0.5 names it);
- healthy quiet: among healthy runs (bases, and mutants that train as well as their base), no
  prediction of a failure at 0.5 or above;
- a reliability table: predictions binned by confidence, with how often they were right.

    .venv/bin/python bench/corpus/fit.py runs/corpus/corpus.jsonl [--external runs/corpus/external.jsonl] \\
        [--table bench/corpus/fitted_table.json]
    .venv/bin/python bench/corpus/fit.py runs/corpus/new.jsonl --compare runs/corpus/old.jsonl
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from typing import Dict, List, Optional, Sequence, Tuple

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

from bench.corpus.labels import CRITERIA, relabel

CAUSES = [
    "dying_relu",
    "saturating_activation",
    "learning_rate_too_high",
    "learning_rate_too_low",
    "poor_initialization",
    "network_depth",
    "missing_normalization",
    "bad_input_data",
    "numerical_instability",
    "missing_zero_grad",
    "parameters_not_updated",
    "eval_mode",
    "output_loss_mismatch",
    "target_shape_mismatch",
    "over_regularization",
    "output_ignores_input",
    "flipped_update_sign",
    "batch_axis_mismatch",
    "sequence_start_readout",
    "unknown",
]
FAILURES = [
    "vanishing_gradients",
    "exploding_gradients",
    "saturated_gradients",
    "saturated_activations",
    "dead_neurons",
    "non_finite",
    "data_anomaly",
    "loss_divergence",
    "loss_plateau",
    "stalled_layer",
    "replica_divergence",
    "loss_scale_collapse",
]
# Score of a cause that is not a candidate for the failure (below every candidate's prior).
ABSENT = -3.0
HELD_OUT = ("gru_regression", "cnn_batchnorm", "lora")


def _log(v: Optional[float]) -> float:
    return math.log10(v) if isinstance(v, (int, float)) and v > 0 and math.isfinite(v) else 0.0


def _num(v: Optional[float]) -> float:
    return float(v) if isinstance(v, (int, float)) and math.isfinite(v) else 0.0


RUN_FEATURES = [
    ("log10_lr", lambda r: _log(r.get("lr_first"))),
    ("init_error", lambda r: _num(r.get("init_error"))),
    ("act_attenuation", lambda r: _num(r.get("act_attenuation"))),
    ("log10_update_ratio", lambda r: _log(r.get("update_ratio"))),
    ("log10_input_scale", lambda r: _log(r.get("input_scale_first"))),
    ("log10_loss_peak_ratio", lambda r: _log(r.get("loss_peak_ratio"))),
    ("log10_loss_initial", lambda r: _log(r.get("loss_initial"))),
    ("depth", lambda r: _num(r.get("depth"))),
    ("has_norm", lambda r: 1.0 if r.get("has_norm") else 0.0),
    ("log10_gain_median", lambda r: _log(r.get("gain_median"))),
    ("log10_total_early", lambda r: _log(r.get("total_early"))),
    ("profile_span", lambda r: _num((r.get("profile") or {}).get("span"))),
    ("slope_first", lambda r: _num(r.get("slope_first"))),
    ("forward_jump", lambda r: _num((r.get("forward") or {}).get("jump"))),
]

FEATURE_NAMES = (
    [f"score:{c}" for c in CAUSES]
    + [f"failure:{f}" for f in FAILURES]
    + ["p_failure", "episodes_real", "no_episode"]
    + [n for n, _ in RUN_FEATURES]
)


def primary_episode(evidence: Dict, hypotheses: Sequence[Dict]) -> Optional[Dict]:
    """The episode of the top hypothesis, else the most probable root episode."""
    eps = evidence.get("episodes") or []
    if hypotheses:
        h = hypotheses[0]
        for e in eps:
            if e["failure"] == h["failure"] and e["onset"] == h["step"] and e["layer"] == h["layer"]:
                return e
    roots = [e for e in eps if e.get("explained_by") is None]
    return max(roots, key=lambda e: e["p_failure"], default=None)


def features(evidence: Dict, hypotheses: Sequence[Dict]) -> np.ndarray:
    x: List[float] = []
    e = primary_episode(evidence, hypotheses)
    scores = {c["cause"]: c["score"] for c in (e or {}).get("causes", [])}
    x += [_num(scores[c]) if c in scores else ABSENT for c in CAUSES]
    x += [1.0 if e is not None and e["failure"] == f else 0.0 for f in FAILURES]
    eps = evidence.get("episodes") or []
    x += [
        _num(e["p_failure"]) if e else 0.0,
        math.log1p(sum(1 for o in eps if o["p_failure"] >= 0.5)),
        1.0 if e is None else 0.0,
    ]
    run = evidence.get("run") or {}
    x += [f(run) for _, f in RUN_FEATURES]
    return np.array(x, dtype=np.float64)


def load(path: str) -> List[Dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


class Softmax:
    """Multinomial logistic regression over standardized features."""

    def __init__(self, classes: List[str], l2: float = 1e-2) -> None:
        self.classes = classes
        self.l2 = l2

    def fit(self, x: np.ndarray, y: np.ndarray, w: np.ndarray, iters: int = 4000, lr: float = 0.5) -> Softmax:
        """`y`: (n, C) target distributions (a pair mutant splits its mass over its causes);
        `w`: per-sample weights."""
        self.mean = x.mean(0)
        self.std = np.where(x.std(0) > 1e-9, x.std(0), 1.0)
        z = (x - self.mean) / self.std
        _n, d = z.shape
        c = y.shape[1]
        self.W = np.zeros((d, c))
        self.b = np.zeros(c)
        wsum = w.sum()
        for _ in range(iters):
            p = self._softmax(z @ self.W + self.b)
            g = (p - y) * w[:, None] / wsum
            self.W -= lr * (z.T @ g + self.l2 * self.W)
            self.b -= lr * g.sum(0)
        return self

    @staticmethod
    def _softmax(a: np.ndarray) -> np.ndarray:
        a = a - a.max(1, keepdims=True)
        e = np.exp(a)
        return e / e.sum(1, keepdims=True)

    def predict(self, x: np.ndarray) -> np.ndarray:
        return self._softmax(((x - self.mean) / self.std) @ self.W + self.b)

    def table(self) -> Dict:
        return {
            "features": FEATURE_NAMES,
            "classes": self.classes,
            "mean": self.mean.round(6).tolist(),
            "std": self.std.round(6).tolist(),
            "weights": self.W.round(6).tolist(),
            "bias": self.b.round(6).tolist(),
        }


class CauseScales:
    """The engine's own ranking with fitted numbers: within the primary episode, each named
    cause's evidence (its score above the engine's prior) times a scale per cause, plus an
    offset per cause, ranked by the engine's softmax (temperature 1/1.5, ``unknown`` as
    exported). Two numbers a cause, L2-regularised towards the engine's (scale 1, offset 0):
    the smallest change of the hand-set weights a fit can make, and the one the engine could
    hold as a table. Fitted by gradient descent on the mutants that manifest (their planted
    causes' probability)."""

    PRIOR = 1.5  # the engine's NAMED_PRIOR: every named cause's score starts this far below unknown
    T = 1.5

    def __init__(self, l2: float = 3e-2) -> None:
        self.l2 = l2
        self.named = [c for c in CAUSES if c != "unknown"]
        self.is_named = np.array([c != "unknown" for c in CAUSES])
        self.log_scale = np.zeros(len(self.named))
        self.offset = np.zeros(len(self.named))

    def _arrays(self, records: List[Dict]) -> Tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per run and cause: its evidence (above the prior, for a named cause) and whether it
        is a candidate of the run's primary episode, and whether it is planted; per run, that
        episode's P(failure) (0 without one)."""
        n, k = len(records), len(CAUSES)
        ev, cand, planted, p_failure = np.zeros((n, k)), np.zeros((n, k), bool), np.zeros((n, k)), np.zeros(n)
        for i, r in enumerate(records):
            e = primary_episode(r["evidence"], r["hypotheses"]) or {}
            p_failure[i] = _num(e.get("p_failure"))
            for c in e.get("causes", []):
                if c["cause"] in CAUSES:
                    j = CAUSES.index(c["cause"])
                    cand[i, j] = True
                    ev[i, j] = _num(c["score"]) + (self.PRIOR if self.is_named[j] else 0.0)
            for c in r["label"]:
                if c in CAUSES:
                    planted[i, CAUSES.index(c)] = 1.0
        return ev, cand, planted, p_failure

    def _probs(self, ev: np.ndarray, cand: np.ndarray) -> np.ndarray:
        named = self.is_named
        a = np.ones(len(CAUSES))
        b = np.zeros(len(CAUSES))
        a[named] = np.exp(self.log_scale)
        b[named] = self.offset
        s = np.where(named, a * ev - self.PRIOR + b, ev)
        z = np.where(cand, self.T * s, -np.inf)
        z -= z.max(1, keepdims=True, initial=-1e300, where=cand)
        w = np.where(cand, np.exp(z), 0.0)
        return w / np.maximum(w.sum(1, keepdims=True), 1e-300)

    def fit(self, records: List[Dict], iters: int = 3000, lr: float = 0.5) -> CauseScales:
        ev, cand, planted, _ = self._arrays([r for r in records if r["label"] != ["healthy"]])
        keep = (planted * cand).sum(1) > 0  # a planted cause among the primary episode's candidates
        ev, cand, planted = ev[keep], cand[keep], planted[keep]
        named = self.is_named
        for _ in range(iters):
            p = self._probs(ev, cand)
            q = p * planted
            q /= q.sum(1, keepdims=True)
            g = self.T * (p - q) / len(ev)  # d(-log P(planted)) / d score
            a = np.exp(self.log_scale)
            self.offset -= lr * (g[:, named].sum(0) + 2 * self.l2 * self.offset)
            self.log_scale -= lr * ((g[:, named] * ev[:, named]).sum(0) * a + 2 * self.l2 * self.log_scale)
        return self

    def predict(self, records: List[Dict]) -> List[Tuple[str, float]]:
        """The top cause of each run's primary episode at P(failure) x P(cause), as the
        engine's verdict reads (healthy below 0.5)."""
        ev, cand, _, p_failure = self._arrays(records)
        p = self._probs(ev, cand)
        out = []
        for i in range(len(records)):
            if not cand[i].any():
                out.append(("healthy", 0.0))
                continue
            j = int(np.argmax(np.where(cand[i], p[i], -1.0)))
            conf = p_failure[i] * float(p[i, j])
            out.append((CAUSES[j], conf) if conf >= 0.5 else ("healthy", conf))
        return out

    def rows(self) -> List[str]:
        return [
            f"| {c} | {math.exp(a):.2f} | {b:+.2f} |"
            for c, a, b in zip(self.named, self.log_scale, self.offset)
            if abs(a) > 0.01 or abs(b) > 0.01
        ]


def targets(records: List[Dict], classes: List[str]) -> np.ndarray:
    y = np.zeros((len(records), len(classes)))
    for i, r in enumerate(records):
        lab = [c for c in r["label"] if c in classes]
        for c in lab:
            y[i, classes.index(c)] = 1.0 / len(lab)
    return y


def engine_prediction(r: Dict) -> Tuple[str, float]:
    h = r["hypotheses"][0] if r["hypotheses"] else None
    if h is None or h["confidence"] < 0.5:
        return "healthy", (h["confidence"] if h else 0.0)
    return h["cause"], h["confidence"]


def fitted_prediction(model: Softmax, p: np.ndarray) -> Tuple[str, float]:
    """The most probable failure cause if it reaches 0.5, else healthy."""
    hi = model.classes.index("healthy")
    q = p.copy()
    q[hi] = -1.0
    j = int(q.argmax())
    return (model.classes[j], float(p[j])) if p[j] >= 0.5 else ("healthy", float(p[j]))


def right(r: Dict, pred: str) -> bool:
    if r["label"] == ["unlabelled"]:  # an external program whose label has no cause of ours
        return pred != "healthy"
    ok = set(r["label"]) | (set(r.get("also", [])) if r.get("manifests") else set())
    return pred in ok


def engine_right(r: Dict) -> bool:
    """Whether the engine's verdict on a run is right: quiet on a healthy one, else the top
    hypothesis at >= 0.5 names a planted (or accepted) cause."""
    pred = engine_prediction(r)[0]
    return pred == "healthy" if r["label"] == ["healthy"] else right(r, pred)


def changed_verdicts(old: List[Dict], new: List[Dict]) -> List[str]:
    """The runs (by base and operators) whose engine verdict changed between two corpus runs."""
    before = {(r["base"], tuple(r["ops"]), r.get("seed")): r for r in old}
    out = []
    for r in new:
        o = before.get((r["base"], tuple(r["ops"]), r.get("seed")))
        if o is None or engine_right(o) == engine_right(r):
            continue
        shown = [
            f"{h['failure']}/{h['cause']} {h['confidence']:.2f}" if h else "-"
            for h in ((o["hypotheses"] or [None])[0], (r["hypotheses"] or [None])[0])
        ]
        out.append(
            f"{'wrong -> right' if engine_right(r) else 'right -> wrong'}: {r['base']} {'+'.join(r['ops']) or '-'} "
            f"(label {','.join(r['label'])}): {shown[0]} -> {shown[1]}"
        )
    return out


def summary(records: List[Dict], preds: List[Tuple[str, float]]) -> Dict[str, Tuple[int, int]]:
    man = [(r, p) for r, p in zip(records, preds) if r["label"] != ["healthy"]]
    healthy = [(r, p) for r, p in zip(records, preds) if r["label"] == ["healthy"]]
    return {
        "planted cause top": (sum(right(r, p[0]) for r, p in man), len(man)),
        "healthy quiet": (sum(p[0] == "healthy" for _, p in healthy), len(healthy)),
    }


def reliability(records: List[Dict], preds: List[Tuple[str, float]]) -> List[Tuple[str, int, int]]:
    """Alarms (a failure predicted at >= 0.5) binned by confidence: how many were right."""
    bins = [(0.5, 0.6), (0.6, 0.7), (0.7, 0.8), (0.8, 0.9), (0.9, 1.01)]
    rows = []
    for lo, hi in bins:
        sel = [(r, p) for r, p in zip(records, preds) if p[0] != "healthy" and lo <= p[1] < hi]
        rows.append((f"{lo:.1f}-{min(hi, 1.0):.1f}", sum(right(r, p[0]) for r, p in sel), len(sel)))
    return rows


def fmt(t: Tuple[int, int]) -> str:
    return f"{t[0]}/{t[1]}" + (f" ({100.0 * t[0] / t[1]:.0f}%)" if t[1] else "")


def matrix(records: List[Dict]) -> np.ndarray:
    return np.stack([features(r["evidence"], r["hypotheses"]) for r in records])


def fit(records: List[Dict], classes: List[str], l2: float) -> Softmax:
    return Softmax(classes, l2).fit(matrix(records), targets(records, classes), np.ones(len(records)))


def report(title: str, records: List[Dict], model: Softmax) -> None:
    fitted = [fitted_prediction(model, p) for p in model.predict(matrix(records))] if records else []
    compare(title, records, fitted)


def compare(title: str, records: List[Dict], fitted: List[Tuple[str, float]]) -> None:
    engine = [engine_prediction(r) for r in records]
    print(f"\n## {title}: {len(records)} runs")
    se, sf = summary(records, engine), summary(records, fitted)
    print("| measure | engine's ranking | fitted table |")
    print("|---|---|---|")
    for k in se:
        print(f"| {k} | {fmt(se[k])} | {fmt(sf[k])} |")
    print("\nreliability (alarms at >= 0.5, right / all):")
    print("| confidence | engine's ranking | fitted table |")
    print("|---|---|---|")
    for (b, e_ok, e_n), (_, f_ok, f_n) in zip(reliability(records, engine), reliability(records, fitted)):
        print(f"| {b} | {fmt((e_ok, e_n))} | {fmt((f_ok, f_n))} |")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("corpus")
    ap.add_argument("--held-out", default=",".join(HELD_OUT), help="base programs never used in fitting")
    ap.add_argument("--external", default=None, help="the external suite's evidence (never used in fitting)")
    ap.add_argument("--table", default=None, help="write the fitted table (JSON) here")
    ap.add_argument("--l2", type=float, default=1e-2)
    ap.add_argument("--cv", action="store_true", help="also report leave-one-base-out over every base")
    ap.add_argument(
        "--manifest",
        choices=CRITERIA,
        default="quality",
        help="what makes a mutant manifest (bench/corpus/labels.py): held-out quality or a mistake written in the "
        "program; also the training loss; or held-out quality alone",
    )
    ap.add_argument("--compare", default=None, help="an earlier corpus run: list the runs whose verdict changed")
    args = ap.parse_args()

    records = load(args.corpus)
    relabel(records, args.manifest)
    if args.compare:
        old = load(args.compare)
        relabel(old, args.manifest)
        changed = changed_verdicts(old, records)
        print(f"{len(changed)} runs changed verdict against {args.compare}:")
        print("\n".join(changed))
        return 0
    held = set(args.held_out.split(","))
    train = [r for r in records if r["base"] not in held]
    test = [r for r in records if r["base"] in held]
    classes = sorted({c for r in records for c in r["label"]} - {"healthy"}) + ["healthy"]
    model = fit(train, classes, args.l2)
    n_man = sum(r["manifests"] for r in records if r["ops"])
    n_mut = sum(1 for r in records if r["ops"])
    print(
        f"corpus {args.corpus}: {len(records)} runs, {n_mut} mutants ({n_man} manifest), "
        f"{len({r['base'] for r in records})} bases; fitted on {len(train)} runs of "
        f"{len({r['base'] for r in train})} bases; held out: {', '.join(sorted(held))}"
    )
    report("held-out base programs", test, model)
    report("fitting set (in-sample)", train, model)
    if args.cv:
        # Every base in turn predicted by a model fitted on all the others.
        order: List[Dict] = []
        preds: List[Tuple[str, float]] = []
        for b in sorted({r["base"] for r in records}):
            out = [r for r in records if r["base"] == b]
            m = fit([r for r in records if r["base"] != b], classes, args.l2)
            order += out
            preds += [fitted_prediction(m, p) for p in m.predict(matrix(out))]
        compare("leave-one-base-out (each base predicted by a fit on the others)", order, preds)
    if args.external:
        ext = load(args.external)
        for r in ext:
            r.setdefault("manifests", r["label"] != ["healthy"])
        report("external suite (buggy and fixed programs)", ext, model)
    scales = CauseScales().fit(train)
    print("\n# The engine's own form, fitted: a scale and an offset per cause (see CauseScales)")
    print("| cause | scale | offset |\n|---|---|---|")
    print("\n".join(scales.rows()) or "| (none moved) | | |")
    compare("held-out base programs: engine's numbers vs fitted scales", test, scales.predict(test))
    if args.cv:
        order, preds = [], []
        for b in sorted({r["base"] for r in records}):
            out = [r for r in records if r["base"] == b]
            order += out
            preds += CauseScales().fit([r for r in records if r["base"] != b]).predict(out)
        compare("leave-one-base-out: engine's numbers vs fitted scales", order, preds)
    if args.external:
        compare("external suite: engine's numbers vs fitted scales", ext, scales.predict(ext))
    if args.table:
        with open(args.table, "w") as f:
            json.dump({"command": "make bench-corpus", **model.table()}, f, indent=1)
            f.write("\n")
        print(f"\nfitted table -> {args.table}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
