"""What is measured: the tensor statistics of one step, computed on the tensors' own device in
as few kernel launches as possible. Nothing here hooks a module or talks to the engine.

* gradient and parameter L2 norms, per trainable parameter (:class:`NormPlan`; CUDA: one fused
  ``torch._foreach_norm``; CPU: small tensors of one shape stacked and reduced together, because
  the CPU ``_foreach_norm`` is a loop of one kernel per tensor);
* per activation module, its largest magnitude, the share of outputs in its saturation band, the
  share of units that were zero for the whole batch and its mean slope (:class:`Probe`, decided
  by the engine; :class:`Measurer.activation_parts` stacks modules of one output shape);
* ``min, max, mean, std`` of the model's first floating-point input (:func:`input_stats`);
* how far an optimizer step moves the weights relative to their size, on a fixed strided sample
  of up to 64 weights' elements taken before the step (:meth:`Measurer.weights_before`, :meth:`Measurer.updates`);
* whether tensors are finite, batched into one transfer (:func:`finite_flags`).

On CPU (:class:`~._measure_host.HostMeasurer`) the same statistics are read straight from the tensors' memory
by the extension (``neuraldbg._native.TensorReader``) into host arrays: no torch op at all.
On a fast step each torch op costs 10-25 us (the step's own work has evicted the dispatcher's
code and data from the caches), which made a dozen small reductions most of the cost of
watching a 1 ms step. Whatever the reader cannot read (a tensor subclass, a non-contiguous or
exotic-dtype tensor) falls back to the torch path above, read back with ``.numpy()``.
"""

from __future__ import annotations

import math
import operator
from typing import TYPE_CHECKING, Any, Callable, Collection, Dict, List, NamedTuple, Optional, Sequence, Tuple

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

# Tensors up to this many elements are stacked with others of their shape for one reduction
# (CPU): below it, per-tensor launch overhead (~1.5 us) dominates the copy that stacking costs.
STACK_LIMIT = 1 << 16
# Elements of each parameter kept before a sampled optimizer step, to measure how far the
# step moved it (a strided sample: an estimate of the whole tensor's relative change).
UPDATE_SAMPLE = 4096
# Weights whose step size is measured, at most (the engine reads the median over layers).
UPDATE_WEIGHTS = 64


def update_weights(weights: Sequence[bool], most: int = UPDATE_WEIGHTS) -> List[int]:
    """Which parameters' step size is measured, given which are weights (parameters of 2 or
    more dimensions): at most ``most`` of them, evenly spread over the model (the first and the
    last among them)."""
    chosen = [i for i, w in enumerate(weights) if w]
    if len(chosen) > most:
        chosen = [chosen[round(k * (len(chosen) - 1) / (most - 1))] for k in range(most)]
    return chosen


def update_stride(numel: int) -> int:
    """The stride of a weight's strided sample: :data:`UPDATE_SAMPLE` elements or more, fewer
    than twice as many (a weight of fewer elements whole)."""
    return max(1, numel // UPDATE_SAMPLE)


class Updates(NamedTuple):
    """How one optimizer step moved the sampled weights (see :meth:`Measurer.updates`): one
    device vector each, by parameter index."""

    ratio: Any
    params: np.ndarray
    direction: Optional[Any]


# Input batches up to this many elements get min/max and std/mean in two reductions
# (`std_mean`, ~6 ns per element on CPU); larger ones in four cheaper passes (~0.5 ns each).
INPUT_FUSED_LIMIT = 1 << 13


def torch_module() -> Any:
    global _TORCH
    if _TORCH is None:
        import torch

        _TORCH = torch
    return _TORCH


_TORCH: Any = None


def first_float_tensor(obj: Any, depth: int = 0) -> Optional[torch.Tensor]:
    if isinstance(obj, (_TORCH or torch_module()).Tensor):
        return obj if obj.is_floating_point() else None
    if depth > 2:
        return None
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = first_float_tensor(o, depth + 1)
            if t is not None:
                return t
    elif isinstance(obj, dict):
        for o in obj.values():
            t = first_float_tensor(o, depth + 1)
            if t is not None:
                return t
    return None


def float_tensors(obj: Any, out: List[torch.Tensor], depth: int = 0) -> None:
    torch = torch_module()
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() > 0:
            out.append(obj.detach())
    elif depth <= 2 and isinstance(obj, (list, tuple)):
        for o in obj:
            float_tensors(o, out, depth + 1)
    elif depth <= 2 and isinstance(obj, dict):
        for o in obj.values():
            float_tensors(o, out, depth + 1)


def kept_outputs(refs: Sequence[Tuple[int, Any, Any]], rank: Dict[int, int]) -> Tuple[List[Any], List[int]]:
    """The first floating-point tensor of each kept, non-empty module output, and the engine
    index of its module (modules the engine does not know are left out)."""
    tensors: List[Any] = []
    ranks: List[int] = []
    for i, out, _ in refs:
        r = rank.get(i)
        t = first_float_tensor(out) if out is not None else None
        if r is None or t is None or t.numel() == 0:
            continue
        tensors.append(t)
        ranks.append(r)
    return tensors, ranks


def getter(indices: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """``lambda xs: [xs[i] for i in indices]`` at C speed (itemgetter, always a sequence)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda xs: (xs[i],)
    return operator.itemgetter(*indices)


class NormPlan:
    """L2 norm of each tensor of a fixed list (gradients or parameters), in few launches.

    ``torch._foreach_norm`` is one fused kernel on CUDA but a loop of one kernel per tensor on
    CPU; there, tensors of one shape (biases and weights of a stack of equal layers) are stacked
    and reduced in one go. Norms come out grouped; :attr:`order` maps them back to list order.
    Built from the first step's tensors; any surprise later (a sparse or missing gradient)
    raises, and the caller falls back to the generic path.
    """

    def __init__(self, tensors: Sequence[torch.Tensor], stack_limit: int) -> None:
        by_key: Dict[Tuple[Any, ...], List[int]] = {}
        for i, t in enumerate(tensors):
            if stack_limit and t.layout == torch_module().strided and t.numel() <= stack_limit:
                by_key.setdefault((tuple(t.shape), t.dtype, t.device), []).append(i)
        stacked = [ix for ix in by_key.values() if len(ix) >= 2]
        taken = {i for ix in stacked for i in ix}
        singles = [i for i in range(len(tensors)) if i not in taken]
        # Per group: its tensors, and the dims of the stacked tensor to reduce (all but the first).
        # Scalars (0-d) are stacked and reshaped to (k, 1).
        self.groups = [(getter(ix), tuple(range(1, tensors[ix[0]].dim() + 1)) or None, len(ix)) for ix in stacked]
        self.singles = getter(singles) if singles else None
        self.singles_f32 = all(tensors[i].dtype == torch_module().float32 for i in singles)
        self.order = np.array([i for ix in stacked for i in ix] + singles, dtype=np.intp)
        self.device = tensors[0].device

    def __call__(self, tensors: Sequence[torch.Tensor], out: List[torch.Tensor]) -> None:
        torch = torch_module()
        vector_norm = torch.linalg.vector_norm
        # Two ops per group and two for the rest: on a fast step each op costs microseconds.
        f32 = torch.float32
        for get, dims, k in self.groups:
            if dims is None:
                out.append(vector_norm(torch.stack(get(tensors)).reshape(k, 1), dim=1, dtype=f32))
            else:
                out.append(vector_norm(torch.stack(get(tensors)), dim=dims, dtype=f32))
        if self.singles is not None:
            norms = torch.stack(torch._foreach_norm(list(self.singles(tensors))))
            out.append(norms if self.singles_f32 and norms.dtype == f32 else norms.float())


# Probe slope kinds as the extension's reader numbers them.
SLOPES = {None: 0, "tanh": 1, "sigmoid": 2, "softsign": 3}


class Probe:
    """What to measure on one activation module (decided by the engine)."""

    __slots__ = ("center", "cols", "death", "half", "module", "row", "slope", "spec", "unit_axis")

    def __init__(self, row: int, d: Dict[str, Any], unit_axis: int) -> None:
        self.row = row
        self.module: int = d["module"]
        sat = d.get("saturation")
        self.center: float = 0.0 if sat is None else float(sat[0])
        self.half: Optional[float] = None if sat is None else float(sat[1])
        self.death: bool = bool(d["death"])
        self.slope: Optional[str] = d.get("slope")
        if self.slope not in ("tanh", "sigmoid", "softsign"):
            self.slope = None
        self.unit_axis = unit_axis
        # What the extension's reader takes (TensorReader.activations).
        self.spec = (row, unit_axis, self.center, self.half, self.death, SLOPES[self.slope])
        # Columns of the engine's activation row this probe fills (absmax always).
        self.cols = (
            [0] + ([1] if self.half is not None else []) + ([2] if self.death else []) + ([3] if self.slope else [])
        )

    def key(self) -> Tuple[Any, ...]:
        return (self.center, self.half, self.death, self.slope, self.unit_axis)


def activation_group(probe: Probe, y: torch.Tensor) -> torch.Tensor:
    """Statistics of ``y`` (``G`` stacked outputs of modules measured alike, shape
    ``(G, *output)``) as a ``(G, len(probe.cols))`` float32 tensor, in ``probe.cols`` order.

    Built from reductions that are fast on CPU too (amax/amin, sums, L2 norms): comparisons
    counted with ``sum`` and ``count_nonzero`` are 10-50x slower there."""
    torch = torch_module()
    g = y.shape[0]
    if y.dim() == 1:  # scalar outputs: one unit each
        y = y.reshape(g, 1)
    nd = y.dim() - 1
    flat = y.reshape(g, -1)
    n = flat.shape[1]
    cols: List[Any] = []
    dead = None
    if probe.death:
        # ReLU family: outputs are >= 0, so the per-unit maximum gives both the dead units
        # (maximum exactly 0 over the whole batch) and the largest magnitude.
        axis = unit_axis(probe, nd) % max(nd, 1)
        dims = tuple(d + 1 for d in range(nd) if d != axis)
        per_unit = y.amax(dim=dims) if dims else y
        cols.append(per_unit.amax(dim=1))
        dead = per_unit.eq(0).sum(dim=1) / float(per_unit.shape[1])
    else:
        cols.append(torch.maximum(flat.amax(dim=1), flat.amin(dim=1).neg()))
    if probe.half is not None:
        shifted = flat - probe.center if probe.center else flat
        band = torch.nn.functional.hardshrink(shifted, probe.half)
        cols.append(band.sign_().abs_().mean(dim=1))
    if dead is not None:
        cols.append(dead)
    if probe.slope is not None:
        sq = torch.linalg.vector_norm(flat, dim=1, dtype=torch.float32).square() / n
        if probe.slope == "tanh":
            cols.append(1.0 - sq)
        elif probe.slope == "sigmoid":
            cols.append(flat.sum(dim=1, dtype=torch.float32) / n - sq)
        else:  # softsign: mean((1 - |y|)^2)
            l1 = torch.linalg.vector_norm(flat, ord=1, dim=1, dtype=torch.float32) / n
            cols.append(1.0 - 2.0 * l1 + sq)
    return torch.stack([c.to(torch.float32) for c in cols], dim=1)


def input_stats(x: torch.Tensor) -> torch.Tensor:
    """``min, max, mean, std`` of one input batch, as a float32 tensor of 4 on its device."""
    torch = torch_module()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()
    lo, hi = torch.aminmax(x)
    if x.numel() <= INPUT_FUSED_LIMIT:
        # Fewest ops: on a fast step each op costs far more (code and data out of cache) than
        # the arithmetic, whose cost decides only for large batches.
        std, mean = torch.std_mean(x, correction=0)
    else:
        # Two passes of fast reductions: torch.std_mean is ~10x slower per element on CPU.
        mean = x.mean()
        std = torch.dist(x, mean).div_(math.sqrt(x.numel()))
    stats = torch.stack((lo, hi, mean, std))
    return stats if stats.dtype == torch.float32 else stats.float()


ActPlan = List[Tuple["Probe", Callable[[Sequence[Any]], Sequence[Any]], np.ndarray, np.ndarray]]


class Measurer:
    """The norm and activation plans of one model, built from its first step and kept while
    the tensors keep their kinds (anything else falls back to a generic path and regroups)."""

    def __init__(self) -> None:
        self.torch = torch_module()
        # Gradient/parameter norm plan (None: not built yet or not applicable).
        self.norm_plan: Optional[NormPlan] = None
        self.plan_tried = False
        self.act_plan: Optional[ActPlan] = None

    def gradient_norms(
        self, grads: Sequence[Optional[torch.Tensor]], parts: List[torch.Tensor]
    ) -> Optional[np.ndarray]:
        """Appends the L2 norm of each present gradient to ``parts``; returns which gradient
        (index into ``grads``) each appended norm belongs to, or None when none is present."""
        if not grads:
            return None
        plan = self.norm_plan
        if plan is not None:
            n_before = len(parts)
            try:
                plan(grads, parts)  # type: ignore[arg-type]  # a None raises TypeError
                return plan.order
            except (TypeError, AttributeError):
                pass  # a parameter without gradient this step
            except RuntimeError:
                self.norm_plan = None  # a sparse or moved gradient: the generic path from now
            del parts[n_before:]
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return None
        if len(present) == len(grads) and not self.plan_tried:
            plan = self._plan(grads)  # type: ignore[arg-type]
            if plan is not None:
                plan(grads, parts)  # type: ignore[arg-type]
                return plan.order
        self.generic_norms([g for g in grads if g is not None], parts)
        return np.asarray(present, dtype=np.intp)

    def _plan(self, tensors: Sequence[torch.Tensor]) -> Optional[NormPlan]:
        if not self.plan_tried:
            self.plan_tried = True
            torch = self.torch
            device = tensors[0].device
            if all(t.device == device and t.layout == torch.strided for t in tensors):
                self.norm_plan = NormPlan(tensors, STACK_LIMIT if device.type == "cpu" else 0)
        return self.norm_plan

    def generic_norms(self, tensors: List[torch.Tensor], parts: List[torch.Tensor]) -> None:
        torch = self.torch
        tensors = [t.coalesce().values() if t.is_sparse else t for t in tensors]
        device = tensors[0].device
        if all(t.device == device for t in tensors):
            parts.append(torch.stack(torch._foreach_norm(tensors)).float())
        else:
            parts.append(torch.stack([torch.linalg.vector_norm(t).to(device) for t in tensors]).float())

    def weight_norms(self, weights: Sequence[torch.Tensor], parts: List[torch.Tensor]) -> np.ndarray:
        """Appends the L2 norm of each parameter to ``parts`` (read under no_grad: no graph, no
        detach needed); returns which parameter each appended norm belongs to."""
        plan = self.norm_plan
        if plan is not None:
            try:
                n_before = len(parts)
                plan(weights, parts)
                return plan.order
            except RuntimeError:
                del parts[n_before:]
        self.generic_norms(list(weights), parts)
        return np.arange(len(weights), dtype=np.intp)

    def weights_before(self, weights: Sequence[Any]) -> List[Tuple[int, torch.Tensor]]:
        """A copy of a strided sample (at most :data:`UPDATE_SAMPLE` elements) of up to
        :data:`UPDATE_WEIGHTS` weights (parameters of 2 or more dimensions, evenly spread over
        the model), taken before an optimizer step, each with its parameter index."""
        chosen = update_weights([w is not None and w.dim() >= 2 and w.is_floating_point() for w in weights])
        out: List[Tuple[int, torch.Tensor]] = []
        with self.torch.no_grad():
            for i in chosen:
                w = weights[i]
                if w.numel() == 0 or w.is_sparse:
                    continue
                flat = w.detach().reshape(-1)
                out.append((i, flat[:: update_stride(flat.numel())].float().clone()))
        return out

    def grads_at(
        self, grads: Sequence[Any], before: Sequence[Tuple[int, torch.Tensor]]
    ) -> List[Tuple[int, torch.Tensor]]:
        """The gradients at the weights' elements :meth:`weights_before` sampled, copied."""
        out: List[Tuple[int, torch.Tensor]] = []
        with self.torch.no_grad():
            for i, old in before:
                g = grads[i] if i < len(grads) else None
                if g is not None and not g.is_sparse and g.numel() * old.numel() > 0:
                    flat = g.detach().reshape(-1)
                    out.append((i, flat[:: update_stride(flat.numel())].float().clone()))
        return out

    def updates(
        self,
        weights: Sequence[Any],
        before: Sequence[Tuple[int, torch.Tensor]],
        grads: Sequence[Tuple[int, torch.Tensor]] = (),
        skip: Collection[int] = (),
    ) -> Optional[Updates]:
        """How the optimizer step moved each sampled weight, on the samples
        :meth:`weights_before` and :meth:`grads_at` took: how far, ``|after - before| /
        |before|`` (inf where it was all zeros), and in which direction, the cosine between
        the move and the gradient (-1 straight down it, as SGD steps; NaN where either is zero,
        without a gradient sample, or for a parameter in ``skip``: its optimizer maximizes)."""
        torch = self.torch
        at = dict(grads)
        index: List[int] = []
        olds: List[Any] = []
        news: List[Any] = []
        with torch.no_grad():
            for i, old in before:
                if i >= len(weights):
                    continue
                flat = weights[i].detach().reshape(-1)
                new = flat[:: update_stride(flat.numel())].float()
                if new.shape == old.shape and new.device == old.device:
                    index.append(i)
                    olds.append(old)
                    news.append(new)
            if not index:
                return None
            deltas = torch._foreach_sub(news, olds)
            moved = torch.stack(list(torch._foreach_norm(deltas)))
            ratio = moved / torch.stack(list(torch._foreach_norm(olds)))
            direction = None
            if at:
                nan = torch.full((), float("nan"), device=moved.device)
                cos = []
                for i, d in zip(index, deltas):
                    g = at.get(i)
                    if g is None or i in skip or g.shape != d.shape or g.device != d.device:
                        cos.append(nan)
                    else:
                        cos.append(torch.dot(d, g) / (d.norm() * g.norm()))
                direction = torch.stack(cos).float()
        return Updates(ratio.float(), np.asarray(index, dtype=np.intp), direction)

    def output_absmax(
        self, refs: Sequence[Tuple[int, Any, Any]], rank: Dict[int, int]
    ) -> Optional[Tuple[Any, np.ndarray]]:
        """Largest magnitude of each kept module output (its first floating-point tensor), as
        (one device vector, each value's engine module index). One batched reduction."""
        torch = self.torch
        tensors, ranks = kept_outputs(refs, rank)
        tensors = [t.detach() for t in tensors]
        if not tensors:
            return None
        with torch.no_grad():
            try:
                norms = torch._foreach_norm(tensors, float("inf"))
            except (RuntimeError, TypeError):  # mixed devices or dtypes: one by one
                norms = [t.abs().max() for t in tensors]
            try:
                vec = torch.stack(list(norms)).to(torch.float32)
            except (RuntimeError, TypeError):
                vec = torch.stack([n.reshape(()).to(torch.float32) for n in norms])
        return vec, np.asarray(ranks, dtype=np.intp)

    def grad_zero_shares(self, grads: Sequence[Any]) -> Optional[Tuple[Any, np.ndarray]]:
        """For each gradient of 2 or more dimensions: the share of its rows (output units) and
        of its columns (input units) that are exactly zero, as (one device vector: all the row
        shares, then all the column shares; the parameter index of each)."""
        torch = self.torch
        rows: List[Any] = []
        cols: List[Any] = []
        index: List[int] = []
        with torch.no_grad():
            for i, g in enumerate(grads):
                if g is None or g.dim() < 2 or g.numel() == 0 or g.is_sparse:
                    continue
                # A row is zero when its largest and smallest entries are: no |g| copy of the
                # gradient at the step's peak memory.
                d = g.detach()
                if d.is_complex():  # (a complex entry is zero when both its parts are)
                    d = torch.view_as_real(d)
                a = d.reshape(g.shape[0], g.shape[1], -1)
                rows.append(((a.amax(dim=(1, 2)) == 0) & (a.amin(dim=(1, 2)) == 0)).float().mean())
                cols.append(((a.amax(dim=(0, 2)) == 0) & (a.amin(dim=(0, 2)) == 0)).float().mean())
                index.append(i)
            if not index:
                return None
            return torch.stack(rows + cols), np.asarray(index, dtype=np.intp)

    def activation_parts(
        self, probes: Sequence[Probe], outs: Sequence[Any]
    ) -> Optional[Tuple[List[Any], np.ndarray, np.ndarray]]:
        """Stats of each probed module's latest output, as (device tensors, where they go in
        the engine's activation table, samples per unit). Modules measured alike whose outputs
        have one shape are stacked and reduced together. The grouping is kept while every probe
        keeps running with outputs that stack: anything else raises and regroups."""
        torch = self.torch
        with torch.no_grad():
            plan = self.act_plan
            if plan is not None:
                try:
                    return self._run_act_plan(plan, len(probes), outs)
                except (TypeError, AttributeError, RuntimeError):
                    self.act_plan = None
            plan, complete = self._build_act_plan(probes, outs)
            if not plan:
                return None
            if complete:
                self.act_plan = plan
            return self._run_act_plan(plan, len(probes), outs)

    def _build_act_plan(self, probes: Sequence[Probe], outs: Sequence[Any]) -> Tuple[ActPlan, bool]:
        torch = self.torch
        groups: Dict[Tuple[Any, ...], List[Probe]] = {}
        complete = True
        for probe in probes:
            y = outs[probe.row]
            if not isinstance(y, torch.Tensor) or not y.is_floating_point() or y.numel() == 0:
                complete = False
                continue
            groups.setdefault((y.shape, y.dtype, y.device, probe.key()), []).append(probe)
        plan: ActPlan = []
        for members in groups.values():
            rows = np.array([m.row for m in members], dtype=np.intp)
            cols = np.asarray(members[0].cols, dtype=np.intp)
            index = (rows[:, None] * 5 + cols[None, :]).reshape(-1)
            plan.append((members[0], getter([m.row for m in members]), rows, index))
        return plan, complete

    def _run_act_plan(
        self, plan: ActPlan, n_probes: int, outs: Sequence[Any]
    ) -> Tuple[List[Any], np.ndarray, np.ndarray]:
        torch = self.torch
        parts: List[Any] = []
        samples = np.full(n_probes, np.nan, dtype=np.float32)
        for probe, get, rows, _ in plan:
            ys = get(outs)
            first = ys[0]
            if not first.is_floating_point() or first.numel() == 0 or any(y.shape != first.shape for y in ys):
                raise RuntimeError("activation output changed kind")
            # Stacked in chunks of at most STACK_BYTES: a stack is a copy, made while the
            # step's activations are all alive.
            per = max(1, STACK_BYTES // max(1, first.numel() * first.element_size()))
            for k in range(0, len(ys), per):
                chunk = ys[k : k + per]
                y = torch.stack(chunk) if len(chunk) > 1 else chunk[0].detach().unsqueeze(0)
                parts.append(activation_group(probe, y).reshape(-1))
            samples[rows] = samples_per_unit(probe, first.shape)
        index = plan[0][3] if len(plan) == 1 else np.concatenate([g[3] for g in plan])
        return parts, index, samples


# The most a sampled step's stack of same-shape activation outputs copies at once.
STACK_BYTES = 16 << 20


def unit_axis(probe: Probe, nd: int) -> int:
    """The axis of one module output (``nd`` dimensions, batch first) that indexes units:
    channels after a convolution when there are spatial dimensions, else the last axis; the
    only axis of an unbatched vector."""
    if nd < 2:
        return 0
    if probe.unit_axis == 1 and nd < 3:
        return -1
    return probe.unit_axis


def samples_per_unit(probe: Probe, shape: Sequence[int]) -> float:
    """Batch x spatial samples behind each unit's death verdict (host-side: shapes only)."""
    nd = len(shape)
    if nd == 0:
        return 1.0
    axis = unit_axis(probe, nd)
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel / max(int(shape[axis]), 1)


class Summaries:
    """What the device path keeps of a forward pass's module calls instead of the tensors: per
    call, the largest magnitude of each floating-point tensor of its output and of its inputs,
    reduced on the device as the call returns (one ``_foreach_norm``), so that no output is
    held through backward. A NaN/Inf survives the reduction: the values say where one first
    appeared (:meth:`~neuraldbg._model.WatchedModel.first_nonfinite_summary`), and the first
    output tensor's value is the module's output scale. They travel to the host in the step's
    one vector (:meth:`vector`).

    Called as a record is (see ``_hooks.make_record``): ``summaries(index, output, args)``."""

    __slots__ = ("calls", "norms", "plan", "torch")

    def __init__(self) -> None:
        self.torch = torch_module()
        # (module index, float tensors of the output, of the inputs), in completion order.
        self.calls: List[Tuple[int, int, int]] = []
        # Their reductions (float32 0-d tensors on the device), one after another.
        self.norms: List[Any] = []
        # The device-side origin's index tensors, by the calls they are for (see origin).
        self.plan: Optional[Tuple[Any, Any, Any]] = None

    def __call__(self, index: int, output: Any, args: Any) -> None:
        outs: List[Any] = []
        float_tensors(output, outs)
        ins: List[Any] = []
        float_tensors(args, ins)
        tensors = outs + ins
        if tensors:
            torch = self.torch
            with torch.no_grad():
                try:
                    norms = torch._foreach_norm(tensors, float("inf"), dtype=torch.float32)
                except (RuntimeError, TypeError):  # mixed devices: one by one
                    norms = [torch.linalg.vector_norm(t, float("inf"), dtype=torch.float32) for t in tensors]
            self.norms.extend(norms)
        self.calls.append((index, len(outs), len(ins)))

    def clear(self) -> None:
        self.calls.clear()
        self.norms.clear()

    def __bool__(self) -> bool:
        return bool(self.calls)

    def vector(self) -> Any:
        """Every value, one float32 device vector (None when there is none)."""
        if not self.norms:
            return None
        return self.torch.stack(self.norms)

    def origin(
        self,
        vals: Any,
        ranks_of: Callable[[List[Tuple[int, int, int]]], Tuple[np.ndarray, np.ndarray]],
        to_device: Callable[[np.ndarray, Any], Any],
    ) -> Any:
        """On the device, without a host read: the engine index of the module where a NaN/Inf
        first appeared among the calls (the rule of ``first_nonfinite_summary``: the first call
        whose output is not finite, its own module if its inputs were finite, else the enclosing
        one), -1 when none; a 0-d float32 tensor. ``vals``: :meth:`vector`; ``ranks_of(calls)``:
        per call, its own and its enclosing module's engine index (-1: unknown); ``to_device``:
        host array -> device tensor without waiting. For the distributed exchange, which takes
        each rank's origin before the vector reaches a host. What depends only on which calls
        the step made is built once and kept while they stay the same."""
        torch = self.torch
        device = vals.device
        key = (tuple(self.calls), device)
        if self.plan is None or self.plan[0] != key:
            counts = [o + i for _, o, i in self.calls]
            call_of = np.repeat(np.arange(len(self.calls), dtype=np.int64), counts)
            is_out = np.concatenate([np.arange(o + i) < o for _, o, i in self.calls]).astype(np.int64)
            own, enclosing = ranks_of(self.calls)
            self.plan = (
                key,
                to_device(np.stack([call_of, is_out]), device),
                to_device(np.stack([own, enclosing]).astype(np.float32), device),
            )
        _, meta, ranks = self.plan
        n = len(self.calls)
        bad = (~torch.isfinite(vals)).to(torch.float32)
        out_bad = torch.zeros(n, device=device).index_add_(0, meta[0], bad * meta[1])
        in_bad = torch.zeros(n, device=device).index_add_(0, meta[0], bad * (1 - meta[1]))
        pos = torch.arange(n, device=device)
        first = torch.where(out_bad > 0, pos, torch.full_like(pos, n)).min()
        c = first.clamp(max=n - 1)
        rank = torch.where(in_bad[c] > 0, ranks[1][c], ranks[0][c])
        return torch.where(first < n, rank, torch.full_like(rank, -1.0))

    def take(self) -> Tuple[List[Tuple[int, int, int]], int]:
        """The calls (what :func:`read_summaries` needs to read the vector back) and the
        vector's length; starts afresh."""
        calls, n = self.calls, len(self.norms)
        self.calls = []
        self.norms.clear()
        return calls, n


def read_summaries(calls: Sequence[Tuple[int, int, int]], values: np.ndarray) -> List[Tuple[int, float, bool, bool]]:
    """Per call of :class:`Summaries`: ``(module index, first output's largest magnitude (NaN:
    none), output finite, inputs finite)``."""
    out: List[Tuple[int, float, bool, bool]] = []
    k = 0
    for index, n_out, n_in in calls:
        outs = values[k : k + n_out]
        ins = values[k + n_out : k + n_out + n_in]
        k += n_out + n_in
        first = float(outs[0]) if n_out else math.nan
        out.append((index, first, bool(np.isfinite(outs).all()), bool(np.isfinite(ins).all())))
    return out


def finite_flags(objs: Sequence[Any]) -> List[bool]:
    """Whether every float tensor inside each object is finite: one transfer for all of them.
    Uses min/max (finite iff both are) to avoid a full-size boolean mask per tensor."""
    torch = torch_module()
    per_obj: List[List[Any]] = []
    for obj in objs:
        ts: List[Any] = []
        float_tensors(obj, ts)
        per_obj.append(ts)
    flat = [t for ts in per_obj for t in ts]
    if not flat:
        return [True] * len(objs)
    device = flat[0].device
    with torch.no_grad():
        ext = torch.stack([torch.stack(torch.aminmax(t)).to(device=device, dtype=torch.float32) for t in flat])
        ok = torch.isfinite(ext).all(dim=1).tolist()
    out: List[bool] = []
    k = 0
    for ts in per_obj:
        out.append(all(ok[k : k + len(ts)]))
        k += len(ts)
    return out


def identical_rows(weights: Sequence[Any]) -> List[bool]:
    """Per weight (output units along dim 0, all on one device): whether every unit's weights
    are the same, not all zero. One transfer for all of them; per-column min/max over at most 64 evenly
    spaced units (a constant initialization leaves all of them alike), so no full-size pass."""
    torch = torch_module()
    if not weights:
        return []
    with torch.no_grad():
        rows = []
        for w in weights:
            units = w.detach().reshape(w.shape[0], -1)
            units = units[:: max(1, units.shape[0] // 64)][:64]
            lo, hi = (v.float() for v in torch.aminmax(units, dim=0))
            rows.append(torch.stack(((hi - lo).amax(), torch.maximum(hi.abs(), lo.abs()).amax())))
        spread_scale = torch.stack(rows).tolist()
    return [scale > 0.0 and spread <= 1e-6 * scale for spread, scale in spread_scale]
