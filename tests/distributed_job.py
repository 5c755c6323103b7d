"""One distributed job for tests/test_distributed.py, launched as users launch theirs:

    python -m torch.distributed.run --nproc_per_node=N tests/distributed_job.py OUT_DIR SCENARIO...

Every rank runs the scenarios in order, on gloo (CPU), and writes what it saw to
``OUT_DIR/<scenario>.rank<r>.json``; the test process asserts on those files. Ground truth is
computed here without NeuralDBG: a single-process copy of the model trained on the
concatenated global batch (the same trajectory DDP and FSDP2 follow), whose per-layer gradient
and parameter norms are taken with plain torch.

Scenarios run one after the other in one process group (process start-up costs more than all
of them together); ``raises`` leaves the group unusable and must come last.
"""

from __future__ import annotations

import json
import os
import sys
import time
import warnings
from typing import Any, Callable, Dict, List

import torch
import torch.distributed as dist
import torch.nn as nn

from neuraldbg import NeuralDbg, NeuralDbgWarning

GLOBAL_BATCH = 8
# The job's backend: gloo on CPU (default), or NEURALDBG_TEST_BACKEND=nccl on a GPU machine,
# which runs every scenario with the model, the batches and our collective on the GPUs.
BACKEND = os.environ.get("NEURALDBG_TEST_BACKEND", "gloo")
DEVICE = torch.device("cpu")


def mlp(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 3))


def global_batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randn(GLOBAL_BATCH, 6, generator=g), torch.randn(GLOBAL_BATCH, 3, generator=g)


def local_batch(step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    x, y = global_batch(step)
    n = GLOBAL_BATCH // world
    return x[rank * n : (rank + 1) * n].to(DEVICE), y[rank * n : (rank + 1) * n].to(DEVICE)


def layer_norms(model: nn.Module, attr: str) -> Dict[str, float]:
    """Per layer (module owning parameters): the L2 norm over its parameters' ``attr``
    (``"grad"`` or ``"data"``), by plain torch on one process."""
    out: Dict[str, float] = {}
    for name, m in model.named_modules():
        ps = list(m.parameters(recurse=False))
        if not ps:
            continue
        ts = [p.grad if attr == "grad" else p.data for p in ps]
        out[name] = float(torch.sqrt(sum((t.double() ** 2).sum() for t in ts)))
    return out


def reference(steps: int, lr: float) -> List[Dict[str, Any]]:
    """The single-process run on the global batch: per step, layer gradient norms (as the
    backward pass produced them), layer parameter norms (after the update) and the loss."""
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    out = []
    for step in range(steps):
        x, y = global_batch(step)
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        grad = layer_norms(model, "grad")
        opt.step()
        # Parameter norms are read at the step boundary, after the update.
        out.append({"grad": grad, "weight": layer_norms(model, "data"), "loss": float(loss.detach())})
    return out


def history(dbg: NeuralDbg, names: List[str], metric: str, strip: str = "") -> Dict[str, Dict[int, float]]:
    out: Dict[str, Dict[int, float]] = {}
    for name in names:
        steps, values = dbg.history(name, metric)
        out[name[len(strip) :] if strip and name.startswith(strip) else name] = {
            int(s): float(v) for s, v in zip(steps, values)
        }
    return out


class Counter:
    """Counts calls of the Python-level collectives of torch.distributed (the ones FSDP2 and
    we go through; DDP's reducer runs in C++ and is the same watched or not)."""

    NAMES = (
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

    def __init__(self) -> None:
        self.calls = 0
        self.saved: Dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> Counter:
        for n in self.NAMES:
            f = getattr(dist, n)
            self.saved[n] = f

            def wrapped(*a: Any, _f: Callable[..., Any] = f, **k: Any) -> Any:
                self.calls += 1
                return _f(*a, **k)

            setattr(dist, n, wrapped)
        return self

    def __exit__(self, *exc: Any) -> None:
        for n, f in self.saved.items():
            setattr(dist, n, f)


def wrap(kind: str, model: nn.Module, world: int) -> nn.Module:
    model = model.to(DEVICE)
    if kind == "ddp":
        return nn.parallel.DistributedDataParallel(model)
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if kind == "hsdp":
        mesh = init_device_mesh(DEVICE.type, (2, world // 2), mesh_dim_names=("replicate", "shard"))
    else:
        mesh = init_device_mesh(DEVICE.type, (world,))
    reshard = kind != "fsdp_keep"
    mp = (
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        if kind == "fsdp_bf16"
        else MixedPrecisionPolicy()
    )
    for i in (0, 2, 4):
        fully_shard(model[i], mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, mp_policy=mp)
    return model


def train(
    model: nn.Module,
    steps: int,
    rank: int,
    world: int,
    lr: float = 0.05,
    plan: Callable[[int, torch.Tensor, nn.Module, Any], torch.Tensor] | None = None,
    **opts: Any,
) -> NeuralDbg:
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    with NeuralDbg(model, **opts) as dbg:
        for step in range(steps):
            x, y = local_batch(step, rank, world)
            if plan is not None:
                x = plan(step, x, model, opt)
            opt.zero_grad()
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
    return dbg


def hypotheses(dbg: NeuralDbg) -> List[Dict[str, Any]]:
    return [
        {
            "failure": str(h.failure),
            "cause": str(h.cause),
            "layer": h.layer,
            "step": h.step,
            "confidence": h.confidence,
            "description": h.description,
            "evidence": [dict(e.metadata, layer=e.layer_name, step=e.step) for e in h.evidence],
        }
        for h in dbg.explain_failure()
    ]


# ----------------------------------------------------------------------------- scenarios


def norms(kind: str, rank: int, world: int, out: str) -> Dict[str, Any]:
    """Per-layer gradient and parameter norms of a DDP / FSDP2 / HSDP job against the
    single-process reference, with the collectives counted watched and unwatched."""
    steps = 4
    ref = reference(steps, lr=0.05)
    names = [n for n, m in mlp().named_modules() if list(m.parameters(recurse=False))]
    counts = []
    for watched in (False, True):
        model = wrap(kind, mlp(), world)
        with Counter() as c:
            if watched:
                dbg = train(model, steps, rank, world, weight_every=1, trace=os.path.join(out, f"{kind}.ndbg"))
            else:
                opt = torch.optim.SGD(model.parameters(), lr=0.05)
                for step in range(steps):
                    x, y = local_batch(step, rank, world)
                    opt.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
        counts.append(c.calls)
    strip = "module." if kind == "ddp" else ""
    full = [strip + n for n in names]
    return {
        "reference": ref,
        "grad": history(dbg, full, "grad_norm", strip),
        "weight": history(dbg, full, "weight_norm", strip),
        "loss": {int(s): float(v) for s, v in zip(*dbg.history(None, "loss"))},
        "step": dbg.step,
        "collectives_unwatched": counts[0],
        "collectives_watched": counts[1],
        "steps": steps,
        "hypotheses": hypotheses(dbg),
    }


def fsdp_rank(rank: int, world: int, out: str) -> Dict[str, Any]:
    """FSDP2 watched per rank (``distributed="off"``): each rank's numbers are its own shards'."""
    model = wrap("fsdp", mlp(), world)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        dbg = train(model, 3, rank, world, distributed="off")
    names = [n for n, m in model.named_modules() if list(m.parameters(recurse=False))]
    shard = {
        n: float(torch.sqrt(sum((p.grad._local_tensor.double() ** 2).sum() for p in m.parameters(recurse=False))))
        for n, m in model.named_modules()
        if n in names
    }
    return {
        "steps": dbg.step,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, NeuralDbgWarning)],
        "shard": shard,
        "last": {n: float(dbg.history(n, "grad_norm")[1][-1]) for n in names},
    }


def nan_batch(rank: int, world: int, out: str) -> Dict[str, Any]:
    """A NaN batch on the last rank at step 5 of a DDP job."""
    bad_rank, bad_step = world - 1, 5

    def plan(step: int, x: torch.Tensor, model: nn.Module, opt: Any) -> torch.Tensor:
        if rank == bad_rank and step == bad_step:
            x = x.clone()
            x[0, 0] = float("nan")
        return x

    dbg = train(wrap("ddp", mlp(), world), 8, rank, world, plan=plan, trace=os.path.join(out, "nan_batch.ndbg"))
    return {
        "bad_rank": bad_rank,
        "bad_step": bad_step,
        "hypotheses": hypotheses(dbg),
        "events": [dict(e.metadata, type=str(e.event_type), layer=e.layer_name, step=e.step) for e in dbg.events],
    }


class Div(nn.Module):
    """``x / d - x / d + x``: the identity, until ``d`` is set to 0 (then inf - inf = NaN)."""

    def __init__(self) -> None:
        super().__init__()
        self.d = 1.0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / self.d - x / self.d + x


def nan_forward(rank: int, world: int, out: str) -> Dict[str, Any]:
    """A module's own computation makes NaN on the last rank at step 4 (a DDP job)."""
    bad_rank, bad_step = world - 1, 4
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(6, 16), Div(), nn.Tanh(), nn.Linear(16, 3)).to(DEVICE)
    )

    def plan(step: int, x: torch.Tensor, m: nn.Module, opt: Any) -> torch.Tensor:
        if rank == bad_rank and step == bad_step:
            m.module[1].d = 0.0
        return x

    dbg = train(model, 7, rank, world, plan=plan)
    return {"bad_rank": bad_rank, "bad_step": bad_step, "hypotheses": hypotheses(dbg)}


def lr_explosion(rank: int, world: int, out: str) -> Dict[str, Any]:
    """The learning rate multiplied by 1000 at step 15, in a DDP job and in one process on the
    global batch: the same diagnosis."""

    def plan(step: int, x: torch.Tensor, model: nn.Module, opt: Any) -> torch.Tensor:
        if step == 15:
            for g in opt.param_groups:
                g["lr"] *= 1000.0
        return x

    dbg = train(wrap("ddp", mlp(), world), 30, rank, world, plan=plan)
    single = mlp()
    opt = torch.optim.SGD(single.parameters(), lr=0.05)
    with NeuralDbg(single) as ref:
        for step in range(30):
            x, y = global_batch(step)
            plan(step, x, single, opt)
            opt.zero_grad()
            nn.functional.mse_loss(single(x), y).backward()
            opt.step()
    return {"job": hypotheses(dbg), "single": hypotheses(ref)}


def diverged(rank: int, world: int, out: str) -> Dict[str, Any]:
    """One rank changes its replica's parameters behind DDP's back at step 6."""
    bad_rank, bad_step = world - 1, 6

    def plan(step: int, x: torch.Tensor, model: nn.Module, opt: Any) -> torch.Tensor:
        if rank == bad_rank and step == bad_step:
            with torch.no_grad():
                model.module[2].weight.mul_(1.5)
        return x

    dbg = train(wrap("ddp", mlp(), world), 12, rank, world, plan=plan, weight_every=1)
    return {"bad_rank": bad_rank, "bad_step": bad_step, "hypotheses": hypotheses(dbg)}


def fails_locally(rank: int, world: int, out: str) -> Dict[str, Any]:
    """Our collection breaks on the last rank at step 4 (an internal error, simulated): every
    rank stops observing with a warning at that step, without waiting out the timeout, and
    training goes on everywhere."""
    bad_rank = world - 1
    model = wrap("ddp", mlp(), world)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    t0 = time.monotonic()
    loop_steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NeuralDbg(model, distributed_timeout=60.0) as dbg:
            for step in range(8):
                if rank == bad_rank and step == 4:

                    def broken(*a: Any, **k: Any) -> Any:
                        raise RuntimeError("planted internal error")

                    dbg._collector.measure.gradient_norms = broken
                x, y = local_batch(step, rank, world)
                opt.zero_grad()
                nn.functional.mse_loss(model(x), y).backward()
                opt.step()
                loop_steps += 1
    return {
        "bad_rank": bad_rank,
        "loop_steps": loop_steps,
        "observed": dbg.step,
        "seconds": time.monotonic() - t0,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, NeuralDbgWarning)],
    }


def raises(rank: int, world: int, out: str) -> Dict[str, Any]:
    """The last rank raises inside the block at step 3 (and carries on outside it); the others
    must finish their loop within bounded time, monitoring turned off with a warning."""
    bad_rank = world - 1
    t0 = time.monotonic()
    model = mlp().to(DEVICE)  # independent replicas: only our collective links the ranks
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    error = None
    loop_steps = 0
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            with NeuralDbg(model, distributed_timeout=3.0):
                for step in range(8):
                    if rank == bad_rank and step == 3:
                        raise KeyError("planted")
                    x, y = local_batch(step, rank, world)
                    opt.zero_grad()
                    nn.functional.mse_loss(model(x), y).backward()
                    opt.step()
                    loop_steps += 1
        except KeyError as e:
            error = repr(e)
    return {
        "bad_rank": bad_rank,
        "error": error,
        "loop_steps": loop_steps,
        "seconds": time.monotonic() - t0,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, NeuralDbgWarning)],
    }


SCENARIOS: Dict[str, Callable[[int, int, str], Dict[str, Any]]] = {
    "ddp": lambda r, w, o: norms("ddp", r, w, o),
    "fsdp": lambda r, w, o: norms("fsdp", r, w, o),
    "fsdp_keep": lambda r, w, o: norms("fsdp_keep", r, w, o),
    "fsdp_bf16": lambda r, w, o: norms("fsdp_bf16", r, w, o),
    "hsdp": lambda r, w, o: norms("hsdp", r, w, o),
    "fsdp_rank": fsdp_rank,
    "nan_batch": nan_batch,
    "nan_forward": nan_forward,
    "lr_explosion": lr_explosion,
    "diverged": diverged,
    "fails_locally": fails_locally,
    "raises": raises,
}


def main() -> None:
    out, names = sys.argv[1], sys.argv[2:]
    global DEVICE
    if BACKEND == "nccl":
        DEVICE = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(DEVICE)
    dist.init_process_group(BACKEND)
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    for name in names:
        t0 = time.monotonic()
        try:
            result = SCENARIOS[name](rank, world, out)
        except Exception as e:  # recorded for the test to show, not swallowed silently
            import traceback

            result = {"crash": "".join(traceback.format_exception(type(e), e, e.__traceback__))}
        result["wall_s"] = time.monotonic() - t0
        with open(os.path.join(out, f"{name}.rank{rank}.json"), "w") as f:
            json.dump(result, f, default=str)
    if "raises" not in names:
        dist.destroy_process_group()
    else:
        # A rank left mid-collective: tearing the group down at interpreter exit can abort in
        # gloo's destructor; the results are on disk, so leave at once.
        sys.stdout.flush()
        os._exit(0)


if __name__ == "__main__":
    main()
