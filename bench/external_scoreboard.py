#!/usr/bin/env python3
"""Scoreboard of the external suite (`make bench-diagnosis` runs it after the scenario suite).

Each program of bench/external is trained twice under the default `NeuralDbg(model)`: buggy,
then fixed. Scored:
- detected: the top hypothesis on the buggy run has confidence >= 0.5;
- cause: that top hypothesis names the original label's cause, where our vocabulary has one
  ('-' where it has none: only detection is scored then);
- false alarm: the fixed run has a hypothesis with confidence >= 0.5.
The loss columns (first -> last step, and the final training accuracy for classifiers) come
from the loop itself, not from NeuralDbg: they show what the planted fault did to the run.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

import torch

from bench.external import all_programs
from bench.external.common import Program, TrainResult, train


def monitored(p: Program, buggy: bool, steps=None, evidence=None, seed: int = 0):
    from neuraldbg import NeuralDbg

    torch.manual_seed(seed)
    run = p.build(buggy, steps)
    with NeuralDbg(run.model) as dbg:
        res = train(run)
    hyps = dbg.explain_failure()
    if evidence is not None:
        # What the cause ranking weighed, for bench/corpus/fit.py (never fitted on).
        label = ([p.cause] if p.cause else ["unlabelled"]) if buggy else ["healthy"]
        evidence.write(
            json.dumps(
                {
                    "base": p.name,
                    "ops": ["buggy"] if buggy else [],
                    "label": label,
                    "also": list(p.also),
                    "manifests": buggy,
                    "evidence": json.loads(dbg._engine.evidence_json()),
                    "hypotheses": [
                        {
                            "failure": str(h.failure),
                            "cause": str(h.cause),
                            "confidence": h.confidence,
                            "layer": h.layer,
                            "step": h.step,
                        }
                        for h in hyps[:5]
                    ],
                }
            )
            + "\n"
        )
    return res, hyps


def loss_span(r: TrainResult) -> str:
    if not r.losses:
        return "(no step)" if r.error is None else f"error: {type(r.error).__name__}"

    def f(v: float) -> str:
        return "nan" if math.isnan(v) else ("inf" if math.isinf(v) else f"{v:.3g}")

    s = f"{f(r.losses[0])}->{f(r.losses[-1])}"
    if r.accuracy is not None:
        s += f" acc {r.accuracy:.2f}"
    return s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="only programs whose name contains one of these")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=None, help="override every program's step count")
    ap.add_argument(
        "--seed",
        type=int,
        default=0,
        help="torch's seed before each build (the weights' initialization, dropout; the data stay the "
        "programs' own): how much a row owes to one draw",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print the top hypotheses")
    ap.add_argument(
        "--evidence",
        default=None,
        metavar="FILE",
        help="write each run's evidence features as JSON lines (for bench/corpus/fit.py)",
    )
    ap.add_argument("--list", action="store_true", help="print the programs' records as a Markdown table and exit")
    args = ap.parse_args()
    if args.list:
        print("| program | source | original label | our cause | the fix | data |")
        print("|---|---|---|---|---|---|")
        for p in all_programs():
            cause = p.cause or "not in our vocabulary"
            if p.also:
                cause += " (also accepted: " + ", ".join(p.also) + ")"
            print(f"| {p.name} | `{p.source}` | {p.label} | {cause} | {p.fix} | {p.data} |")
        return 0
    torch.set_num_threads(args.threads)
    warnings.simplefilter("ignore")

    progs = [p for p in all_programs() if not args.names or any(n in p.name for n in args.names)]
    t0 = time.perf_counter()
    print(
        f"{'program':<34} {'label -> cause':<62} {'buggy: top hypothesis':<52} {'det':<4}{'cause':<6}"
        f"{'fixed: top':<34} {'alarm':<6} {'loss buggy':<26} loss fixed"
    )
    print("-" * 250)
    n = detected = cause_n = cause_ok = alarms = 0
    controls: dict = {}  # fixed_key -> (result, hypotheses): a shared control is trained once
    evidence = open(args.evidence, "w") if args.evidence else None  # noqa: SIM115 (closed after the loop)
    for p in progs:
        rb, hb = monitored(p, True, args.steps, evidence, args.seed)
        if p.fixed_key is not None and p.fixed_key in controls:
            rf, hf = controls[p.fixed_key]
        else:
            rf, hf = monitored(p, False, args.steps, evidence, args.seed)
            if p.fixed_key is not None:
                controls[p.fixed_key] = (rf, hf)
        n += 1
        top = hb[0] if hb else None
        det = top is not None and top.confidence >= 0.5
        detected += det
        if p.cause is not None:
            cause_n += 1
            good = det and str(top.cause) in (p.cause,) + p.also
            cause_ok += good
            cmark = "ok" if good else "XX"
        else:
            cmark = "-"
        ftop = hf[0] if hf else None
        alarm = ftop is not None and ftop.confidence >= 0.5
        alarms += alarm
        desc = f"{top.failure}/{top.cause} {top.confidence:.2f}" if top else "(none)"
        fdesc = f"{ftop.failure}/{ftop.cause} {ftop.confidence:.2f}" if ftop else "(none)"
        lab = f"{p.label[:40]} -> {p.cause or '(not in vocabulary)'}"
        print(
            f"{p.name:<34} {lab:<62} {desc:<52} {'ok' if det else 'XX':<4}{cmark:<6}"
            f"{fdesc:<34} {'XX' if alarm else 'ok':<6} {loss_span(rb):<26} {loss_span(rf)}",
            flush=True,
        )
        if args.verbose:
            for h in hb[:3]:
                print(f"     buggy: {h}")
            for h in hf[:2]:
                print(f"     fixed: {h}")
    if evidence is not None:
        evidence.close()
    print("-" * 250)
    print(
        f"external suite: {n} programs; buggy detected (top >= 0.5): {detected}/{n}; "
        f"cause correct where our vocabulary has it: {cause_ok}/{cause_n}; "
        f"false alarms on the fixed versions: {alarms}/{n}; "
        f"{time.perf_counter() - t0:.0f}s, torch {torch.__version__}, {args.threads} thread(s), seed {args.seed}"
    )
    # A report, not a gate: the external suite measures the engine, it does not fail the build.
    return 0


if __name__ == "__main__":
    sys.exit(main())
