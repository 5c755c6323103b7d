#!/usr/bin/env python3
"""Per-scenario scoreboard of the diagnosis (`make bench-diagnosis`).

For every scenario: prove its ground truth from the independent record, run the default
`NeuralDbg(model)` on the same run, and compare the top hypothesis with the truth
(F: failure, C: cause, L: layer, S: onset step; '-' where the scenario does not define it).
Healthy runs pass when no hypothesis reaches confidence 0.5.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from bench import scenarios as S
from bench import suite


def mark(v) -> str:
    return "-" if v is None else ("ok" if v else "XX")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="only these scenarios")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("-v", "--verbose", action="store_true", help="print the top hypotheses")
    ap.add_argument("--options", default="{}", help="JSON keyword options for NeuralDbg (default: none)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    rows = []
    t0 = time.perf_counter()
    for s in suite.all_scenarios():
        if args.names and s.name not in args.names:
            continue
        o = S.evaluate(s, json.loads(args.options) or None)
        try:
            S.verify_truth(s, o.record)
            truth_ok = True
        except AssertionError as e:
            truth_ok = False
            o.score = {"truth": False}
            print(f"!! {s.name}: ground truth not confirmed: {e}")
        rows.append((s, o, truth_ok))
        if args.verbose:
            for h in o.hypotheses[:3]:
                print(f"   {s.name}: {h}")

    print()
    print(f"{'scenario':<34} {'arch':<30} {'truth':<58} {'top hypothesis':<58} F  C  L  S  conf")
    print("-" * 200)
    failures = healthy = ok_fail = ok_healthy = 0
    for s, o, truth_ok in rows:
        t = s.truth
        if t.failure is None:
            healthy += 1
            top = max((h.confidence for h in o.hypotheses), default=0.0)
            good = truth_ok and o.score.get("healthy", False)
            ok_healthy += good
            best = o.hypotheses[0] if o.hypotheses else None
            desc = f"{best.failure}/{best.cause}" if best else "(none)"
            print(f"{s.name:<34} {s.arch:<30} {'healthy':<58} {desc:<58} {'ok' if good else 'XX':<11} {top:.2f}")
            continue
        failures += 1
        good = truth_ok and S.passed(o)
        ok_fail += good
        tt = f"{t.failure}/{t.cause}/{t.layer if t.layer is not None else '-'}/{t.step if t.step is not None else '-'}"
        if o.hypotheses:
            h = o.hypotheses[0]
            hh = f"{h.failure}/{h.cause}/{h.layer if h.layer is not None else '-'}/{h.step}"
            conf = f"{h.confidence:.2f}"
        else:
            hh, conf = "(none)", "-"
        sc = o.score
        marks = (
            " ".join(mark(sc.get(k)) for k in ("failure", "cause", "layer", "step"))
            if truth_ok
            else "truth not confirmed"
        )
        print(f"{s.name:<34} {s.arch:<30} {tt:<58} {hh:<58} {marks} {conf}")
    print("-" * 200)
    calibrated = reliability(rows)
    print(
        f"planted failures diagnosed correctly by the top hypothesis: {ok_fail}/{failures}; "
        f"healthy runs with no hypothesis >= 0.5: {ok_healthy}/{healthy}; "
        f"{time.perf_counter() - t0:.0f}s, torch {torch.__version__}, {args.threads} thread(s)"
    )
    return 0 if (ok_fail == failures and ok_healthy == healthy and calibrated) else 1


# Confidence bins of the reliability table, and the share right each must reach.
BINS = ((0.8, 1.01, 0.8), (0.5, 0.8, 0.5), (0.2, 0.5, None))


def reliability(rows) -> bool:
    """Calibration: how often hypotheses at each confidence are right.

    * top: each run's top hypothesis; right when its failure and cause are the scenario's
      (and its layer and step where the scenario defines them); on a healthy run any
      hypothesis is wrong.
    * all: every hypothesis reported; right when its cause is the scenario's cause (a
      consequence of the planted failure blamed on the same cause is right; one blamed on
      another cause, or anything on a healthy run, is wrong).
    """
    tables = {"top": [[0, 0] for _ in BINS], "all": [[0, 0] for _ in BINS]}

    def put(table, conf: float, right: bool) -> None:
        for k, (lo, hi, _) in enumerate(BINS):
            if lo <= conf < hi:
                table[k][0] += 1
                table[k][1] += right

    for s, o, truth_ok in rows:
        if not truth_ok:
            continue
        t = s.truth
        if o.hypotheses:
            top = o.hypotheses[0]
            put(tables["top"], top.confidence, t.failure is not None and S.passed(o))
        for h in o.hypotheses:
            put(tables["all"], h.confidence, t.failure is not None and str(h.cause) == t.cause)
    ok = True
    print()
    print("reliability (calibration): hypotheses by confidence, and how many were right")
    print(
        f"{'confidence':<12} {'top: n':>8} {'right':>7} {'share':>7}   {'all: n':>8} {'right':>7} {'share':>7}   required"
    )
    for k, (lo, hi, need) in enumerate(BINS):
        cells = []
        for name in ("top", "all"):
            n, right = tables[name][k]
            share = right / n if n else float("nan")
            cells.append(f"{n:>8} {right:>7} {share:>7.2f}")
            if need is not None and n and share < need:
                ok = False
        label = f"{lo:.1f}-{min(hi, 1.0):.1f}"
        print(f"{label:<12} {cells[0]}   {cells[1]}   {'>= %.0f%%' % (100 * need) if need else '-'}")
    print(f"calibration {'met' if ok else 'NOT met'}")
    print()
    return ok


if __name__ == "__main__":
    sys.exit(main())
