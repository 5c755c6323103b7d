#!/usr/bin/env python3
"""What the mechanisms of watching cost by themselves, on a fast step (issue 12).

Arms, interleaved in 10-step blocks like ``bench/overhead.py`` (one thread, thread CPU time,
SGD, batch 64, 32-wide MLP of ``--depth`` layers):

* ``plain`` and ``A/A``: the loop alone (the A/A ratio is the noise);
* ``skeleton``: the same hooks NeuralDBG installs, each doing nothing: forward pre/post hooks
  on the model, a pass-through ``torch.autograd.backward``, two post-accumulate-grad sentinels
  that queue an end-of-backward callback, a tensor hook on one parameter and the optimizer step
  post hook (an unmeasured step records no layer call: no ``forward`` wrapper);
* ``skeleton+read``: plus the extension's reads (input statistics at forward start, every
  gradient norm at the end of backward);
* ``neuraldbg``: the real thing.

The differences say how much of NeuralDBG's cost is the mechanism, the reading, and the rest
(its own Python between them). Run: ``.venv/bin/python bench/skeleton.py --depth 16``.
"""

from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time
from typing import Any, Callable, List

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from overhead import MLP, Arm, Batch, unwrapped


class Skeleton(Arm):
    """The loop with NeuralDBG's hook mechanisms doing nothing (``read``: plus the reads)."""

    read = False

    def enter(self) -> None:
        from torch.autograd import Variable
        from torch.optim.optimizer import register_optimizer_step_post_hook

        from neuraldbg._measure_host import reader

        model = self.model
        params = list(model.parameters())
        rd = reader()
        grads = np.empty(len(params), dtype=np.float32)
        queue = Variable._execution_engine.queue_callback
        queued = [False]
        read = self.read

        def pre(module: Any, args: Any, kwargs: Any) -> None:
            if read:
                rd.stats(args[0])

        def end() -> None:
            queued[0] = False
            if read:
                rd.norms(params, grads, "grad")

        def sentinel(p: Any) -> None:
            if not queued[0]:
                queued[0] = True
                queue(end)

        self.handles = [
            model.register_forward_pre_hook(pre, with_kwargs=True),
            model.register_forward_hook(lambda m, a, o: None),
            register_optimizer_step_post_hook(lambda o, a, k: None),
            params[0].register_post_accumulate_grad_hook(sentinel),
            params[-1].register_post_accumulate_grad_hook(sentinel),
            params[0].register_hook(lambda g: None),
        ]

    def exit(self) -> None:
        for h in self.handles:
            h.remove()

    def block(self, n: int, record: bool) -> None:
        with unwrapped():  # the watched arm's process-wide pieces put aside, then ours
            self._block(n, record)

    def _block(self, n: int, record: bool) -> None:
        original_backward = torch.autograd.backward

        def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            return original_backward(tensors, *args, **kwargs)

        torch.autograd.backward = backward  # type: ignore[assignment]
        try:
            t0 = time.thread_time()
            for _ in range(n):
                self.step()
            if record:
                self.times.append(time.thread_time() - t0)
        finally:
            torch.autograd.backward = original_backward


class SkeletonRead(Skeleton):
    read = True


class Watched(Arm):
    keep_wrappers = True

    def enter(self) -> None:
        from neuraldbg import NeuralDbg

        self.dbg = NeuralDbg(self.model)
        self.dbg.__enter__()

    def exit(self) -> None:
        self.dbg.__exit__(None, None, None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--depth", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=200)
    args = ap.parse_args()
    torch.set_num_threads(1)
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    batches: List[Batch] = [
        (torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g)) for _ in range(8)
    ]
    base = MLP(depth=args.depth)
    kinds: List[Callable[..., Arm]] = [Arm, Arm, Skeleton, SkeletonRead, Watched]
    names = ["plain", "A/A", "skeleton", "skeleton+read", "neuraldbg"]
    arms = [kind(name, copy.deepcopy(base), batches, True) for kind, name in zip(kinds, names)]
    for a in arms:
        a.enter()
        a.block(30, False)
    for r in range(args.rounds):
        k = r % len(arms)
        for a in arms[k:] + arms[:k]:
            a.block(10, True)
    for a in arms:
        a.exit()
    plain = statistics.median(arms[0].times)
    print(f"MLP {args.depth} x (Linear 32x32 + ReLU), batch 64, SGD: plain {plain / 10 * 1e3:.3f} ms a step")
    for a in arms:
        m = statistics.median(a.times)
        print(f"  {a.name:14s} {m / plain:.3f}x  {(m - plain) / 10 * 1e6:+7.1f} us a step")


if __name__ == "__main__":
    main()
