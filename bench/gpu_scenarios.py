"""The scenario suite on a real CUDA device against the same scenarios on the CPU host path.

`bench/scoreboard.py` and the tests run every planted scenario on the CPU, and the CUDA code path
only through its CPU stand-in (``NEURALDBG_DEVICE_PATH=deferred``). On a machine with a GPU this
runs each scenario twice under the default ``NeuralDbg``: on the CPU as the suite does, and with
the model, the loss module and every batch moved to ``cuda`` (TF32 off, so the arithmetic is
float32 on both). It prints one row per scenario: the steps observed on each, and the top
hypothesis (failure, cause, layer, step; only at confidence >= 0.5) on each; "same" when they
agree. Float32 sums on a GPU are not bit-equal to the CPU's, so a step or two apart on a
threshold crossing is arithmetic, not a bug; a different failure, cause or layer is worth a look.

    python bench/gpu_scenarios.py [--only NAME,NAME]

Exits 0 with "no CUDA device" on a machine without one; 1 when a row differs in failure, cause,
layer or steps observed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch

from bench import scenarios as S
from bench import suite

Top = Optional[Tuple[str, str, Optional[str], Optional[int]]]


def on(device: str, setup: S.Setup) -> S.Setup:
    """The setup with its model, loss module and batches on ``device`` (the optimizer holds the
    same Parameter objects, moved in place before any state exists)."""
    setup.model.to(device)
    setup.criterion.to(device)
    batch = setup.batch

    def batch_at(i: int) -> S.Batch:
        x, y = batch(i)
        return x.to(device), y.to(device)

    setup.batch = batch_at
    return setup


def diagnose(scenario: S.Scenario, device: str) -> Tuple[int, Top, Optional[BaseException]]:
    from neuraldbg import NeuralDbg

    torch.manual_seed(0)
    setup = on(device, scenario.build())
    dbg = NeuralDbg(setup.model)
    error: Optional[BaseException] = None
    try:
        with dbg:
            S.train(setup)  # (without the suite's recorder, which reads values on the host)
    except Exception as e:  # a planted crash is part of some scenarios
        error = e
    hyps = [h for h in dbg.explain_failure()[:1] if h.confidence >= 0.5]
    top: Top = (str(hyps[0].failure), str(hyps[0].cause), hyps[0].layer, hyps[0].step) if hyps else None
    return dbg.step, top, error


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--only", default="", help="comma-separated scenario names")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("no CUDA device: gpu scenarios skipped")
        return 0
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.set_num_threads(1)
    wanted = {n for n in args.only.split(",") if n}
    chosen: List[Any] = [s for s in suite.all_scenarios() if not wanted or s.name in wanted]
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {len(chosen)} scenarios, TF32 off")
    print("| scenario | steps cpu/cuda | top on cpu | top on cuda | verdict |")
    print("|---|---|---|---|---|")
    differ = 0
    t0 = time.perf_counter()
    for s in chosen:
        try:
            host_steps, host, _ = diagnose(s, "cpu")
            dev_steps, dev, _ = diagnose(s, "cuda")
        except Exception as e:  # a scenario that cannot run on the device is a row, not a stop
            print(f"| {s.name} | error: {type(e).__name__}: {str(e)[:100]} | | | differs |")
            differ += 1
            continue
        if host == dev and host_steps == dev_steps:
            verdict = "same"
        elif host_steps == dev_steps and host is not None and dev is not None and host[:3] == dev[:3]:
            verdict = "step differs"
        else:
            verdict = "differs"
            differ += 1
        print(f"| {s.name} | {host_steps}/{dev_steps} | {host} | {dev} | {verdict} |", flush=True)
    print(f"{differ} of {len(chosen)} differ in failure, cause, layer or steps; {time.perf_counter() - t0:.0f} s")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
