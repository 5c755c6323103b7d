#!/usr/bin/env python3
"""How many lines of NeuralDBG's own Python a watched step runs (issue 12).

On a fast CPU step the cost of watching is mostly our Python (0.2-0.5 us a line on a slow
shared VM), so this count is a noise-free companion to ``bench/overhead.py``'s timings. A
16-layer (``--depth``) 32-wide MLP, SGD, batch 64, trains with ``NeuralDbg`` at its defaults;
``sys.settrace`` counts the line events in ``python/neuraldbg`` over one full sample cycle
(``activation_every`` steps: the sampled step, its arming and disarming, the unmeasured
ones) after ``--warmup`` steps, then prints the lines per step of that cycle, of its
unmeasured steps alone, and the functions that run the most.

Run: ``.venv/bin/python bench/lines.py --depth 16``.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from typing import Any, Counter, Optional, Tuple

import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import neuraldbg
from overhead import MLP

PACKAGE = os.path.dirname(os.path.abspath(neuraldbg.__file__))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--warmup", type=int, default=40, help="steps before counting (a multiple of the period)")
    ap.add_argument("--top", type=int, default=12, help="functions to list")
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = MLP(depth=args.depth, width=32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    loss_fn = nn.CrossEntropyLoss()
    lines: Counter[Tuple[int, str]] = collections.Counter()  # (step in cycle, function)
    at = [0]

    def trace(frame: Any, event: str, arg: Any) -> Optional[Any]:
        if not frame.f_code.co_filename.startswith(PACKAGE):
            return None

        def line(frame: Any, event: str, arg: Any) -> Any:
            if event == "line":
                lines[(at[0], frame.f_code.co_name)] += 1
            return line

        return line

    with neuraldbg.NeuralDbg(model) as dbg:
        period = dbg._collector.activation_every
        for i in range(args.warmup + period):
            at[0] = i - args.warmup
            if i == args.warmup:
                sys.settrace(trace)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()
        sys.settrace(None)
        assert args.warmup % period == 0 and args.warmup >= dbg._collector.dense_steps, (
            "--warmup: a multiple of the period past the dense steps"
        )
    cycle = sum(lines.values())
    unmeasured = sum(n for (k, _), n in lines.items() if 0 < k < period - 1)
    print(f"MLP {args.depth} x (Linear 32x32 + ReLU): lines of NeuralDBG's Python a step runs")
    print(f"  one cycle of {period} steps: {cycle / period:.1f} a step ({cycle} in all)")
    print(f"  unmeasured steps (not the sampled one, nor the one arming it): {unmeasured / (period - 2):.1f} a step")
    by: Counter[str] = collections.Counter()
    for (_, name), n in lines.items():
        by[name] += n
    for name, n in by.most_common(args.top):
        print(f"  {n:6d}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
