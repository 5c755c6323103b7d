"""`make gpu-check`: what watching costs on a CUDA device, against the targets (issue 26).

On a machine with a GPU, in one process, each model is trained watched and unwatched (two
copies with the same weights, same batches), taking turns in blocks of steps, and this measures:

* step time: the median over rounds of (watched block time / unwatched block time), timed with
  CUDA events around each block (target <= 1.03x);
* peak memory of a step: ``torch.cuda.max_memory_allocated`` after each single step, the
  largest over healthy unsampled steps and over sampled steps (every 10th measures the
  activations), watched over unwatched (targets <= 1.05x and <= 1.10x);
* synchronizing CUDA runtime calls per healthy step: ``torch.profiler`` over watched steps,
  counting ``cudaEventSynchronize``, ``cudaStreamSynchronize``, ``cudaDeviceSynchronize`` and
  blocking ``cudaMemcpy`` (not ``cudaMemcpyAsync``), minus the same count unwatched (target 0).

Models: ResNet-50 (torchvision, batch 64, 224x224) and a GPT-2-small-sized language model
(transformers' GPT2LMHeadModel with the default config, 124M parameters, batch 8, 512 tokens),
each eager and under ``torch.compile``, in bf16 autocast with AdamW. The loop reads no loss
value, so any synchronization counted is the debugger's. With two or more GPUs a 2-process
NCCL DDP job (``bench/distributed_overhead.py``) runs too.

It prints one table and exits 1 when a figure is past its target, 0 when all are within, and 0
with "no CUDA device: gpu-check skipped" on a machine without one. Budget: under 5 minutes on
one recent GPU (``--steps``, ``--models`` and ``--no-compile`` shorten it).

    .venv/bin/python bench/gpu_check.py [--models resnet50,gpt2] [--steps 30] [--no-compile]

``--profile`` (with ``--compiled-only`` or ``--no-compile``) prints, instead of the table, where a
watched step's time goes: GPU and CPU time and kernel launches a step for unwatched, watched and
watched with ``forward_check="off"``, then the watched step's Python functions by own time.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from typing import Any, Callable, Dict, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

TIME_TARGET = 1.03
MEMORY_TARGET = 1.05
SAMPLED_MEMORY_TARGET = 1.10
SYNCS = ("cudaEventSynchronize", "cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy")
BLOCK = 10  # steps a turn: the debugger's sample period, so each block holds one sampled step


def build(name: str) -> Tuple[Any, Callable[[Any], Any]]:
    """(model on the GPU, step function taking the model)."""
    import torch

    torch.manual_seed(0)
    if name == "resnet50":
        import torchvision

        model = torchvision.models.resnet50(weights=None).cuda()
        x = torch.randn(64, 3, 224, 224, device="cuda")
        y = torch.randint(0, 1000, (64,), device="cuda")

        def loss_of(m: Any) -> Any:
            return torch.nn.functional.cross_entropy(m(x), y)

    elif name == "gpt2":
        import transformers

        model = transformers.GPT2LMHeadModel(transformers.GPT2Config()).cuda()
        tokens = torch.randint(0, 50257, (8, 512), device="cuda")

        def loss_of(m: Any) -> Any:
            return m(input_ids=tokens, labels=tokens).loss

    else:
        raise SystemExit(f"unknown model {name!r}: resnet50, gpt2")
    return model, loss_of


class Arm:
    """One copy of the model and its optimizer; ``dbg`` when watched (``options``: the debugger's
    keyword arguments)."""

    def __init__(
        self,
        model: Any,
        loss_of: Callable[[Any], Any],
        compiled: bool,
        watched: bool,
        options: Optional[Dict[str, Any]] = None,
    ) -> None:
        import copy

        import torch

        self.model = copy.deepcopy(model)
        self.run = torch.compile(self.model) if compiled else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.loss_of = loss_of
        self.dbg: Any = None
        if watched:
            from neuraldbg import NeuralDbg

            self.dbg = NeuralDbg(self.model, **(options or {}))
            self.dbg.__enter__()

    def step(self) -> None:
        import torch

        self.opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = self.loss_of(self.run)
        loss.backward()
        self.opt.step()

    def close(self) -> None:
        if self.dbg is not None:
            self.dbg.__exit__(None, None, None)


def warm_up(arms: List[Arm]) -> None:
    """Compilation, and the debugger's dense first steps, before anything is timed."""
    import torch

    for arm in arms:
        for _ in range(2 * BLOCK + 1):
            arm.step()
    torch.cuda.synchronize()


def timed_block(arm: Arm, steps: int) -> float:
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(steps):
        arm.step()
    end.record()
    end.synchronize()
    return float(start.elapsed_time(end))


def peaks(arm: Arm, steps: int) -> Tuple[float, float]:
    """The largest per-step peak over unsampled steps and over sampled ones (bytes)."""
    import torch

    plain: List[int] = []
    sampled: List[int] = []
    for _ in range(steps):
        step_no = arm.dbg.step if arm.dbg is not None else len(plain) + len(sampled)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        arm.step()
        torch.cuda.synchronize()
        (sampled if step_no % BLOCK == 0 else plain).append(torch.cuda.max_memory_allocated())
    return float(max(plain)), float(max(sampled) if sampled else max(plain))


def syncs(arm: Arm, steps: int) -> float:
    """Synchronizing CUDA runtime calls per step (the profiler's CPU-side runtime events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            arm.step()
        torch.cuda.synchronize()
    count = sum(1 for e in prof.events() if e.name in SYNCS)
    return (count - 1) / steps  # (less the profiler window's own final synchronize)


def check(name: str, compiled: bool, steps: int) -> Dict[str, Any]:
    import torch

    model, loss_of = build(name)
    plain = Arm(model, loss_of, compiled, watched=False)
    watched = Arm(model, loss_of, compiled, watched=True)
    try:
        warm_up([plain, watched])
        ratios = []
        for r in range(max(1, steps // BLOCK)):
            order = (plain, watched) if r % 2 == 0 else (watched, plain)
            t = {id(a): timed_block(a, BLOCK) for a in order}
            ratios.append(t[id(watched)] / t[id(plain)])
        p_plain, s_plain = peaks(plain, BLOCK + 1)
        p_watch, s_watch = peaks(watched, BLOCK + 1)
        sync_watch = syncs(watched, BLOCK)
        sync_plain = syncs(plain, BLOCK)
        observed = watched.dbg.step
    finally:
        plain.close()
        watched.close()
    del plain, watched, model
    torch.cuda.empty_cache()
    return {
        "time": statistics.median(ratios),
        "memory": p_watch / p_plain,
        "sampled_memory": s_watch / s_plain,
        "syncs": max(0.0, sync_watch - sync_plain),
        "observed": observed,
    }


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx")


def profile_arms(name: str, compiled: bool, steps: int) -> None:
    """Where a watched step's time goes (``--profile``): per arm (unwatched, watched, watched
    with ``forward_check="off"``), the GPU time of a step (CUDA events around blocks), the
    calling thread's CPU time a step (the launches included), and kernel launches a step; then
    the watched step's Python functions by own time (cProfile over one block)."""
    import cProfile
    import pstats

    import torch
    from torch.profiler import ProfilerActivity, profile

    model, loss_of = build(name)
    arms = {
        "plain": Arm(model, loss_of, compiled, watched=False),
        "watched": Arm(model, loss_of, compiled, watched=True),
        "forward_check=off": Arm(model, loss_of, compiled, watched=True, options={"forward_check": "off"}),
    }
    label = f"{name}{' compiled' if compiled else ''}"
    try:
        warm_up(list(arms.values()))
        gpu: Dict[str, List[float]] = {k: [] for k in arms}
        cpu: Dict[str, List[float]] = {k: [] for k in arms}
        for r in range(max(1, steps // BLOCK)):
            for k in list(arms) if r % 2 == 0 else list(arms)[::-1]:
                c = time.thread_time()
                gpu[k].append(timed_block(arms[k], BLOCK) / BLOCK)
                cpu[k].append((time.thread_time() - c) * 1e3 / BLOCK)
        for k, arm in arms.items():
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(BLOCK):
                    arm.step()
                torch.cuda.synchronize()
            names = [e.name for e in prof.events()]
            launches = sum(1 for n in names if n in LAUNCHES) / BLOCK
            ops = sum(1 for n in names if n.startswith("aten::")) / BLOCK
            print(
                f"PROFILE {label} | {k} | step {statistics.median(gpu[k]):.2f} ms (events) | "
                f"CPU {statistics.median(cpu[k]):.2f} ms | {launches:.0f} launches | {ops:.0f} aten ops a step",
                flush=True,
            )
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(BLOCK):
            arms["watched"].step()
        torch.cuda.synchronize()
        pr.disable()
        stats = pstats.Stats(pr)
        rows = sorted(stats.stats.items(), key=lambda kv: -kv[1][2])  # type: ignore[attr-defined]
        for (file, line, fn), (_cc, nc, tt, ct, _) in rows[:25]:
            print(
                f"PYPROF {label} | {fn} ({os.path.basename(file)}:{line}) | calls {nc / BLOCK:.0f}/step | own {tt * 1e3 / BLOCK:.2f} ms/step | cum {ct * 1e3 / BLOCK:.2f} ms/step"
            )
    finally:
        for arm in arms.values():
            arm.close()
    del arms, model
    torch.cuda.empty_cache()


def nccl_job() -> Optional[str]:
    """A 2-process DDP job over NCCL (this script with ``--nccl-worker`` under torchrun), when
    there are two GPUs: its rank 0's line."""
    import torch

    if torch.cuda.device_count() < 2:
        return None
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node=2",
            os.path.abspath(__file__),
            "--nccl-worker",
        ],
        capture_output=True,
        text=True,
        timeout=240,
    )
    lines = [ln for ln in (out.stdout + out.stderr).splitlines() if ln.startswith("NCCL")]
    return lines[-1] if lines else (out.stdout + out.stderr)[-1500:]


def nccl_worker() -> int:
    """One rank of the NCCL job: a DDP MLP watched job-wide vs unwatched, in turns."""
    import torch
    import torch.distributed as dist
    import torch.nn as nn

    from neuraldbg import NeuralDbg

    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(rank)
    torch.manual_seed(0)
    layers: List[Any] = []
    for _ in range(8):
        layers += [nn.Linear(2048, 2048), nn.GELU()]
    base = nn.Sequential(*layers, nn.Linear(2048, 10)).cuda()
    x = torch.randn(256, 2048, device="cuda")
    y = torch.randint(0, 10, (256,), device="cuda")
    arms = []
    import copy

    for watch in (False, True):
        model = nn.parallel.DistributedDataParallel(copy.deepcopy(base), device_ids=[rank])
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        dbg = NeuralDbg(model) if watch else None
        if dbg is not None:
            dbg.__enter__()
        arms.append((model, opt, dbg))

    def step(model: Any, opt: Any) -> None:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()

    ratios = []
    for r in range(8):
        times = []
        for model, opt, _ in arms if r % 2 == 0 else arms[::-1]:
            dist.barrier()
            t = time.perf_counter()
            for _ in range(BLOCK):
                step(model, opt)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        t_plain, t_watched = (times[0], times[1]) if r % 2 == 0 else (times[1], times[0])
        if r:  # (the first round warms up)
            ratios.append(t_watched / t_plain)
    dbg = arms[1][2]
    assert dbg is not None
    dbg.__exit__(None, None, None)
    if rank == 0:
        print(
            f"NCCL DDP 2 ranks, 8x Linear 2048: step time {statistics.median(ratios):.3f}x, {dbg.step} steps observed"
        )
    dist.destroy_process_group()
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="resnet50,gpt2")
    ap.add_argument("--steps", type=int, default=30, help="timed steps per arm (blocks of 10)")
    ap.add_argument("--no-compile", action="store_true")
    ap.add_argument("--nccl-worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", action="store_true", help="where the watched step's time goes, per model")
    ap.add_argument("--compiled-only", action="store_true", help="only the compiled models")
    args = ap.parse_args()
    if args.nccl_worker:
        return nccl_worker()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: gpu-check skipped")
        return 0
    print(
        f"{torch.cuda.get_device_name()} x{torch.cuda.device_count()}, torch {torch.__version__}; bf16 autocast, AdamW"
    )
    if args.profile:
        modes = (True,) if args.compiled_only else (False,) if args.no_compile else (False, True)
        for name in args.models.split(","):
            for compiled in modes:
                profile_arms(name, compiled, args.steps)
        return 0
    print("| model | step time | peak memory | sampled step memory | syncs a step | steps observed | verdict |")
    print("|---|---|---|---|---|---|---|")
    failed = False
    t0 = time.perf_counter()
    for name in args.models.split(","):
        for compiled in (False,) if args.no_compile else (False, True):
            label = f"{name}{' compiled' if compiled else ''}"
            try:
                r = check(name, compiled, args.steps)
            except Exception as e:  # a model that cannot run here is reported, not fatal
                print(f"| {label} | error: {type(e).__name__}: {str(e)[:120]} | | | | | fail |")
                failed = True
                continue
            ok = (
                r["time"] <= TIME_TARGET
                and r["memory"] <= MEMORY_TARGET
                and r["sampled_memory"] <= SAMPLED_MEMORY_TARGET
                and r["syncs"] == 0
            )
            failed |= not ok
            print(
                f"| {label} | {r['time']:.3f}x | {r['memory']:.3f}x | {r['sampled_memory']:.3f}x | "
                f"{r['syncs']:.1f} | {r['observed']} | {'ok' if ok else 'past target'} |"
            )
    job = nccl_job()
    print("NCCL: fewer than 2 GPUs, the 2-process job skipped" if job is None else job)
    print(
        f"targets: time <= {TIME_TARGET}x, memory <= {MEMORY_TARGET}x (sampled <= {SAMPLED_MEMORY_TARGET}x), "
        f"0 syncs a healthy step; {time.perf_counter() - t0:.0f} s"
    )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
