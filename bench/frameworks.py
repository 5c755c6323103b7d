#!/usr/bin/env python3
"""Overhead under PyTorch Lightning (`make bench-frameworks`): ``Trainer.fit`` of the same model
for the same steps, without and with ``neuraldbg.lightning.NeuralDbgCallback`` (trace and
report on, as a user gets it), alternating the two arms ``--rounds`` times after one warm-up fit
of each. Reported: median fit time with the callback / median fit time without, on one CPU
thread. A fit includes Lightning's own setup (identical in both arms), so the ratio slightly
understates the per-step cost; the per-step time is printed too.

The model is the overhead benchmark's transformer (4 layers, d_model 128, seq 64, batch 16)
wrapped in a LightningModule whose training_step calls the wrapped model (the LightningModule
itself is never called), Adam, ``gradient_clip_val=1.0``, ``accumulate_grad_batches=2``.
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from overhead import Transformer


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20, help="optimizer steps per fit")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    import lightning.pytorch as L

    from neuraldbg.lightning import NeuralDbgCallback

    class Module(L.LightningModule):
        def __init__(self, net: nn.Module) -> None:
            super().__init__()
            self.net = net

        def training_step(self, batch, batch_idx):
            x, y = batch
            return nn.functional.cross_entropy(self.net(x), y)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=1e-3)

    torch.manual_seed(0)
    base = Transformer(1000, 128, 4, 4)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(
        torch.randint(0, 1000, (16 * 16, 64), generator=g), torch.randint(0, 10, (16 * 16,), generator=g)
    )
    loader = torch.utils.data.DataLoader(data, batch_size=16)

    def fit(watch: bool) -> float:
        module = Module(copy.deepcopy(base))
        with tempfile.TemporaryDirectory() as tmp:
            trainer = L.Trainer(
                default_root_dir=tmp,
                max_steps=args.steps,
                accelerator="cpu",
                devices=1,
                callbacks=[NeuralDbgCallback(verbose=False)] if watch else [],
                logger=L.loggers.CSVLogger(tmp),
                enable_progress_bar=False,
                enable_model_summary=False,
                enable_checkpointing=False,
                gradient_clip_val=1.0,
                accumulate_grad_batches=2,
            )
            t0 = time.perf_counter()
            trainer.fit(module, loader)
            elapsed = time.perf_counter() - t0
            assert trainer.global_step == args.steps
        return elapsed

    fit(False)
    fit(True)
    times = {False: [], True: []}
    for r in range(args.rounds):
        for watch in (False, True) if r % 2 == 0 else (True, False):
            times[watch].append(fit(watch))
    plain, ours = statistics.median(times[False]), statistics.median(times[True])
    out = {
        "model": "transformer (4 layers, d_model 128, seq 64, batch 16) under Lightning",
        "steps": args.steps,
        "plain_fit_s": round(plain, 3),
        "plain_step_ms": round(plain / args.steps * 1e3, 1),
        "neuraldbg_fit_s": round(ours, 3),
        "ratio": round(ours / plain, 3),
    }
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
