#!/usr/bin/env python3
"""Trains the mutation corpus under NeuralDbg and writes one JSON line per run.

Each base program is trained as written (seeded; its healthy runs are in the corpus), then each
mutant: every single operator that applies to the base, and ``--pairs`` pairs drawn (seeded) from
the compatible ones. A mutant is labelled with its planted cause(s) when it *manifests*: its
held-out quality (accuracy or R^2) falls short of its base's by more than a quarter of what the
base gained over chance, or its loss went non-finite. A mutant that trains as well as its base
is labelled healthy (``bench/corpus/labels.py``, which has a second criterion). Every line carries the engine's top hypotheses and
the evidence the cause ranking weighed (``evidence``), which ``bench/corpus/fit.py`` fits on.

    .venv/bin/python bench/corpus/run.py --out runs/corpus/corpus.jsonl [--seeds 1] [--pairs 120] [--jobs 1]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import warnings
from typing import Dict, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch

from bench.corpus.bases import BASES, Knobs, Program, base, lose_input
from bench.corpus.labels import relabel
from bench.corpus.mutations import knobs_for, named, pairs, singles


def train(p: Program, k: Knobs) -> Tuple[List[float], Optional[str]]:
    """The user's loop, with the loop-side knobs (zero_grad dropped or called after the
    backward, the gradients negated, eval() mode, a weight penalty written into the loss, the loss cut from the model,
    gradients clipped, a learning-rate warmup) applied."""
    losses: List[float] = []
    p.model.train(not k.eval_mode)
    penalized = [w for w in p.model.parameters() if w.requires_grad and w.dim() >= 2]
    warmup = k.warmup_steps
    sched = torch.optim.lr_scheduler.LambdaLR(p.optimizer, lambda s: min(1.0, (s + 1) / warmup)) if warmup else None
    try:
        for i in range(p.steps):
            x, y = p.batch(i)
            if k.zero_grad:
                p.optimizer.zero_grad()
            loss = p.loss(p.model(x), y)
            if k.weight_penalty:
                loss = loss + k.weight_penalty * sum(w.pow(2).sum() for w in penalized)
            if k.loss_cut:
                loss = torch.tensor(loss.item(), requires_grad=True)
            loss.backward()
            if k.zero_grad_late:
                p.optimizer.zero_grad()
            if k.negate_grads:
                for w in p.model.parameters():
                    if w.grad is not None:
                        w.grad.neg_()
            if k.clip_norm is not None:
                torch.nn.utils.clip_grad_norm_(p.model.parameters(), k.clip_norm)
            p.optimizer.step()
            if sched is not None:
                sched.step()
            losses.append(float(loss.detach()))
    except Exception as e:  # a crashed program is still diagnosable
        return losses, f"{type(e).__name__}: {e}"
    return losses, None


def one(base_name: str, ops: Tuple[str, ...], seed: int) -> Dict:
    from neuraldbg import NeuralDbg

    b = base(base_name)
    muts = named(ops)
    k = knobs_for(ops)
    torch.manual_seed(seed)
    p = b.build(k, seed)
    lose_input(p.model, k)
    t0 = time.perf_counter()
    with NeuralDbg(p.model) as dbg:
        losses, error = train(p, k)
    hyps = dbg.explain_failure()
    evidence = json.loads(dbg._engine.evidence_json())
    score = p.score(p.model)
    finite = bool(losses) and all(math.isfinite(v) for v in losses)
    return {
        "base": b.name,
        "kind": b.kind,
        "ops": list(ops),
        "causes": [m.cause for m in muts],
        "also": sorted({a for m in muts for a in m.also}),
        "seed": seed,
        "steps": p.steps,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "loss_tail": sum(losses[-max(1, len(losses) // 10) :]) / max(1, len(losses) // 10) if losses else None,
        "finite": finite,
        "error": error,
        "score": score,
        "chance": p.chance,
        "seconds": round(time.perf_counter() - t0, 3),
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
        "evidence": evidence,
    }


def _work(args: Tuple[str, Tuple[str, ...], int]) -> Dict:
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    return one(*args)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default="runs/corpus/corpus.jsonl")
    ap.add_argument("--seeds", type=int, default=1, help="seeds per program (0, 1, ...)")
    ap.add_argument("--pairs", type=int, default=120, help="pairs of operators drawn over all bases")
    ap.add_argument("--bases", default="", help="comma-separated base names (default: all)")
    ap.add_argument("--jobs", type=int, default=1, help="worker processes")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)

    bases = [b for b in BASES if not args.bases or b.name in args.bases.split(",")]
    jobs: List[Tuple[str, Tuple[str, ...], int]] = []
    for seed in range(args.seeds):
        jobs += [(b.name, (), seed) for b in bases]
        jobs += [(b.name, tuple(m.name for m in ms), seed) for b, ms in singles(bases)]
        jobs += [(b.name, tuple(m.name for m in ms), seed) for b, ms in pairs(bases, args.pairs, seed)]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    t0 = time.perf_counter()
    if args.jobs > 1:
        import multiprocessing as mp

        with mp.get_context("spawn").Pool(args.jobs) as pool:
            records = pool.map(_work, jobs, chunksize=4)
    else:
        records = []
        for i, j in enumerate(jobs):
            records.append(_work(j))
            if (i + 1) % 25 == 0:
                print(f"  {i + 1}/{len(jobs)} runs, {time.perf_counter() - t0:.0f}s", flush=True)
    relabel(records)
    with open(args.out, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    n_mut = sum(1 for r in records if r["ops"])
    n_man = sum(1 for r in records if r["manifests"])
    print(
        f"corpus: {len(records)} runs ({len(records) - n_mut} bases, {n_mut} mutants, {n_man} manifest) "
        f"in {time.perf_counter() - t0:.0f}s -> {args.out}"
    )
    for b in bases:
        rs = [r for r in records if r["base"] == b.name and not r["ops"]]
        print(
            f"  base {b.name:<16} score {', '.join(format(r['score'], '.2f') for r in rs)} (chance {rs[0]['chance']:.2f})"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
