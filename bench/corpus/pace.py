"""The loss's pace on the corpus's bases and their learning-rate mutants: the means of its
first, middle and last tenth, the second half's fall over the first's (``pace``) and where it
ended over where it began (``fell_to``); what the engine's "still falling as fast as it began"
reads (`loss_plateau.rs::steady_descent`). Seed 0, each program trained once (about a minute).

    .venv/bin/python bench/corpus/pace.py [--ops lr_div10,lr_div100]
"""

from __future__ import annotations

import argparse
import sys
import warnings
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from bench.corpus.bases import BASES
from bench.corpus.mutations import knobs_for, named
from bench.corpus.run import train


def pace(losses: list) -> tuple:
    n = len(losses)
    w = max(3, n // 10)
    start = float(np.mean(losses[:w]))
    mid = float(np.mean(losses[n // 2 - w // 2 : n // 2 - w // 2 + w]))
    end = float(np.mean(losses[-w:]))
    return start, mid, end, (mid - end) / max(start - mid, 1e-12), end / start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ops", default="lr_div10,lr_div100", help="single operators to run beside each base")
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    print("| base | operator | score | start | mid | end | pace | fell_to |")
    print("|---|---|---|---|---|---|---|---|")
    for b in BASES:
        for ops in [()] + [(o,) for o in args.ops.split(",") if o]:
            if not all(m.applies_to(b) for m in named(ops)):
                continue
            k = knobs_for(ops)
            torch.manual_seed(0)
            p = b.build(k, 0)
            losses, _ = train(p, k)
            start, mid, end, pc, fell = pace(losses)
            score = p.score(p.model)
            print(
                f"| {b.name} | {'+'.join(ops) or '-'} | {score:.3f} | {start:.3f} | {mid:.3f} | {end:.3f} | {pc:.2f} | {fell:.2f} |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
