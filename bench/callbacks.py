#!/usr/bin/env python3
"""Where a watched CPU step's time goes (issue 12): the collector's four entry points timed in
place, and the gradient read with and without DLPack's exchange-API view.

1. A 16-layer (``--depth``) 32-wide MLP, SGD, batch 64, trains ``--steps`` steps with
   ``NeuralDbg`` at its defaults; the root pre-hook, the backward tap's ``on_backward`` and
   ``after_backward`` and the optimizer post hook are wrapped with ``perf_counter_ns`` (the
   wrappers add ~1 us each). Prints the median of each per ``step % 10`` and their mean over
   the unmeasured steps.
2. The model's gradients right after a real backward, read by ``TensorReader.grad_norms`` with
   a ``_to_dlpack`` capsule a tensor or through the exchange API's view, alternating steps.

Timings, so noisy on a shared machine; compare trees one after the other
(``PYTHONPATH=<tree>/python``). Run: ``.venv/bin/python bench/callbacks.py --depth 16``.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import MLP  # noqa: E402

import neuraldbg  # noqa: E402
from neuraldbg import _collect  # noqa: E402
from neuraldbg._native import TensorReader  # noqa: E402

ENTRIES = ["_on_root_pre", "on_backward", "after_backward", "_on_optimizer_post"]


def callbacks(depth: int, steps: int) -> None:
    times: Dict[Tuple[str, int], List[int]] = collections.defaultdict(list)
    clock = time.perf_counter_ns

    def timed(name: str, f: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(self: Any, *args: Any) -> Any:
            t = clock()
            try:
                return f(self, *args)
            finally:
                times[(name, self.step % 10)].append(clock() - t)

        return wrapper

    originals = {n: getattr(_collect.Collector, n) for n in ENTRIES}
    for n, f in originals.items():
        setattr(_collect.Collector, n, timed(n, f))
    try:
        torch.manual_seed(0)
        model = MLP(depth=depth, width=32)
        opt = torch.optim.SGD(model.parameters(), lr=1e-2)
        g = torch.Generator().manual_seed(0)
        xs = [torch.randn(64, 32, generator=g) for _ in range(8)]
        ys = [torch.randint(0, 10, (64,), generator=g) for _ in range(8)]
        loss_fn = nn.CrossEntropyLoss()
        with neuraldbg.NeuralDbg(model):
            for i in range(steps):
                opt.zero_grad()
                loss = loss_fn(model(xs[i % 8]), ys[i % 8])
                loss.backward()
                opt.step()
                loss.item()
    finally:
        for n, f in originals.items():
            setattr(_collect.Collector, n, f)
    print(f"MLP {depth} x (Linear 32x32 + ReLU), {steps} steps: median us per call, by the step counter % 10")
    print("  (the counter is read after the call: the optimizer hook's column 1 is the sampled step)")
    for n in ENTRIES:
        row = [statistics.median(times[(n, k)]) / 1e3 for k in range(10)]
        print(f"  {n:20s} " + " ".join(f"{v:6.1f}" for v in row) + f" | columns 2-9 mean {sum(row[2:]) / 8:.1f}")


def reads(depth: int, steps: int) -> None:
    exchange = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if exchange is None:
        print("this torch has no DLPack exchange API: no view to compare")
        return
    kinds = (torch.Tensor, torch.nn.Parameter), torch.float32, torch.float64, torch.float16, torch.bfloat16
    readers = {
        "capsule": TensorReader(*kinds, torch._C._to_dlpack),
        "view": TensorReader(*kinds, torch._C._to_dlpack, exchange),
    }
    torch.manual_seed(0)
    model = MLP(depth=depth, width=32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    out = np.empty(len(params), np.float32)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    times: Dict[str, List[int]] = {k: [] for k in readers}
    for i in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        name = "view" if i % 2 else "capsule"
        t = time.perf_counter_ns()
        readers[name].grad_norms(params, out, -1.0, None, None)
        times[name].append(time.perf_counter_ns() - t)
        opt.step()
    for name, v in times.items():
        print(f"  gradient read, {name:7s}: {statistics.median(v[1:]) / 1e3:8.1f} us for {len(params)} gradients after a backward")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000, help="steps of the callback timing")
    ap.add_argument("--read-steps", type=int, default=40, help="steps of the gradient-read comparison")
    args = ap.parse_args()
    torch.set_num_threads(1)
    callbacks(args.depth, args.steps)
    reads(args.depth, args.read_steps)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
