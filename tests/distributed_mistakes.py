"""Ordinary torchrun mistakes (tests/test_first_hour.py launches one scenario per 2-process job):
each rank trains its own small model (only NeuralDBG's own collectives link the ranks) and
writes what it saw to OUT/rank<r>.json."""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict

import torch
import torch.distributed as dist
import torch.nn as nn

from neuraldbg import NeuralDbg, NeuralDbgWarning


def step(model: nn.Module, opt: Any) -> None:
    opt.zero_grad()
    nn.functional.mse_loss(model(torch.randn(8, 8)), torch.randn(8, 1)).backward()
    opt.step()


def model_and_optimizer() -> tuple[nn.Module, Any]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 1))
    return model, torch.optim.SGD(model.parameters(), lr=0.01)


def watched(rank: int, out: str, steps: int = 12, enter: bool = True, **options: Any) -> Dict[str, Any]:
    """``steps`` steps inside ``with NeuralDbg(model, **options)`` (outside it when not
    ``enter``)."""
    model, opt = model_and_optimizer()
    t0 = time.monotonic()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if enter:
            with NeuralDbg(model, distributed_timeout=3.0, **options):
                for _ in range(steps):
                    step(model, opt)
        else:
            for _ in range(steps):
                step(model, opt)
    return {
        "loop_steps": steps,
        "seconds": time.monotonic() - t0,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, NeuralDbgWarning)],
    }


def raises_lives_on(rank: int, out: str) -> Dict[str, Any]:
    """Rank 1 raises inside the block at step 8, catches it outside and stays alive."""
    model, opt = model_and_optimizer()
    t0 = time.monotonic()
    done = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with NeuralDbg(model, distributed_timeout=60.0, trace=os.path.join(out, "x.ndbg")):
                for i in range(20):
                    if rank == 1 and i == 8:
                        raise KeyError("planted")
                    step(model, opt)
                    done += 1
        except KeyError:
            time.sleep(1.0)  # alive, doing something else
    return {
        "loop_steps": done,
        "seconds": time.monotonic() - t0,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, NeuralDbgWarning)],
    }


SCENARIOS: Dict[str, Callable[[int, str], Dict[str, Any]]] = {
    "plain": lambda r, o: watched(r, o, enter=False),
    "off_one_trace": lambda r, o: watched(r, o, distributed="off", trace=os.path.join(o, "x.ndbg")),
    "off_per_rank": lambda r, o: watched(r, o, distributed="off", trace=os.path.join(o, "y.ndbg"), trace_rank=None),
    "trace_rank_5": lambda r, o: watched(r, o, trace=os.path.join(o, "x.ndbg"), trace_rank=5),
    "rank0_only": lambda r, o: watched(r, o, enter=r == 0, trace=os.path.join(o, "x.ndbg")),
    "raises_lives_on": raises_lives_on,
}


def main() -> None:
    out, name = sys.argv[1], sys.argv[2]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.set_num_threads(1)
    result = SCENARIOS[name](rank, out)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
