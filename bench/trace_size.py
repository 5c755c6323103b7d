#!/usr/bin/env python3
"""Trace size and write cost for a 100-layer model (`make bench-trace`).

1. Size: trains a 100-layer MLP (100 x Linear(64, 64) + Tanh, so 200 parameters and 100
   activation modules) with ``NeuralDbg(model, trace=...)`` and its default sampling
   (activation statistics and parameter norms on the first 10 steps, then every 10th), then
   reads the
   trace back with ``neuraldbg info --json``: bytes per step are the step records' bytes,
   framing included, divided by the steps.
2. Cost: feeds the engine the same shape of arrays directly (no torch in the loop) with no
   trace, and with a trace under each sync policy, and reports the time per step. The cost of
   a trace is the difference; a sync is one ``fdatasync`` of the trace file.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Optional

import numpy as np

DEPTH, WIDTH = 100, 64


def trace_size(steps: int, workdir: str) -> dict:
    import torch
    import torch.nn as nn

    from neuraldbg import NeuralDbg

    torch.manual_seed(0)
    layers = []
    for _ in range(DEPTH):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    path = os.path.join(workdir, "size.ndbg")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        with NeuralDbg(model, trace=path):
            for _ in range(steps):
                opt.zero_grad()
                model(torch.randn(32, WIDTH)).square().mean().backward()
                opt.step()
    out = subprocess.run(
        [sys.executable, "-m", "neuraldbg", "info", "--json", path], capture_output=True, text=True, check=True
    ).stdout
    return json.loads(out)


def write_cost(steps: int, sync: Optional[float], workdir: str, trace: bool) -> float:
    """Seconds per observed step with arrays shaped like the 100-layer model's."""
    from neuraldbg import _native

    engine = _native.Engine("{}")
    modules = []
    params = []
    for i in range(DEPTH):
        params.append(
            {
                "module": len(modules),
                "name": f"{2 * i}.weight",
                "numel": WIDTH * WIDTH,
                "role": "weight",
                "fan_in": WIDTH,
            }
        )
        params.append({"module": len(modules), "name": f"{2 * i}.bias", "numel": WIDTH, "role": "bias"})
        modules.append({"name": str(2 * i), "kind": "Linear"})
        modules.append({"name": str(2 * i + 1), "kind": "Tanh"})
    modules.append({"name": "", "kind": "Sequential"})
    engine.register_model(json.dumps({"modules": modules, "params": params, "optimizer": "SGD"}))
    if trace:
        engine.open_trace(os.path.join(workdir, f"cost-{sync}.ndbg"), sync_interval=sync)
    rng = np.random.default_rng(0)
    grads = rng.uniform(0.01, 0.1, 2 * DEPTH).astype(np.float32)
    weights = rng.uniform(1.0, 3.0, 2 * DEPTH).astype(np.float32)
    acts = np.tile(np.array([0.9, 0.1, np.nan, 0.5, 32.0], np.float32), DEPTH)
    inputs = np.array([-3.0, 3.0, 0.0, 1.0], np.float32)
    t0 = time.perf_counter()
    for step in range(steps):
        engine.observe(
            step,
            grads,
            weight_norms=weights if step % 10 == 0 else None,
            activations=acts,
            inputs=inputs,
            loss=1.0,
            lr=0.01,
        )
    elapsed = time.perf_counter() - t0
    engine.close_trace()
    return elapsed / steps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=200, help="training steps for the size measurement")
    ap.add_argument("--cost-steps", type=int, default=20_000, help="steps per write-cost measurement")
    ap.add_argument("--json", action="store_true", help="print the numbers as JSON")
    args = ap.parse_args()

    with tempfile.TemporaryDirectory(dir=os.environ.get("NDBG_BENCH_DIR")) as workdir:
        info = trace_size(args.steps, workdir)
        n = args.cost_steps
        cost = {
            "no trace": write_cost(n, None, workdir, trace=False),
            "trace, sync every 10 s (default)": write_cost(n, None, workdir, trace=True),
            "trace, sync on close only": write_cost(n, float("inf"), workdir, trace=True),
            "trace, sync every step": write_cost(max(n // 20, 200), 0.0, workdir, trace=True),
        }
    result = {
        "model": f"{DEPTH} x (Linear({WIDTH}, {WIDTH}) + Tanh): {info['model']['parameters']} parameters, "
        f"{info['model']['activations']} activations",
        "steps": info["steps"],
        "file_bytes": info["bytes"],
        "bytes_per_step": info["bytes_per_step"],
        "us_per_step": {k: v * 1e6 for k, v in cost.items()},
    }
    if args.json:
        print(json.dumps(result, indent=2))
        return 0
    print(result["model"])
    print(
        f"trace of {result['steps']} steps: {result['file_bytes']} bytes, {result['bytes_per_step']:.0f} bytes per step"
    )
    base = cost["no trace"]
    for name, seconds in cost.items():
        extra = "" if name == "no trace" else f"  (+{(seconds - base) * 1e6:.1f} us)"
        print(f"  {name:<34} {seconds * 1e6:8.1f} us per step{extra}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
