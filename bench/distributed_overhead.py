"""What watching a distributed job costs: a 2-process DDP and FSDP2 job (gloo, CPU, one thread
per process) timed unwatched and watched, interleaved, and the collectives we add per step,
counted by wrapping torch.distributed's collectives (not assumed).

    python -m torch.distributed.run --standalone --nproc_per_node=2 bench/distributed_overhead.py

(`make bench-distributed` runs exactly this.) Three arms take turns in rotating order, ROUNDS
rounds of STEPS steps each: unwatched, watched per rank (`distributed="off"`: what one process
costs) and watched job-wide (the default). Rank 0 prints the median time of a training step of
each, its ratio to unwatched, and collectives per step. Two clocks: the training
thread's CPU time (`time.thread_time`; with one torch thread every kernel of the loop runs on it,
and it does not count time other processes held the core or time spent waiting for the other
rank: what watching costs this rank's CPU) and wall time between two barriers (what the job
feels, including any wait; noisy on a shared machine).
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
ROUNDS = 9
# Untimed steps at the start of each watched block (registration and the dense first steps).
WARM = 12
# plain: unwatched; rank: NeuralDbg(distributed="off") (each rank watches itself, no
# collective); job: the default, job-wide statistics (one collective per step).
ARMS = ["plain", "rank", "job"]
WIDTH = 256
DEPTH = 8
BATCH = 64

COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "broadcast",
    "all_to_all_single",
    "barrier",
    "gather",
    "reduce",
)


class Count:
    def __init__(self) -> None:
        self.n = 0
        self.saved: Dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Count:
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


def run(model: nn.Module, arm: str, steps: int) -> tuple[float, float, int]:
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    criterion = nn.CrossEntropyLoss()
    g = torch.Generator().manual_seed(dist.get_rank())
    batches = [(torch.randn(BATCH, 64, generator=g), torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(steps)]

    def loop(n: int = steps) -> None:
        for x, y in batches[:n]:
            opt.zero_grad()
            criterion(model(x), y).backward()
            opt.step()

    # Entering the block (hooks, our process group) is once per run: outside the timing.
    if arm == "plain":
        dbg: Any = contextlib.nullcontext()
    else:
        dbg = NeuralDbg(model, criterion=criterion, distributed="auto" if arm == "job" else "off")
    with dbg:
        # Registration and the dense first steps (10 with every activation measured) are once
        # per run too: untimed, so that the timed steps are the steady state.
        loop(min(WARM, steps))
        dist.barrier()
        with Count() as c:
            t0, c0 = time.perf_counter(), time.thread_time()
            loop()
            c1 = time.thread_time()
            dist.barrier()
            dt = time.perf_counter() - t0
    return dt / steps, (c1 - c0) / steps, c.n - 1  # the closing barrier is ours, not the loop's


def main() -> None:
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    for kind in ("ddp", "fsdp2"):
        model = build(kind)
        for arm in ARMS:  # warm-up
            run(model, arm, 5)
        wall: Dict[str, List[float]] = {a: [] for a in ARMS}
        cpu: Dict[str, List[float]] = {a: [] for a in ARMS}
        counts = dict.fromkeys(ARMS, 0)
        for i in range(ROUNDS):
            for arm in ARMS[i % 3 :] + ARMS[: i % 3]:  # rotating order
                dt, ct, n = run(model, arm, STEPS)
                wall[arm].append(dt)
                cpu[arm].append(ct)
                counts[arm] = n
        if rank == 0:
            c = {a: statistics.median(cpu[a]) for a in ARMS}
            w = {a: statistics.median(wall[a]) for a in ARMS}
            print(
                f"{kind:6s} {dist.get_world_size()} ranks, {DEPTH} x Linear({WIDTH}), batch {BATCH}/rank\n"
                f"  thread CPU ms/step: plain {c['plain'] * 1e3:.2f}, per-rank {c['rank'] * 1e3:.2f} "
                f"(x{c['rank'] / c['plain']:.3f}), job-wide {c['job'] * 1e3:.2f} (x{c['job'] / c['plain']:.3f})\n"
                f"  wall ms/step:       plain {w['plain'] * 1e3:.2f}, per-rank {w['rank'] * 1e3:.2f} "
                f"(x{w['rank'] / w['plain']:.3f}), job-wide {w['job'] * 1e3:.2f} (x{w['job'] / w['plain']:.3f})\n"
                f"  collectives/step:   plain {counts['plain'] / STEPS:.2f}, per-rank {counts['rank'] / STEPS:.2f}, "
                f"job-wide {counts['job'] / STEPS:.2f}",
                flush=True,
            )
    dist.destroy_process_group()
    sys.exit(0)


if __name__ == "__main__":
    main()
