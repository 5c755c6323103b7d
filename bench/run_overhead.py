#!/usr/bin/env python3
"""`neuraldbg run` against the in-code API (`make bench-run`): what watching an unchanged
script costs over wrapping its loop in ``with NeuralDbg(model)``.

One training script (an MLP on CPU, one thread, ``loss.item()`` each step) runs in three ways,
each in its own process: ``plain`` (``python train.py``), ``in-code`` (``python train.py
--in-code``: the loop inside ``with NeuralDbg(model, trace=...)``) and ``run`` (``python -m
neuraldbg run train.py``: no line changed; it also writes a trace). The script times its own
loop after a warm-up, so process start and the report written at exit are left out; the three
arms take turns, in a shuffled order each round, and the figure is the median over rounds of
each round's ratio (``run / in-code``, and each against ``plain``), with its range.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
import textwrap
from typing import Dict, List

SCRIPT = """
    import sys, time
    import torch, torch.nn as nn
    torch.set_num_threads(1)
    torch.manual_seed(0)
    width, layers, steps, warm = {width}, {layers}, {steps}, {warm}
    blocks = []
    for _ in range(layers):
        blocks += [nn.Linear(width, width), nn.ReLU()]
    model = nn.Sequential(*blocks, nn.Linear(width, 1))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(128, width); y = torch.randn(128, 1)

    def train():
        start = 0.0
        for step in range(steps):
            if step == warm:
                start = time.perf_counter()
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            loss.item()
        print(f"loop_ms_per_step {{(time.perf_counter() - start) * 1e3 / (steps - warm):.6f}}", flush=True)

    if "--in-code" in sys.argv:
        from neuraldbg import NeuralDbg
        with NeuralDbg(model, trace=sys.argv[-1]):
            train()
    else:
        train()
"""


def one(arm: str, script: str, folder: str, k: int) -> float:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    out = os.path.join(folder, f"{arm}-{k}")
    if arm == "plain":
        cmd = [sys.executable, script]
    elif arm == "in-code":
        cmd = [sys.executable, script, "--in-code", out + ".ndbg"]
    else:
        cmd = [sys.executable, "-m", "neuraldbg", "run", "--quiet", "--out", out, script]
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    found = re.search(r"loop_ms_per_step (\S+)", done.stdout)
    assert found is not None, done.stdout + done.stderr
    return float(found.group(1))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--steps", type=int, default=400)
    p.add_argument("--warm", type=int, default=50, help="steps left out of the timing (registration, dense steps)")
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    arms = ["plain", "in-code", "run"]
    times: Dict[str, List[float]] = {arm: [] for arm in arms}
    order = random.Random(a.seed)
    with tempfile.TemporaryDirectory() as folder:
        script = os.path.join(folder, "train.py")
        with open(script, "w") as f:
            f.write(textwrap.dedent(SCRIPT.format(width=a.width, layers=a.layers, steps=a.steps, warm=a.warm)))
        for k in range(a.rounds):
            turn = arms[:]
            order.shuffle(turn)
            for arm in turn:
                times[arm].append(one(arm, script, folder, k))
    print(
        f"MLP {a.layers}x{a.width}, batch 128, {a.steps} steps ({a.warm} warm-up left out), "
        f"{a.rounds} rounds, one CPU thread"
    )
    for arm in arms:
        print(f"  {arm:<8} {statistics.median(times[arm]):.3f} ms/step (median)")
    for num, den in (("run", "in-code"), ("in-code", "plain"), ("run", "plain")):
        ratios = sorted(x / y for x, y in zip(times[num], times[den]))
        print(f"  {num} / {den}: {statistics.median(ratios):.3f}x (rounds {ratios[0]:.3f}-{ratios[-1]:.3f}x)")


if __name__ == "__main__":
    main()
