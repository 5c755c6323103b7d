"""Distributed collection: one job-wide step from every rank's local statistics.

Under ``torch.distributed`` (DDP, FSDP2 ``fully_shard``, HSDP / 2-D device meshes, launched by
``torchrun`` on one machine or many) each rank measures what it holds, exactly as in one
process, but on its *local* tensors: a DTensor parameter or gradient is measured through its
local shard (``_local_tensor``), never through DTensor operations (which would run one
collective per parameter, or fail when mixed with plain tensors).

Every rank then packs its step into one fixed-layout float32 vector and the ranks exchange it in
**one** ``all_gather_into_tensor``, issued asynchronously at ``optimizer.step()`` (the point of
the step every rank reaches together) and waited for when the next forward pass starts, at the
end of the run, or when results are read. On NCCL the wait only orders the copy after the
collective on the current stream: the host never waits for the GPU inside the step. On gloo
the wait has a timeout (``timeout``), so a rank that raised or exited cannot leave the others
blocked in our collective; any error in this path turns monitoring off with a warning on the
rank that saw it, and the training itself is never touched.

Per rank, the vector holds (see :class:`JobLayout`):

* the sum of squares of each parameter's local gradient and (on sampled steps) of the local
  parameter, one entry per parameter;
* the activation table (largest magnitude, saturated share, dead share, mean slope, samples
  per unit per activation module);
* one row of input statistics (``min, max, mean, std``; micro-batches of the step combined);
* the loss, and the module whose output first went non-finite in this rank's forward pass.

Combining them is arithmetic, not diagnosis: the gradient norm of a parameter is the square root
of the sum over its shards (a DTensor's shards add up; a replicated tensor, under DDP or on a
replicated mesh dimension, counts once), which equals the norm of the full, reduced gradient; the
loss is the mean over ranks; the input rows stay per rank and are labelled with their rank; the
spread of the replicated parameters' norms across ranks is handed to the engine, which decides
what counts as a diverged replica.
"""

from __future__ import annotations

import datetime
import json
import math
import time
import warnings
from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._transfer import clip_ratio

# Header of each rank's vector: has_loss, loss, origin module (-1: none), outputs checked,
# number of forward passes in the step, stop (this rank stopped observing), the clipped
# gradient norm of the collector's clip probe (NaN: none), the loss scale (NaN: none).
_HEADER = 8


class CollectiveError(RuntimeError):
    """Our collective failed or timed out (a rank left): nothing more is sent."""


class StoppedElsewhere(RuntimeError):
    """Another rank stopped observing after an error of its own: every rank stops with it."""


class PeerLeft(CollectiveError):
    """Another rank left its ``with NeuralDbg`` block (it raised, or its loop ended early)."""


# Longest wait at ``__enter__`` for the other ranks to enter their block: a rank that never
# enters must not hold the job for the collective timeout.
ENTER_WAIT = 10.0
# Seconds between looks at the store for a rank that left, while waiting for our collective.
_LEFT_POLL = 0.2
# This process's distributed blocks so far: numbers the store keys of each block.
_blocks = 0


def rank_and_world() -> Optional[Tuple[int, int]]:
    """``(rank, world size)`` of an initialized job of more than one process, else None."""
    if not active():
        return None
    import torch.distributed as dist

    return int(dist.get_rank()), int(dist.get_world_size())


class Roster:
    """Who entered the block and who left it, through the job's key-value store (a few keys
    per block, no collective): a rank that never enters, or leaves early, is named to the
    others within seconds instead of after the collective's timeout."""

    def __init__(self, store: Any, prefix: str, rank: int, world: int) -> None:
        self.store = store
        self.prefix = prefix
        self.rank = rank
        self.world = world

    @classmethod
    def join(cls, rank: int, world: int, wait: float) -> Tuple[Optional[Roster], Optional[str]]:
        """Enters this rank and waits up to ``wait`` seconds for the others: ``(roster, None)``
        when every rank entered, ``(None, why)`` when some did not (every rank then agrees:
        the first to decide writes the verdict), ``(None, None)`` without a store."""
        global _blocks
        try:
            from torch.distributed import distributed_c10d

            store = distributed_c10d._get_default_store()
        except Exception:  # no store to ask: the group's creation is the only check
            return None, None
        _blocks += 1
        prefix = f"neuraldbg/block{_blocks}"
        store.set(f"{prefix}/in{rank}", "1")
        store.add(f"{prefix}/in", 1)
        deadline = time.monotonic() + wait
        while True:
            if store.add(f"{prefix}/in", 0) >= world:
                verdict = store.compare_set(f"{prefix}/verdict", "", "go")
            elif time.monotonic() > deadline:
                verdict = store.compare_set(f"{prefix}/verdict", "", "off")
            else:
                time.sleep(0.02)
                continue
            break
        if verdict == b"go":
            return cls(store, prefix, rank, world), None
        missing = [r for r in range(world) if r != rank and not store.check([f"{prefix}/in{r}"])]
        if missing:
            who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))}"
            late = f"{who} did not enter its `with NeuralDbg(...)` block within {wait:g} s"
        else:
            late = f"the other ranks stopped waiting for rank {rank} after {wait:g} s"
        return None, (
            f"NeuralDBG (rank {rank}): {late}. Every rank of the job must enter the block "
            "(NeuralDBG's process group is created by all of them together); this rank is "
            'watched on its own, as with distributed="off". Training goes on.'
        )

    def leave(self, step: int, why: Optional[str]) -> None:
        """Tells the others this rank left its block after ``step`` steps (``why``: the
        exception that ended it, if any)."""
        try:
            self.store.set(f"{self.prefix}/left{self.rank}", json.dumps({"step": step, "why": why}))
        except Exception:  # best effort: the others' timeout still applies
            pass

    def left(self, step: int) -> Optional[str]:
        """The first other rank that left its block before sending ``step``'s statistics (it
        had completed at most ``step`` steps), as a sentence, or None."""
        for r in range(self.world):
            key = f"{self.prefix}/left{r}"
            if r != self.rank and self.store.check([key]):
                d = json.loads(self.store.get(key))
                if int(d["step"]) > step:
                    continue  # it sent this step's statistics: they are on their way
                why = f" (it raised {d['why']})" if d.get("why") else ""
                return f"rank {r} left its `with NeuralDbg(...)` block after step {d['step']}{why}"
        return None


def active() -> bool:
    """Whether this process is one rank of an initialized job of more than one process."""
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch built without distributed
        return False
    return bool(dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1)


def _local(t: Any) -> Any:
    """The tensor this rank holds: the local shard of a DTensor, the tensor itself otherwise."""
    inner = getattr(t, "_local_tensor", None)
    return t if inner is None else inner


def has_shards(params: Sequence[Any]) -> bool:
    """Whether some parameter is a DTensor (FSDP2, HSDP, tensor parallel)."""
    return any(getattr(p, "_local_tensor", None) is not None for p in params)


def local_tensors(tensors: Sequence[Any]) -> List[Any]:
    """What this rank holds of each tensor (None stays None). Measuring DTensors through their
    own operations would run a collective per tensor (or fail mixed with plain tensors)."""
    return [None if t is None else _local(t) for t in tensors]


def _replicas(t: Any, world: int) -> float:
    """How many ranks hold the same values of ``t``: for a DTensor, the product of the sizes of
    the mesh dimensions it is not sharded on (they hold replicas); for a plain tensor every
    rank holds its own copy of the whole (``world``), which under DDP is one replica each."""
    spec = getattr(t, "placements", None)
    mesh = getattr(t, "device_mesh", None)
    if spec is None or mesh is None:
        return float(world)
    n = 1
    for dim, placement in enumerate(spec):
        if not placement.is_shard():
            n *= int(mesh.size(dim))
    # Ranks outside the mesh hold nothing of it: scale by how many ranks the mesh spans.
    return float(n) * world / max(int(mesh.size()), 1)


class JobLayout:
    """Where each statistic sits in a rank's exchanged vector (identical on every rank)."""

    def __init__(self, n_params: int, n_probes: int) -> None:
        self.n_params = n_params
        self.n_probes = n_probes
        self.grads = 0
        self.weights = n_params
        self.acts = 2 * n_params
        self.inputs = self.acts + 5 * n_probes
        self.header = self.inputs + 4
        self.size = self.header + _HEADER


class Exchange:
    """One step's all-gather in flight."""

    __slots__ = ("event", "host", "out", "step", "work")

    def __init__(self, work: Any, out: Any) -> None:
        self.work = work
        self.out = out
        self.step = -1  # the step whose statistics it carries (-1: none)
        self.host: Optional[np.ndarray] = None
        self.event: Any = None  # CUDA: recorded after the copy into pinned memory

    def done(self) -> bool:
        if self.event is not None:  # pragma: no cover - GPU
            return bool(self.event.query())
        return bool(self.work.is_completed())


class Distributed:
    """The distributed side of one collector: rank, world, parameter replication, exchange."""

    def __init__(self, timeout: float, roster: Optional[Roster] = None) -> None:
        import torch
        import torch.distributed as dist

        self.torch = torch
        self.dist = dist
        self.rank = dist.get_rank()
        self.world = dist.get_world_size()
        self.backend = str(dist.get_backend())
        self.timeout = datetime.timedelta(seconds=timeout)
        self.roster = roster
        # A group of our own: its collectives are numbered apart from the job's, so ranks that
        # disagree about ours (one stopped observing) can never shift the job's own collectives.
        # Creating it is a collective over every rank: each rank enters its `with NeuralDbg`.
        self.group: Any = dist.new_group(backend=self.backend, timeout=self.timeout)
        self.scale = np.zeros(0)
        self.replicated = np.zeros(0, dtype=bool)
        self.layout: Optional[JobLayout] = None
        self._device: Any = None  # where our vectors live (NCCL: the GPU)
        # Device index tensors of recent layouts (the norm plans' order arrays are reused objects).
        self._index: Dict[Any, Any] = {}
        self.collectives = 0  # issued by us (tests and `make bench` count them)

    def bind(self, params: Sequence[Any], model: Any) -> None:
        """The watched parameters (in the engine's order) and the model that holds them."""
        torch = self.torch
        # 1 / (ranks holding the same values) per parameter: summing a parameter's entries over
        # the ranks then counts each distinct value once.
        self.scale = np.array([1.0 / _replicas(p, self.world) for p in params], dtype=np.float64)
        # Parameters every rank should hold identically: all of a DDP model's.
        ddp = getattr(torch.nn.parallel, "DistributedDataParallel", None)
        self.replicated = np.zeros(len(params), dtype=bool)
        if ddp is not None and isinstance(model, ddp):
            self.replicated[:] = [getattr(p, "_local_tensor", None) is None for p in params]

    def setup(self, n_params: int, n_probes: int) -> None:
        self.layout = JobLayout(n_params, n_probes)

    def exchange(self, layout: Any, flat: Any) -> Exchange:
        """Packs this rank's step (the collector's :class:`~._transfer.Layout` and flat vector
        of local norms) and issues the step's collective."""
        torch = self.torch
        device = flat.device if flat is not None else torch.device("cpu")
        if flat is None:
            flat = torch.zeros(0)
        vec = self.pack(flat, layout, device)
        if vec.device.type == "cuda":  # pragma: no cover - needs a GPU
            ex = self.start_device(vec)
        else:
            ex = self.start(vec)
        ex.step = int(layout.step)
        return ex

    def receive(self, ex: Exchange, layout: Any) -> JobStep:
        """The job-wide step of an exchange (waits for it if it is still in flight)."""
        job = JobStep(
            self.combine(self.wait(ex), layout.has("weight"), layout.clip_index),
            layout.has("weight"),
            self.rank,
            layout.skipped,
        )
        if job.origin is not None:
            layout.origin, layout.checked = job.origin, True
        elif job.checked:
            layout.checked = True
        return job

    # ----------------------------------------------------------------- per-rank vector

    def pack(self, flat: Any, layout: Any, device: Any) -> Any:
        """This rank's fixed-layout vector, on ``device``, from the collector's flat vector of
        local statistics (its parts read by name through ``layout``).

        What the host already knows (the layout, the header, samples per unit) is written on
        the host and moved with the index in non-blocking copies from pinned memory; what is on
        the device stays there: nothing here waits for the GPU."""
        torch = self.torch
        lay = self.layout
        assert lay is not None
        grad_order = layout.index("grad")
        weight_order = layout.index("weight")
        act_index = layout.index("activation")
        n_inputs = layout.count("input") // 4
        has_loss = layout.has("loss")
        clip = layout.clip_index is not None and layout.has("clip")
        loss_scale = layout.has("loss_scale")
        base = np.full(lay.size, np.nan, dtype=np.float32)
        base[: lay.acts] = -1.0  # sums of squares: -1 is "no value on this rank"
        base[lay.header : lay.header + _HEADER] = (
            float(has_loss),
            math.nan,
            -1.0 if layout.origin is None else float(layout.origin),
            float(layout.checked),
            float(n_inputs),
            0.0,
            math.nan,
            math.nan,
        )
        if layout.act_samples is not None:
            base[lay.acts + 4 : lay.inputs : 5] = layout.act_samples
        # Norms -> sums of squares; activation cells, the loss, the clip probe's norm after
        # clipping and the loss scale as they are; the input rows combined into one.
        parts: List[Any] = []
        for name in ("grad", "weight"):
            v = layout.read(flat, name)
            if v is not None and v.numel():
                parts.append(v.square())
        for name in ("activation", "loss"):
            v = layout.read(flat, name)
            if v is not None and v.numel():
                parts.append(v)
        if n_inputs == 1:
            parts.append(layout.read(flat, "input"))
        elif n_inputs:
            rows = layout.read(flat, "input").reshape(n_inputs, 4)
            parts.append(torch.stack((rows[:, 0].min(), rows[:, 1].max(), rows[:, 2].mean(), rows[:, 3].max())))
        if clip:
            parts.append(layout.read(flat, "clip"))
        if loss_scale:
            parts.append(layout.read(flat, "loss_scale"))
        origin_device = layout.origin_device
        found = origin_device is not None
        if found:  # the origin found on the device (the outputs were checked there)
            parts.append(torch.stack((origin_device.reshape(()).float(), torch.ones((), device=origin_device.device))))
        vec = _to_device(torch, base, device)
        if parts:
            k_g = layout.count("grad")
            k_w = layout.count("weight")
            n_act = layout.count("activation")
            key = (
                id(grad_order),
                k_g,
                id(weight_order),
                k_w,
                id(act_index),
                n_act,
                has_loss,
                n_inputs > 0,
                clip,
                loss_scale,
                found,
                device,
            )
            hit = self._index.get(key)
            idx = hit[0] if hit is not None else None
            if idx is None:
                index: List[np.ndarray] = []
                if grad_order is not None and k_g:
                    index.append(lay.grads + grad_order)
                if weight_order is not None and k_w:
                    index.append(lay.weights + weight_order)
                if act_index is not None and n_act:
                    index.append(lay.acts + act_index)
                if has_loss:
                    index.append(np.array([lay.header + 1]))
                if n_inputs:
                    index.append(np.arange(lay.inputs, lay.inputs + 4))
                if clip:
                    index.append(np.array([lay.header + 6]))
                if loss_scale:
                    index.append(np.array([lay.header + 7]))
                if found:
                    index.append(np.array([lay.header + 2, lay.header + 3]))
                idx = _to_device(torch, np.concatenate(index).astype(np.int64), device)
                if len(self._index) > 16:
                    self._index.clear()
                # The plan arrays are kept with their index: their ids (in the key) cannot be
                # reused by other arrays while the entry lives.
                self._index[key] = (idx, grad_order, weight_order, act_index)
            src = torch.cat(parts) if len(parts) > 1 else parts[0]
            vec.index_copy_(0, idx, src.to(torch.float32))
        return vec

    def abandon(self, error: BaseException) -> None:
        """This rank stops observing after ``error``. Unless the error came from our collective
        itself (a rank is gone: nothing more is sent), its next collective still goes out,
        marked "stop", so every other rank stops at the same step instead of waiting out the
        timeout; it is never waited for."""
        if self.layout is None or isinstance(error, (CollectiveError, StoppedElsewhere)):
            return
        try:
            vec = self.torch.full((self.layout.size,), math.nan, dtype=self.torch.float32)
            vec[: self.layout.acts] = -1.0
            vec[self.layout.header + 5] = 1.0
            device = self._device
            self.start(vec.to(device) if device is not None else vec)
        except Exception:  # pragma: no cover - best effort: the others' timeout still applies
            pass

    def start(self, vec: Any) -> Exchange:
        """Issues the step's one collective, asynchronously."""
        torch = self.torch
        self._device = vec.device
        out = torch.empty(self.world * vec.numel(), dtype=vec.dtype, device=vec.device)
        work = self.dist.all_gather_into_tensor(out, vec, group=self.group, async_op=True)
        self.collectives += 1
        return Exchange(work, out)

    def wait(self, ex: Exchange) -> np.ndarray:
        """Every rank's vector, as a ``(world, K)`` host array (raises on timeout or a lost
        peer; the caller turns monitoring off)."""
        if ex.host is not None:
            if ex.event is not None and not ex.event.query():  # pragma: no cover - GPU
                ex.event.synchronize()  # rare: the CPU ran more than a step ahead of the GPU
            return ex.host
        try:
            if ex.out.device.type == "cpu":
                self._await(ex.work, ex.step)
                host = ex.out.numpy()
            else:  # pragma: no cover - needs a GPU
                host = ex.out.cpu().numpy()
        except PeerLeft:
            raise
        except Exception as e:
            raise CollectiveError(
                f"rank {self.rank} got no statistics from the other ranks ({type(e).__name__}: {e})"
            ) from e
        assert self.layout is not None
        ex.host = host.reshape(self.world, self.layout.size)
        return ex.host

    def _await(self, work: Any, step: int) -> None:
        """Waits for the collective of ``step`` on the host, up to the timeout, looking now and
        then whether a rank left its block before that step (then it never will deliver:
        :class:`PeerLeft` names it)."""
        roster = self.roster
        if roster is None or work.is_completed():
            work.wait(timeout=self.timeout)
            return
        now = time.monotonic()
        deadline = now + self.timeout.total_seconds()
        look = now + _LEFT_POLL
        nap = 0.0002  # short naps first: a peer a little behind costs no more than it did
        while not work.is_completed():
            now = time.monotonic()
            if now >= look:
                gone = roster.left(step)
                if gone is not None:
                    raise PeerLeft(gone)
                look = now + _LEFT_POLL
            if now >= deadline:
                break
            time.sleep(min(nap, deadline - now))
            nap = min(nap * 2, 0.02)
        work.wait(timeout=datetime.timedelta(seconds=max(deadline - time.monotonic(), 0.001)))

    def start_device(self, vec: Any) -> Exchange:  # pragma: no cover - needs a GPU
        """NCCL: the collective, then an asynchronous copy of its result into pinned memory
        behind it on the current stream; nothing here waits on the host."""
        torch = self.torch
        ex = self.start(vec)
        ex.work.wait()  # orders the current stream after the collective; no host wait
        pinned = torch.empty(ex.out.numel(), dtype=torch.float32, pin_memory=True)
        pinned.copy_(ex.out, non_blocking=True)
        ex.event = torch.cuda.Event()
        ex.event.record(torch.cuda.current_stream(vec.device))
        assert self.layout is not None
        ex.host = pinned.numpy().reshape(self.world, self.layout.size)
        return ex

    # ----------------------------------------------------------------- job-wide step

    def combine(self, g: np.ndarray, with_weights: bool = True, clip_index: Optional[int] = None) -> Dict[str, Any]:
        """The job's step from every rank's vector (``g``: ``(world, K)``); ``with_weights``:
        the step measured parameter norms; ``clip_index``: the parameter whose gradient was read
        again after the step (the clip probe), if any."""
        lay = self.layout
        assert lay is not None
        world = self.world
        g64 = g.astype(np.float64)
        out: Dict[str, Any] = {"world_size": world}

        def norms(block: np.ndarray) -> Optional[np.ndarray]:
            # -1: no value on that rank; NaN/Inf flow through the sum.
            present = block >= 0
            present |= ~np.isfinite(block)
            if not present.any():
                return None
            total = (np.where(present, block, 0.0) * self.scale[None, :]).sum(axis=0)
            norm = np.sqrt(total)
            norm[~present.any(axis=0)] = -1.0
            return norm.astype(np.float32)

        grads = g64[:, lay.grads : lay.grads + lay.n_params]
        weights = g64[:, lay.weights : lay.weights + lay.n_params]
        g_norms = norms(grads)
        out["grad_norms"] = g_norms if g_norms is not None else np.full(lay.n_params, -1.0, dtype=np.float32)
        out["weight_norms"] = norms(weights) if with_weights else None

        if lay.n_probes:
            acts = g64[:, lay.acts : lay.inputs].reshape(world, lay.n_probes, 5)
            if not np.isnan(acts[:, :, 4]).all():
                table = np.full((lay.n_probes, 5), np.nan, dtype=np.float64)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore", RuntimeWarning)  # all-NaN columns
                    table[:, 0] = np.nanmax(acts[:, :, 0], axis=0)
                    table[:, 1] = np.nanmean(acts[:, :, 1], axis=0)
                    # A unit is dead for the job's batch only if it is dead on every rank: the
                    # smallest rank's share bounds the job's from above.
                    table[:, 2] = np.nanmin(acts[:, :, 2], axis=0)
                    table[:, 3] = np.nanmean(acts[:, :, 3], axis=0)
                    samples = np.nansum(acts[:, :, 4], axis=0)
                samples[np.isnan(acts[:, :, 4]).all(axis=0)] = np.nan
                table[:, 4] = samples
                out["activations"] = table.reshape(-1).astype(np.float32)

        head = g64[:, lay.header : lay.header + _HEADER]
        stopped = np.flatnonzero(head[:, 5] > 0.5)
        if stopped.size:
            raise StoppedElsewhere(f"rank {int(stopped[0])} stopped observing after an error")
        has_loss = head[:, 0] > 0.5
        if has_loss.any():
            out["loss"] = float(head[has_loss, 1].mean())
        rows = g64[:, lay.inputs : lay.inputs + 4]
        with_input = head[:, 4] > 0
        if with_input.any():
            out["inputs"] = np.ascontiguousarray(rows[with_input].astype(np.float32).reshape(-1))
            out["input_rank"] = np.flatnonzero(with_input).astype(np.float32)
        after = head[:, 6]
        if clip_index is not None and not np.isnan(after).all():
            p = clip_index
            before = float(out["grad_norms"][p])
            ratio = clip_ratio(before, math.sqrt(float(np.nansum(after * after)) * self.scale[p]))
            if ratio is not None:
                out["clip_ratio"] = ratio
        scales = head[:, 7]
        if not np.isnan(scales).all():
            out["loss_scale"] = float(np.nanmax(scales))
        origins = head[:, 2]
        found = np.flatnonzero(origins >= 0)
        out["checked"] = bool((head[:, 3] > 0.5).any())
        if found.size:
            # The module earliest in forward order; ties: the lowest rank.
            r = int(found[np.argmin(origins[found])])
            out["nonfinite_module"] = int(origins[r])
            out["nonfinite_rank"] = float(r)
        if self.replicated.any():
            out["spreads"] = {
                "grad": _spread(grads, self.replicated),
                "weight": _spread(weights, self.replicated) if with_weights else None,
            }
            out["rank_sumsq"] = {
                "grad": _rank_totals(grads, self.replicated),
                "weight": _rank_totals(weights, self.replicated) if with_weights else None,
            }
        return out


def _spread(block: np.ndarray, mask: np.ndarray) -> Optional[np.ndarray]:
    """Per parameter: ``(max - min) / max`` over ranks of its norm (NaN: not a replica, or not
    measured this step)."""
    measured = (block >= 0).all(axis=0) & mask
    if not measured.any():
        return None
    norms = np.sqrt(np.where(block >= 0, block, 0.0))
    hi = norms.max(axis=0)
    lo = norms.min(axis=0)
    with np.errstate(invalid="ignore", divide="ignore"):
        spread = np.where(hi > 0, (hi - lo) / hi, 0.0)
    spread[~measured] = np.nan
    return spread.astype(np.float32)


def _rank_totals(block: np.ndarray, mask: np.ndarray) -> Optional[np.ndarray]:
    """Per rank: the sum of squares over the replicated parameters (NaN when not measured)."""
    sub = block[:, mask]
    if not (sub >= 0).all():
        return None
    return sub.sum(axis=1).astype(np.float32)


class JobStep:
    """A job-wide step as the collector feeds it to the engine (the fields of
    :class:`~._transfer.Unpacked`, plus the per-rank facts and measures)."""

    __slots__ = (
        "activations",
        "checked",
        "facts",
        "grad_norms",
        "inputs",
        "loss",
        "measures",
        "origin",
        "weight_norms",
    )

    def __init__(self, job: Dict[str, Any], weights: bool, rank: int, skipped: Optional[bool] = None) -> None:
        self.grad_norms: np.ndarray = job["grad_norms"]
        self.weight_norms: Optional[np.ndarray] = job["weight_norms"] if weights else None
        self.activations: Optional[np.ndarray] = job.get("activations")
        self.loss: Optional[float] = job.get("loss")
        self.inputs: Optional[np.ndarray] = job.get("inputs")
        self.origin: Optional[int] = job.get("nonfinite_module")
        self.checked = bool(job.get("checked"))
        facts, measures = facts_and_measures(job, rank)
        if skipped is not None:
            facts["optimizer_skipped"] = 1.0 if skipped else 0.0
        self.facts: Dict[str, float] = facts
        self.measures: Dict[str, np.ndarray] = measures


def facts_and_measures(job: Dict[str, Any], rank: int) -> Tuple[Dict[str, float], Dict[str, np.ndarray]]:
    """The per-rank facts and measures of a job-wide step, by the engine's names."""
    facts: Dict[str, float] = {"world_size": float(job["world_size"]), "rank": float(rank)}
    if "nonfinite_rank" in job:
        facts["nonfinite_rank"] = float(job["nonfinite_rank"])
    for name in ("clip_ratio", "loss_scale"):  # this rank's loop, made job-wide
        if name in job:
            facts[name] = float(job[name])
    measures: Dict[str, np.ndarray] = {}
    if "input_rank" in job:
        measures["input_rank"] = job["input_rank"]
    for kind in ("grad", "weight"):
        spread = job.get("spreads", {}).get(kind)
        if spread is not None:
            measures[f"replica_{kind}_spread"] = spread
        totals = job.get("rank_sumsq", {}).get(kind)
        if totals is not None:
            measures[f"rank_{kind}_sumsq"] = totals
    return facts, measures


def _to_device(torch: Any, a: np.ndarray, device: Any) -> Any:
    """A host array on ``device``: as is on CPU; elsewhere through pinned memory, copied
    without blocking (PyTorch's pinned allocator keeps the block until the copy is done)."""
    t = torch.from_numpy(a)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True)  # pragma: no cover - needs a GPU


def rank_path(path: str, rank: int) -> str:
    """``runs/x.ndbg`` -> ``runs/x.rank3.ndbg``: one trace per rank."""
    import os

    root, ext = os.path.splitext(path)
    return f"{root}.rank{rank}{ext}"
