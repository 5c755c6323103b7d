"""What watching a distributed job costs: a 2-process DDP and FSDP2 job (gloo, CPU, one thread
per process) timed unwatched and watched, interleaved, and the collectives we add per step,
counted by wrapping torch.distributed's collectives (not assumed).

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/distributed_overhead.py

(`make bench-distributed` runs exactly this.) Rank 0 prints one line per configuration: the
median time of a training step unwatched and watched over ROUNDS alternating rounds of STEPS
steps, their ratio, and collectives per step unwatched and watched.
"""

from __future__ import annotations

import contextlib
import statistics
import sys
import time
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

from neuraldbg import NeuralDbg

STEPS = 50
ROUNDS = 5
WIDTH = 256
DEPTH = 8
BATCH = 64

COLLECTIVES = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
    "all_to_all_single", "barrier", "gather", "reduce",
)


class Count:
    def __init__(self) -> None:
        self.n = 0
        self.saved: Dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> "Count":
        for name in COLLECTIVES:
            f = getattr(dist, name)
            self.saved[name] = f

            def wrapped(*a: Any, _f: Callable[..., Any] = f, **k: Any) -> Any:
                self.n += 1
                return _f(*a, **k)

            setattr(dist, name, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, f in self.saved.items():
            setattr(dist, name, f)


def build(kind: str) -> nn.Module:
    torch.manual_seed(0)
    layers: List[nn.Module] = [nn.Linear(64, WIDTH), nn.ReLU()]
    for _ in range(DEPTH - 2):
        layers += [nn.Linear(WIDTH, WIDTH), nn.ReLU()]
    layers.append(nn.Linear(WIDTH, 10))
    model = nn.Sequential(*layers)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.fsdp import fully_shard

    for m in model:
        if isinstance(m, nn.Linear):
            fully_shard(m)
    fully_shard(model)
    return model


def run(model: nn.Module, watched: bool, steps: int) -> "tuple[float, int]":
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [(torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(steps)]

    def loop() -> None:
        for x, y in batches:
            opt.zero_grad()
            criterion(model(x), y).backward()
            opt.step()

    # Entering the block (hooks, our process group) is once per run: outside the timing.
    dbg = NeuralDbg(model, criterion=criterion) if watched else contextlib.nullcontext()
    with dbg:
        dist.barrier()
        with Count() as c:
            t0 = time.perf_counter()
            loop()
            dist.barrier()
            dt = time.perf_counter() - t0
    return dt / steps, c.n - 1  # the closing barrier is ours, not the loop's


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for kind in ("ddp", "fsdp2"):
        model = build(kind)
        run(model, False, 5)  # warm-up
        run(model, True, 5)
        plain: List[float] = []
        watched: List[float] = []
        counts = {False: 0, True: 0}
        for _ in range(ROUNDS):
            for w in (False, True):
                dt, n = run(model, w, STEPS)
                (watched if w else plain).append(dt)
                counts[w] = n
        if rank == 0:
            p, m = statistics.median(plain), statistics.median(watched)
            print(
                f"{kind:6s} {dist.get_world_size()} ranks, {DEPTH} x Linear({WIDTH}), batch {BATCH}/rank: "
                f"plain {p * 1e3:.2f} ms/step, watched {m * 1e3:.2f} ms/step, x{m / p:.3f}; "
                f"collectives/step plain {counts[False] / STEPS:.2f}, watched {counts[True] / STEPS:.2f}",
                flush=True,
            )
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
