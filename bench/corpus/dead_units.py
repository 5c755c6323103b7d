#!/usr/bin/env python3
"""The share of one module's units that output zero for the whole batch, every tenth step of a
corpus program trained as the corpus trains it (no NeuralDbg: a forward hook counts them), and
its held-out score. Ground truth for what the engine says of dead layers in BENCHMARKS.md.

    .venv/bin/python bench/corpus/dead_units.py BASE OPS MODULE
    .venv/bin/python bench/corpus/dead_units.py cnn_batchnorm lr_x100 features.5
    .venv/bin/python bench/corpus/dead_units.py gru_regression - head.1     # '-': the base itself
"""

from __future__ import annotations

import os
import sys
import warnings
from typing import List, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", ".."))

import torch

from bench.corpus.bases import base
from bench.corpus.mutations import knobs_for
from bench.corpus.run import train


def dead_share(out: torch.Tensor) -> float:
    """Units (features, or channels of a feature map) that are zero for every sample."""
    alive = (out > 0).transpose(0, 1).flatten(1).any(1)
    return float((~alive).float().mean())


def dead_shares(name: str, ops: str, module: str) -> Tuple[List[float], float, str]:
    """The share of `module`'s dead units at every step of the program `name` with the
    operators `ops` ('+'-joined, '-' for none), its held-out score, and its training error."""
    k = knobs_for([o for o in ops.split("+") if o != "-"])
    torch.manual_seed(0)
    p = base(name).build(k, 0)
    shares: List[float] = []
    dict(p.model.named_modules())[module].register_forward_hook(lambda _m, _i, out: shares.append(dead_share(out)))
    _, error = train(p, k)
    return shares, p.score(p.model), error or ""


def main() -> int:
    if len(sys.argv) != 4:
        print(__doc__, file=sys.stderr)
        return 2
    name, ops, module = sys.argv[1:]
    warnings.simplefilter("ignore")
    shares, score, error = dead_shares(name, ops, module)
    print(f"{name} {ops} {module}: dead share every 10th step {[round(s, 2) for s in shares[::10]]}")
    print(f"  at the end {shares[-1]:.2f}, held-out score {score:.3f}" + (f", {error}" if error else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
