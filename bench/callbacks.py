#!/usr/bin/env python3
"""Where a watched CPU step's time goes (issue 12): the collector's four entry points timed in
place, and the gradient read with and without DLPack's exchange-API view.

1. A 16-layer (``--depth``) 32-wide MLP, SGD, batch 64, trains ``--steps`` steps with
   ``NeuralDbg`` at its defaults; the root pre-hook, the backward tap's ``on_backward`` and
   ``after_backward`` and the optimizer post hook are wrapped with ``perf_counter_ns`` (the
   wrappers add ~1 us each). Prints the median of each per ``step % 10`` and their mean over
   the unmeasured steps.
2. The model's gradients right after a real backward, read by ``TensorReader.grad_norms`` with
   a ``_to_dlpack`` capsule a tensor or through the exchange API's view, alternating steps;
   with ``--baseline-native <another build's _native.abi3.so>`` that build's reader (loaded
   as a second package) takes turns with this one's too (an A/B of a reader change in one
   process); ``--grads-made`` has every ``.grad`` taken before each read, so that the read
   times leave out torch making its ``.grad`` wrappers (which the first reader after a
   backward pays, and the optimizer then does not). Last, the same number of elements in one tensor: what reading them costs
   without the per-tensor start.

Timings, so noisy on a shared machine; compare trees one after the other
(``PYTHONPATH=<tree>/python``). Run: ``.venv/bin/python bench/callbacks.py --depth 16``.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import statistics
import sys
import time
from typing import Any, Callable, Dict, List, Tuple

import numpy as np
import torch
import torch.nn as nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import neuraldbg
from neuraldbg import _collect
from neuraldbg._native import TensorReader
from overhead import MLP

ENTRIES = ["on_forward_pre", "on_backward", "after_backward", "on_optimizer_step"]


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


def baseline_reader(path: str) -> Any:
    """``TensorReader`` of another build's extension, loaded as the package ``baseline_nd``."""
    import importlib.util
    import tempfile

    tmp = tempfile.mkdtemp(prefix="baseline_nd")
    os.makedirs(os.path.join(tmp, "baseline_nd"))
    shutil.copy(path, os.path.join(tmp, "baseline_nd", "_native.abi3.so"))
    spec = importlib.util.spec_from_file_location(
        "baseline_nd._native", os.path.join(tmp, "baseline_nd", "_native.abi3.so")
    )
    if spec is None or spec.loader is None:
        raise SystemExit(f"cannot load {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.TensorReader


def reads(depth: int, steps: int, baseline: str = "", grads_made: bool = False) -> None:
    exchange = getattr(torch.Tensor, "__dlpack_c_exchange_api__", None)
    if exchange is None:
        print("this torch has no DLPack exchange API: no view to compare")
        return
    kinds = (torch.Tensor, torch.nn.Parameter), torch.float32, torch.float64, torch.float16, torch.bfloat16
    readers = {
        "capsule": TensorReader(*kinds, torch._C._to_dlpack),
        "view": TensorReader(*kinds, torch._C._to_dlpack, exchange),
    }
    if baseline:
        readers["baseline view"] = baseline_reader(baseline)(*kinds, torch._C._to_dlpack, exchange)
    torch.manual_seed(0)
    model = MLP(depth=depth, width=32)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    params = list(model.parameters())
    out = np.empty(len(params), np.float32)
    x, y = torch.randn(64, 32), torch.randint(0, 10, (64,))
    times: Dict[str, List[int]] = {k: [] for k in readers}
    names = list(readers)
    for i in range(steps):
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        name = names[i % len(names)]
        if grads_made:
            [p.grad for p in params]  # torch's .grad wrappers made first (the data stays cold)
        t = time.perf_counter_ns()
        readers[name].grad_norms(params, out, -1.0, None, None)
        times[name].append(time.perf_counter_ns() - t)
        opt.step()
    for name, v in times.items():
        print(
            f"  gradient read, {name:13s}: {statistics.median(v[1:]) / 1e3:8.1f} us for {len(params)} gradients after a backward"
        )
    numel = sum(p.numel() for p in params)
    whole, one = [torch.randn(numel)], np.empty(1, np.float32)
    spent = []
    for _ in range(max(steps, 10)):
        t = time.perf_counter_ns()
        readers["view"].norms(whole, one)
        spent.append(time.perf_counter_ns() - t)
    per = statistics.median(spent)
    print(f"  the same {numel:,} elements in one tensor: {per / 1e3:8.1f} us ({per / numel:.2f} ns an element)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--steps", type=int, default=3000, help="steps of the callback timing")
    ap.add_argument("--read-steps", type=int, default=40, help="steps of the gradient-read comparison")
    ap.add_argument("--baseline-native", default="", help="another build's _native.abi3.so: its reader takes turns too")
    ap.add_argument("--grads-made", action="store_true", help="take every .grad before each read (see the docstring)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    if args.steps:
        callbacks(args.depth, args.steps)
    reads(args.depth, args.read_steps, args.baseline_native, args.grads_made)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
