"""Torch-side collection: hooks that gather per-step statistics and hand them to the engine.

This module decides nothing about health. It measures, on the tensors' own device and in as
few kernel launches as it can, what the engine asks for, and moves all of a step's numbers to
the host in a single transfer.

Per step (at the first ``optimizer.step()`` after a forward pass):

* gradient L2 norm of every trainable parameter (CUDA: one fused ``torch._foreach_norm``; CPU:
  small tensors of one shape are stacked and reduced together, because the CPU ``_foreach_norm``
  is a loop of one kernel per tensor);
* on sampled steps, parameter norms (same plan) and, for each activation module, its largest
  magnitude, the share of outputs in its saturation band, the share of units that were zero for
  the whole batch and its mean slope (the engine says which apply); activation modules of one
  output shape are stacked and measured together;
* per forward pass, ``min, max, mean, std`` of the model's first floating-point input;
* the loss (given, or picked up from ``loss.backward()``).

All of it is concatenated on the device into one float32 vector and moved to the host once. On
CPU that is ``.numpy()`` of that vector (no copy) and the engine sees the step at once. On CUDA
the copy is ``non_blocking`` into pinned memory with an event recorded after it, and the step
is handed to the engine when the next forward pass starts (or at exit, or when results are
read): by then the GPU has long finished the copy, the waiting costs nothing, and nothing in the
step ever blocks the GPU.

Forward hooks are installed only where they are needed. The first forward pass hooks every
module, once, to learn the execution order. After that, module outputs are kept (by reference,
until the step is observed) only for modules that can *create* a NaN/Inf: pure containers
(``nn.Sequential``) and element-wise functions that map finite inputs to finite outputs (ReLU,
Tanh, Dropout, ...) cannot, so they get no hook. Activation modules get a second, separate hook
only on the steps whose activation statistics are measured.

Only when a step's gradients or loss are not finite are the kept outputs scanned (in forward
order) for the first module whose output went non-finite: two transfers on such a failure step,
none on a healthy one, and the origin is still named on the very step it happens.
"""

from __future__ import annotations

import json
import math
import operator
import warnings
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .errors import NeuralDbgWarning

if TYPE_CHECKING:  # pragma: no cover
    import torch

INF = math.inf

# Modules that hold a lookup table rather than a transform: their weight scale says nothing
# about signal propagation.
_TABLE_MODULES = {"Embedding", "EmbeddingBag"}

# torch.nn classes whose output is finite whenever their input is (element-wise functions,
# max-pooling, dropout, reshapes) or is a child's output (nn.Sequential): they can never be
# where a NaN/Inf is created, so they need no hook for the non-finite scan. Exact classes only:
# a user subclass may add its own computation.
_PASSIVE = frozenset(
    {
        "Sequential", "Identity", "Flatten", "Unflatten",
        "ReLU", "ReLU6", "LeakyReLU", "ELU", "CELU", "SELU", "GELU", "SiLU", "Mish", "Hardswish",
        "Tanh", "Sigmoid", "Hardtanh", "Hardsigmoid", "Softsign", "Tanhshrink", "Softshrink",
        "Hardshrink",
        "Dropout", "Dropout1d", "Dropout2d", "Dropout3d", "AlphaDropout", "FeatureAlphaDropout",
        "MaxPool1d", "MaxPool2d", "MaxPool3d", "AdaptiveMaxPool1d", "AdaptiveMaxPool2d",
        "AdaptiveMaxPool3d",
    }
)

# Normalization layers: they keep the layout of the transform before them.
_NORMS = ("BatchNorm", "GroupNorm", "InstanceNorm", "LayerNorm", "LocalResponseNorm", "RMSNorm")

# Tensors up to this many elements are stacked with others of their shape for one reduction
# (CPU): below it, per-tensor launch overhead (~1.5 us) dominates the copy that stacking costs.
_STACK_LIMIT = 1 << 16


def _torch() -> Any:
    import torch

    return torch


def _is_passive(m: Any) -> bool:
    cls = type(m)
    return cls.__name__ in _PASSIVE and cls.__module__.startswith("torch.nn.modules")


def _first_float_tensor(obj: Any, depth: int = 0) -> "Optional[torch.Tensor]":
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        return obj if obj.is_floating_point() else None
    if depth > 2:
        return None
    if isinstance(obj, (list, tuple)):
        for o in obj:
            t = _first_float_tensor(o, depth + 1)
            if t is not None:
                return t
    elif isinstance(obj, dict):
        for o in obj.values():
            t = _first_float_tensor(o, depth + 1)
            if t is not None:
                return t
    return None


def _float_tensors(obj: Any, out: "List[torch.Tensor]", depth: int = 0) -> None:
    torch = _torch()
    if isinstance(obj, torch.Tensor):
        if obj.is_floating_point() and obj.numel() > 0:
            out.append(obj.detach())
    elif depth <= 2 and isinstance(obj, (list, tuple)):
        for o in obj:
            _float_tensors(o, out, depth + 1)
    elif depth <= 2 and isinstance(obj, dict):
        for o in obj.values():
            _float_tensors(o, out, depth + 1)


def _getter(indices: Sequence[int]) -> Callable[[Sequence[Any]], Sequence[Any]]:
    """``lambda xs: [xs[i] for i in indices]`` at C speed (itemgetter, always a sequence)."""
    if len(indices) == 1:
        i = indices[0]
        return lambda xs: (xs[i],)
    return operator.itemgetter(*indices)


class _NormPlan:
    """L2 norm of each tensor of a fixed list (gradients or parameters), in few launches.

    ``torch._foreach_norm`` is one fused kernel on CUDA but a loop of one kernel per tensor on
    CPU; there, tensors of one shape (biases and weights of a stack of equal layers) are stacked
    and reduced in one go. Norms come out grouped; :attr:`order` maps them back to list order.
    Built from the first step's tensors; any surprise later (a sparse or missing gradient)
    raises, and the caller falls back to the generic path.
    """

    def __init__(self, tensors: "Sequence[torch.Tensor]", stack_limit: int) -> None:
        by_key: Dict[Tuple[Any, ...], List[int]] = {}
        for i, t in enumerate(tensors):
            if stack_limit and t.layout == _torch().strided and t.numel() <= stack_limit:
                by_key.setdefault((tuple(t.shape), t.dtype, t.device), []).append(i)
        stacked = [ix for ix in by_key.values() if len(ix) >= 2]
        taken = {i for ix in stacked for i in ix}
        singles = [i for i in range(len(tensors)) if i not in taken]
        self.groups = [(_getter(ix), len(ix)) for ix in stacked]
        self.singles = _getter(singles) if singles else None
        self.order = np.array([i for ix in stacked for i in ix] + singles, dtype=np.intp)
        self.device = tensors[0].device

    def __call__(self, tensors: "Sequence[torch.Tensor]", out: "List[torch.Tensor]") -> None:
        torch = _torch()
        vector_norm = torch.linalg.vector_norm
        for get, k in self.groups:
            out.append(vector_norm(torch.stack(get(tensors)).reshape(k, -1), dim=1, dtype=torch.float32))
        if self.singles is not None:
            out.append(torch.stack(torch._foreach_norm(list(self.singles(tensors)))).float())


class _Probe:
    """What to measure on one activation module (decided by the engine)."""

    __slots__ = ("row", "module", "center", "half", "death", "slope", "unit_axis", "cols")

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
        # Columns of the engine's activation row this probe fills (absmax always).
        self.cols = [0] + ([1] if self.half is not None else []) + ([2] if self.death else []) + (
            [3] if self.slope else []
        )

    def key(self) -> Tuple[Any, ...]:
        return (self.center, self.half, self.death, self.slope, self.unit_axis)


def _activation_group(probe: _Probe, y: "torch.Tensor") -> "torch.Tensor":
    """Statistics of ``y`` (``G`` stacked outputs of modules measured alike, shape
    ``(G, *output)``) as a ``(G, len(probe.cols))`` float32 tensor, in ``probe.cols`` order.

    Built from reductions that are fast on CPU too (amax/amin, sums, L2 norms): comparisons
    counted with ``sum`` and ``count_nonzero`` are 10-50x slower there."""
    torch = _torch()
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
        axis = _unit_axis(probe, nd) % max(nd, 1)
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


class _Layout:
    """Where each statistic of one step sits in the step's flat vector (host-side metadata)."""

    __slots__ = ("step", "lr", "grad_order", "weight_order", "act_index", "act_samples", "n_act",
                 "loss", "n_inputs", "final", "origin", "checked", "ran")

    def __init__(self, step: int, lr: Optional[float], final: bool) -> None:
        self.step = step
        self.lr = lr
        self.final = final
        self.grad_order: Optional[np.ndarray] = None
        self.weight_order: Optional[np.ndarray] = None
        self.act_index: Optional[np.ndarray] = None
        self.act_samples: Optional[np.ndarray] = None
        self.n_act = 0
        self.loss = False
        self.n_inputs = 0
        # Found when the loss appeared (CPU): the non-finite origin (and whether the outputs were
        # scanned at all), and which modules ran.
        self.origin: Optional[int] = None
        self.checked = False
        self.ran: Optional[List[int]] = None


class _Pending:
    """A step whose statistics are on their way to the host (CUDA)."""

    __slots__ = ("layout", "host", "event", "refs")

    def __init__(self, layout: _Layout, host: np.ndarray, event: Any, refs: List[Tuple[int, Any, Any]]) -> None:
        self.layout = layout
        self.host = host
        self.event = event
        self.refs = refs


class Collector:
    """Installs hooks on one model and feeds a ``neuraldbg._native.Engine``."""

    def __init__(
        self,
        model: "torch.nn.Module",
        engine: Any,
        *,
        criterion: "Optional[torch.nn.Module]",
        activation_every: int,
        weight_every: int,
        dense_steps: int,
        forward_check: str,
        step_on: str,
        on_observed: Optional[Callable[[int], None]] = None,
    ) -> None:
        torch = _torch()
        self.torch = torch
        self.model = model
        self.engine = engine
        self.criterion = criterion
        self.activation_every = activation_every
        self.weight_every = weight_every
        self.dense_steps = dense_steps
        self.forward_check = forward_check
        self.step_on = step_on
        self.on_observed = on_observed

        self.names: List[str] = []
        self.modules: List[Any] = []
        for name, m in model.named_modules():
            self.names.append(name)
            self.modules.append(m)
        self.by_name = {n: i for i, n in enumerate(self.names)}

        # Trainable parameters, each owned by the first module that holds it directly.
        self.params: List[Any] = []
        self.param_names: List[str] = []
        self.param_owner: List[int] = []
        seen: set = set()
        for i, m in enumerate(self.modules):
            for pname, p in m.named_parameters(recurse=False):
                if p is None or not p.requires_grad or id(p) in seen:
                    continue
                seen.add(id(p))
                self.params.append(p)
                self.param_names.append(f"{self.names[i]}.{pname}" if self.names[i] else pname)
                self.param_owner.append(i)
        self.param_ids = {id(p) for p in self.params}
        self.no_grads = np.full(len(self.params), -1.0, dtype=np.float32)

        self.step = 0
        self.handles: List[Any] = []
        # Forward hooks on modules: index -> handle. Activation probes have their own.
        self.module_handles: Dict[int, Any] = {}
        self.probe_handles: List[Any] = []
        self.probes_armed = False
        # (module index, output, positional args) of every hooked module call of the current
        # forward, in completion order.
        self.refs: List[Tuple[int, Any, Any]] = []
        # Latest output of each activation probe in this step (by probe row).
        self.act_out: List[Any] = []
        self.act_none: List[Any] = []
        self.order: Optional[List[int]] = None
        self.order_set: set = set()
        self.inputs: List[Any] = []
        # Losses of this step: given explicitly (criterion hook, record_loss) or picked up from
        # the backward call they were passed to. Averaged over micro-batches.
        self.losses: List[Any] = []
        self.auto_losses: List[Any] = []
        # grad_fn of the model's outputs in this step: a backward() whose graph reaches one of
        # them is this model's loss.
        self.output_fns: List[Any] = []
        self.forward_gen = 0
        self.observed_gen = 0
        self.count_pending = False
        self.relevant: Dict[int, bool] = {}
        self.optimizer_name: Optional[str] = None
        self.probes: List[_Probe] = []
        self.rank: Dict[int, int] = {}
        self.registered = False
        self.disabled = False
        self.internal_error: Optional[BaseException] = None
        # Gradient/parameter norm plan (None: not built yet or not applicable).
        self.norm_plan: Optional[_NormPlan] = None
        self.plan_tried = False
        # Transfer: None until the first observation decides (True on CUDA: asynchronous copy
        # into pinned memory, handed to the engine when the next forward starts).
        self.defer: Optional[bool] = None
        self.pending: Optional[_Pending] = None
        self.pinned: Any = None
        # Work done when the step's loss appears (its forward is complete): the activation
        # statistics, and on CPU the loss check that lets module outputs go before backward.
        self.staged_gen = 0
        self.act_staged: Optional[Tuple[List[Any], np.ndarray, np.ndarray]] = None
        self.act_plan: Optional[List[Any]] = None
        self.origin: Optional[int] = None
        self.origin_checked = False
        self.ran: Optional[List[int]] = None

    # ----------------------------------------------------------------- installation

    def install(self) -> None:
        # Until the first step is observed every module is hooked, to learn the forward order.
        for i in range(1, len(self.modules)):
            self._hook_module(i)
        root = self.modules[0]
        self.handles.append(root.register_forward_pre_hook(self._on_root_pre, with_kwargs=True))
        self.handles.append(root.register_forward_hook(self._on_root_post))
        if self.criterion is not None:
            self.handles.append(self.criterion.register_forward_hook(self._on_criterion))
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.handles.append(register_optimizer_step_pre_hook(self._on_optimizer_pre))
        self.handles.append(register_optimizer_step_post_hook(self._on_optimizer_post))
        if self.criterion is None:
            _BACKWARD_TAP.add(self)

    def _hook_module(self, i: int) -> None:
        keep = self.forward_check != "off" or not self.registered
        hook = _make_ref_hook(i, self.refs.append, keep)
        self.module_handles[i] = self.modules[i].register_forward_hook(hook)

    def _rehook(self) -> None:
        """After the first step: keep hooks only on modules that can create a non-finite value
        (and on parameter owners, whose running tells "no gradient" from a zero gradient)."""
        owners = set(self.param_owner)
        wanted = {
            i for i in range(1, len(self.modules)) if i in owners or not _is_passive(self.modules[i])
        }
        for i in list(self.module_handles):
            self.module_handles.pop(i).remove()
        for i in sorted(wanted):
            self._hook_module(i)

    def _arm_probes(self, on: bool) -> None:
        """Activation probes are hooked only on steps whose activations are measured."""
        on = on and not self.disabled
        if on == self.probes_armed or not self.probes:
            return
        if on:
            slots = self.act_out
            for p in self.probes:
                self.probe_handles.append(self.modules[p.module].register_forward_hook(_make_slot_hook(p.row, slots)))
        else:
            for h in self.probe_handles:
                h.remove()
            self.probe_handles.clear()
        self.probes_armed = on

    def remove(self) -> None:
        for h in [*self.handles, *self.module_handles.values(), *self.probe_handles]:
            try:
                h.remove()
            except Exception:  # pragma: no cover - removal must never raise into the user's code
                pass
        self.handles.clear()
        self.module_handles.clear()
        self.probe_handles.clear()
        self.probes_armed = False
        self.pending = None
        self.refs.clear()
        self.act_out[:] = self.act_none
        self.inputs.clear()
        self.losses.clear()
        self.auto_losses.clear()
        self.output_fns.clear()
        _BACKWARD_TAP.remove(self)

    # ----------------------------------------------------------------------- hooks

    def _on_root_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.disabled:
            return
        if self.pending is not None:
            self._consume()
        self.forward_gen += 1
        self.refs.clear()
        self.ran = None
        self.act_out[:] = self.act_none
        try:
            x = _first_float_tensor(args)
            if x is None and kwargs:
                x = _first_float_tensor(kwargs)
            if x is not None and x.numel() > 0:
                self.inputs.append(self._input_stats(x.detach()))
        except Exception as e:  # pragma: no cover - defensive
            self._fail(e)

    def _input_stats(self, x: "torch.Tensor") -> "torch.Tensor":
        torch = self.torch
        if x.dtype not in (torch.float32, torch.float64):
            x = x.float()
        lo, hi = torch.aminmax(x)
        # Two passes of fast reductions: torch.std_mean is ~20x slower on CPU.
        mean = x.mean()
        std = torch.linalg.vector_norm(x - mean) / math.sqrt(x.numel())
        return torch.stack((lo, hi, mean, std)).to(torch.float32)

    def _on_root_post(self, module: Any, args: Any, output: Any) -> None:
        if self.disabled:
            return
        self.refs.append((0, output, args))
        if self.criterion is None:
            t = _first_float_tensor(output)
            if t is not None and t.grad_fn is not None and len(self.output_fns) < 8:
                self.output_fns.append(t.grad_fn)
        if self.order is None:
            order: List[int] = []
            done = set()
            for i, _, _ in self.refs:
                if i not in done:
                    done.add(i)
                    order.append(i)
            self.order = order
            self.order_set = done
        if self.step_on == "backward":
            t = _first_float_tensor(output)
            if t is not None and t.requires_grad:
                t.register_hook(self._on_output_grad)

    def _on_output_grad(self, grad: Any) -> None:
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(self._on_backward_end)

    def _on_backward_end(self) -> None:
        if self.disabled or self.forward_gen == self.observed_gen:
            return
        self._observe(lr=None)
        self.step += 1
        self._arm_probes(self._activations_next())

    def _on_criterion(self, module: Any, args: Any, output: Any) -> None:
        torch = self.torch
        if isinstance(output, torch.Tensor) and output.numel() == 1:
            self.losses.append(output.detach())
            self._on_loss(output)

    def record_loss(self, loss: Any) -> None:
        torch = self.torch
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                loss = loss.detach().float().mean()
            self.losses.append(loss.detach())
        else:
            self.losses.append(torch.tensor(float(loss)))

    def on_backward(self, tensors: Any) -> None:
        """A ``backward()`` started somewhere in the process: keep its tensor if it is a scalar
        whose graph reaches this model's output (the loss of this model, not of another)."""
        torch = self.torch
        if self.disabled or not self.output_fns or not isinstance(tensors, torch.Tensor):
            return
        fn = tensors.grad_fn
        if fn is None or tensors.numel() != 1 or not _reaches(fn, self.output_fns):
            return
        loss = tensors.detach()
        # GradScaler's `scaler.scale(loss)` multiplies by a constant 1-element scale tensor:
        # undo it so the loss keeps its own scale when the scale factor changes.
        if type(fn).__name__ == "MulBackward0":
            other = getattr(fn, "_saved_other", None)
            if isinstance(other, torch.Tensor) and other.numel() == 1 and not other.requires_grad:
                loss = loss / other.detach()
        self.auto_losses.append(loss.reshape(()))
        self._on_loss(tensors)

    def _on_loss(self, loss: "torch.Tensor") -> None:
        """The loss of a forward pass exists, so that forward is complete: measure the
        activations now (their outputs are still hot in cache) and release them. On CPU also
        read the loss (a host read, no device involved): a finite loss releases the kept module
        outputs before backward starts, as a plain loop would have; a NaN/Inf one has them
        scanned right now for the module that produced it. Holding every output through
        backward instead costs 10-15% on a CPU CNN (the allocator gets fresh pages each step).
        """
        if self.disabled or not self.registered or self.staged_gen == self.forward_gen:
            return
        self.staged_gen = self.forward_gen
        try:
            if self.probes_armed:
                self.act_staged = self._activation_parts()
                self.act_out[:] = self.act_none
            if self.forward_check != "off" and not self.defer and loss.device.type == "cpu":
                if self.origin is None and not math.isfinite(float(loss.detach().reshape(-1)[0])):
                    self.origin = self._first_nonfinite(self.refs)
                    self.origin_checked = bool(self.refs)
                self.ran = [i for i, _, _ in self.refs]
                self.refs.clear()
        except Exception as e:  # pragma: no cover - defensive
            self._fail(e)

    def _is_relevant(self, optimizer: Any) -> bool:
        key = id(optimizer)
        hit = self.relevant.get(key)
        if hit is None:
            hit = any(
                id(p) in self.param_ids for g in optimizer.param_groups for p in g["params"]
            )
            self.relevant[key] = hit
            if hit and self.optimizer_name is None:
                self.optimizer_name = type(optimizer).__name__
        return hit

    def _on_optimizer_pre(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.disabled or self.step_on != "optimizer" or not self._is_relevant(optimizer):
            return
        if self.forward_gen == self.observed_gen:
            return  # a second optimizer of the same iteration: one step
        self._observe(lr=_lr_of(optimizer))
        self.count_pending = True

    def _on_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        if self.count_pending and self._is_relevant(optimizer):
            self.step += 1
            self.count_pending = False
            self._arm_probes(self._activations_next())

    # ------------------------------------------------------------------ observation

    def _fail(self, e: BaseException) -> None:
        """Monitoring broke: say so once and stop, leaving training untouched."""
        self.internal_error = e
        self.disabled = True
        self.pending = None
        warnings.warn(
            f"NeuralDBG stopped observing after an internal error: {type(e).__name__}: {e}",
            NeuralDbgWarning,
            stacklevel=3,
        )

    def _register(self) -> None:
        executed = self.order or []
        pos = {m: k for k, m in enumerate(executed)}
        by_name = self.by_name
        # Modules that never ran go right after their nearest ancestor that did.
        keys: List[Tuple[float, int]] = []
        for i, name in enumerate(self.names):
            if i in pos:
                keys.append((float(pos[i]), i))
                continue
            anchor = -1.0
            parts = name.split(".")
            for cut in range(len(parts) - 1, -1, -1):
                j = by_name.get(".".join(parts[:cut]))
                if j is not None and j in pos:
                    anchor = float(pos[j])
                    break
            keys.append((anchor + 0.5 + i * 1e-6, i))
        keys.sort()
        self.spec_order = [i for _, i in keys]
        rank = {m: k for k, m in enumerate(self.spec_order)}
        self.rank = rank

        modules = []
        for i in self.spec_order:
            m = self.modules[i]
            attrs = []
            for a in ("min_val", "max_val"):
                v = getattr(m, a, None)
                if isinstance(v, (int, float)):
                    attrs.append([a, float(v)])
            modules.append(
                {"name": self.names[i], "kind": type(m).__name__, "attrs": attrs, "executed": i in pos}
            )
        params = []
        for p, pname, owner in zip(self.params, self.param_names, self.param_owner):
            leaf = pname.rsplit(".", 1)[-1]
            role = "weight" if leaf.startswith("weight") else "bias" if leaf.startswith("bias") else "other"
            fan_in = None
            kind = type(self.modules[owner]).__name__
            if role == "weight" and p.dim() >= 2 and kind not in _TABLE_MODULES:
                fan_in = int(p.shape[1]) * int(np.prod(p.shape[2:])) if p.dim() > 2 else int(p.shape[1])
            params.append(
                {"module": rank[owner], "name": pname, "numel": int(p.numel()), "role": role, "fan_in": fan_in}
            )
        spec = {"modules": modules, "params": params, "optimizer": self.optimizer_name}
        probes = json.loads(self.engine.register_model(json.dumps(spec)))
        axes = self._unit_axes()
        self.probes = []
        for row, d in enumerate(probes):
            module = self.spec_order[d["module"]]
            d = dict(d, module=module)
            self.probes.append(_Probe(row, d, axes.get(module, -1)))
        self.act_none = [None] * len(self.probes)
        # This first step ran with every module hooked: its probe outputs are in refs.
        self.act_out[:] = self.act_none
        row_of = {p.module: p.row for p in self.probes}
        for i, out, _ in self.refs:
            r = row_of.get(i)
            if r is not None:
                self.act_out[r] = out
        self.registered = True
        self.probes_armed = False

    def _unit_axes(self) -> Dict[int, int]:
        """Per executed module: 1 (channels) when the nearest transform with parameters before
        it in the forward order is a convolution, else -1 (features last). Normalization layers
        in between (Conv -> BatchNorm -> ReLU) keep the convolution's layout. One pass."""
        owners = set(self.param_owner)
        axes: Dict[int, int] = {}
        axis = -1
        for m in self.order or []:
            axes[m] = axis
            if m in owners:
                kind = type(self.modules[m]).__name__
                if not any(n in kind for n in _NORMS):
                    axis = 1 if kind.startswith("Conv") else -1
        return axes

    def _sampled(self, every: int) -> bool:
        return self.step < self.dense_steps or (every > 0 and self.step % every == 0)

    def _activations_next(self) -> bool:
        """Measure activations in the coming step: on its sample period, or densely while the
        engine has an unconfirmed activation change (so it is confirmed within `persistence`
        steps, not `persistence` samples)."""
        return self._sampled(self.activation_every) or bool(self.engine.activation_pending)

    def _observe(self, lr: Optional[float], final: bool = False) -> None:
        try:
            self._observe_inner(lr, final)
        except Exception as e:
            self._fail(e)
        finally:
            self.observed_gen = self.forward_gen
            self.inputs.clear()
            self.losses.clear()
            self.auto_losses.clear()
            self.output_fns.clear()
            if not final:
                self.refs.clear()
            self.act_out[:] = self.act_none
            self.act_staged = None
            self.origin = None
            self.origin_checked = False
            self.ran = None

    def _observe_inner(self, lr: Optional[float], final: bool) -> None:
        torch = self.torch
        first = not self.registered
        if first:
            self._register()
        layout = _Layout(self.step, lr, final)
        parts: List[Any] = []
        with torch.no_grad():
            self._gradient_norms(parts, layout)
            if self.params and self._sampled(self.weight_every):
                self._weight_norms(parts, layout)
            staged = self.act_staged
            if staged is None and self.probes and (first or self.probes_armed):
                staged = self._activation_parts()
            if staged is not None:
                parts.extend(staged[0])
                layout.act_index = staged[1]
                layout.n_act = int(staged[1].size)
                layout.act_samples = staged[2]
            layout.origin = self.origin
            layout.checked = self.origin_checked
            layout.ran = self.ran
            pending = self.losses or self.auto_losses
            if pending:
                layout.loss = True
                loss = pending[0] if len(pending) == 1 else torch.stack([t.reshape(()).float() for t in pending]).mean()
                parts.append(loss.reshape(1).to(torch.float32))
            if self.inputs:
                layout.n_inputs = len(self.inputs)
                parts.extend(self.inputs)
            flat = self._flatten(parts)
        refs = self.refs
        if first:
            self._rehook()
        if flat is None:
            self._ingest(layout, np.zeros(0, np.float32), refs)
            return
        if self.defer is None:
            self.defer = flat.device.type == "cuda"
        if not self.defer:
            # The one device-to-host transfer of the step (a view, no copy, on CPU).
            host = flat.numpy() if flat.device.type == "cpu" else flat.cpu().numpy()
            self._ingest(layout, host, refs)
            return
        # Asynchronous: copy into pinned memory behind the step's kernels; handed to the engine
        # when the next forward pass starts. The outputs kept for the non-finite scan wait with
        # it (only until then: they are released before the next step allocates its own).
        host, event = self._start_copy(flat)
        keep = list(refs) if self.forward_check != "off" or final else [(i, None, None) for i, _, _ in refs]
        self.pending = _Pending(layout, host, event, keep)
        if final:
            self._consume()

    def _flatten(self, parts: "List[torch.Tensor]") -> "Optional[torch.Tensor]":
        torch = self.torch
        if not parts:
            return None
        device = parts[0].device
        if any(p.device != device for p in parts):
            parts = [p.to(device) for p in parts]
        return torch.cat([p.reshape(-1) for p in parts]) if len(parts) > 1 else parts[0].reshape(-1)

    def _start_copy(self, flat: "torch.Tensor") -> Tuple[np.ndarray, Any]:
        torch = self.torch
        n = int(flat.numel())
        if flat.device.type != "cuda":
            # The deferred path without a GPU (tests): a plain copy, consumed later alike.
            return flat.detach().clone().numpy(), None
        if self.pinned is None or self.pinned.numel() < n:
            self.pinned = torch.empty(max(n, 256) * 2, dtype=torch.float32, pin_memory=True)
        dst = self.pinned[:n]
        dst.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flat.device))
        return dst.numpy(), event

    def _consume(self) -> None:
        """Hands the pending (CUDA) step to the engine; its copy finished long ago."""
        p = self.pending
        self.pending = None
        if p is None or self.disabled:
            return
        try:
            if p.event is not None and not p.event.query():
                p.event.synchronize()  # rare: the CPU ran more than a step ahead of the GPU
            self._ingest(p.layout, p.host, p.refs)
        except Exception as e:
            self._fail(e)

    def flush(self) -> None:
        """Makes every observed step visible to the engine (before results are read)."""
        if self.pending is not None:
            self._consume()

    def _gradient_norms(self, parts: "List[torch.Tensor]", layout: _Layout) -> None:
        grads = [p.grad for p in self.params]
        if not grads:
            return
        plan = self.norm_plan
        if plan is not None:
            n_before = len(parts)
            try:
                plan(grads, parts)
                layout.grad_order = plan.order
                return
            except (TypeError, AttributeError):
                pass  # a parameter without gradient this step
            except RuntimeError:
                self.norm_plan = None  # a sparse or moved gradient: the generic path from now
            del parts[n_before:]
        present = [i for i, g in enumerate(grads) if g is not None]
        if not present:
            return
        if len(present) == len(grads) and not self.plan_tried:
            plan = self._plan(grads)
            if plan is not None:
                plan(grads, parts)
                layout.grad_order = plan.order
                return
        self._generic_norms([grads[i] for i in present], parts)
        layout.grad_order = np.asarray(present, dtype=np.intp)

    def _plan(self, tensors: "Sequence[torch.Tensor]") -> Optional[_NormPlan]:
        if not self.plan_tried:
            self.plan_tried = True
            torch = self.torch
            device = tensors[0].device
            if all(t.device == device and t.layout == torch.strided for t in tensors):
                self.norm_plan = _NormPlan(tensors, _STACK_LIMIT if device.type == "cpu" else 0)
        return self.norm_plan

    def _generic_norms(self, tensors: "List[torch.Tensor]", parts: "List[torch.Tensor]") -> None:
        torch = self.torch
        tensors = [t.coalesce().values() if t.is_sparse else t for t in tensors]
        device = tensors[0].device
        if all(t.device == device for t in tensors):
            parts.append(torch.stack(torch._foreach_norm(tensors)).float())
        else:
            parts.append(torch.stack([torch.linalg.vector_norm(t).to(device) for t in tensors]).float())

    def _weight_norms(self, parts: "List[torch.Tensor]", layout: _Layout) -> None:
        weights = self.params  # read under no_grad: no graph, no detach needed
        plan = self.norm_plan
        if plan is not None:
            try:
                n_before = len(parts)
                plan(weights, parts)
                layout.weight_order = plan.order
                return
            except RuntimeError:
                del parts[n_before:]
        self._generic_norms(list(weights), parts)
        layout.weight_order = np.arange(len(weights), dtype=np.intp)

    def _activation_parts(self) -> Optional[Tuple[List[Any], np.ndarray, np.ndarray]]:
        """Stats of each probed module's latest output, as (device tensors, where they go in
        the engine's activation table, samples per unit). Modules measured alike whose outputs
        have one shape are stacked and reduced together. The grouping is kept while every probe
        keeps running with outputs that stack: anything else raises and regroups."""
        torch = self.torch
        with torch.no_grad():
            plan = self.act_plan
            if plan is not None:
                try:
                    return self._run_act_plan(plan)
                except (TypeError, AttributeError, RuntimeError):
                    self.act_plan = None
            plan, complete = self._build_act_plan()
            if not plan:
                return None
            if complete:
                self.act_plan = plan
            return self._run_act_plan(plan)

    def _build_act_plan(self) -> Tuple[List[Tuple[_Probe, Callable[[Sequence[Any]], Sequence[Any]], np.ndarray, np.ndarray]], bool]:
        torch = self.torch
        groups: Dict[Tuple[Any, ...], List[_Probe]] = {}
        outs = self.act_out
        complete = True
        for probe in self.probes:
            y = outs[probe.row]
            if not isinstance(y, torch.Tensor) or not y.is_floating_point() or y.numel() == 0:
                complete = False
                continue
            groups.setdefault((y.shape, y.dtype, y.device, probe.key()), []).append(probe)
        plan = []
        for members in groups.values():
            rows = np.array([m.row for m in members], dtype=np.intp)
            cols = np.asarray(members[0].cols, dtype=np.intp)
            index = (rows[:, None] * 5 + cols[None, :]).reshape(-1)
            plan.append((members[0], _getter([m.row for m in members]), rows, index))
        return plan, complete

    def _run_act_plan(self, plan: List[Tuple[_Probe, Callable[[Sequence[Any]], Sequence[Any]], np.ndarray, np.ndarray]]) -> Tuple[List[Any], np.ndarray, np.ndarray]:
        torch = self.torch
        outs = self.act_out
        parts: List[Any] = []
        samples = np.full(len(self.probes), np.nan, dtype=np.float32)
        for probe, get, rows, _ in plan:
            ys = get(outs)
            y = torch.stack(ys) if len(ys) > 1 else ys[0].detach().unsqueeze(0)
            if not y.is_floating_point() or y.numel() == 0:
                raise RuntimeError("activation output changed kind")
            parts.append(_activation_group(probe, y).reshape(-1))
            samples[rows] = _samples_per_unit(probe, y.shape[1:])
        index = plan[0][3] if len(plan) == 1 else np.concatenate([g[3] for g in plan])
        return parts, index, samples

    def _ingest(self, layout: _Layout, flat: np.ndarray, refs: List[Tuple[int, Any, Any]]) -> None:
        """Host side of one step: unpack the flat vector and feed the engine."""
        off = 0
        grad_norms = self.no_grads.copy()
        order = layout.grad_order
        if order is not None:
            grad_norms[order] = flat[: order.size]
            off = order.size
        weight_norms = None
        if layout.weight_order is not None:
            k = layout.weight_order.size
            weight_norms = self.no_grads.copy()
            weight_norms[layout.weight_order] = flat[off : off + k]
            off += k
        activations = None
        if layout.act_index is not None:
            table = np.full(len(self.probes) * 5, np.nan, dtype=np.float32)
            table[layout.act_index] = flat[off : off + layout.n_act]
            off += layout.n_act
            table[4::5] = layout.act_samples
            activations = table
        loss_value = None
        if layout.loss:
            loss_value = float(flat[off])
            off += 1
        input_stats = None
        if layout.n_inputs:
            input_stats = np.ascontiguousarray(flat[off : off + 4 * layout.n_inputs])

        if not grad_norms.all() and self.order:
            zeros = np.flatnonzero(grad_norms == 0.0)
            # An exactly-zero gradient of a module that ran before but not in this step is
            # "no gradient" (zero_grad(set_to_none=False) leaves zeros), not a vanishing one.
            ran_before = self.order_set
            ran_now = set(layout.ran) if layout.ran is not None else {i for i, _, _ in refs}
            for p in zeros:
                owner = self.param_owner[p]
                if owner in ran_before and owner not in ran_now:
                    grad_norms[p] = -1.0

        nonfinite = None
        # "No gradient" is -1, finite: the float64 sum is finite iff every norm is.
        suspicious = layout.final or not math.isfinite(float(grad_norms.sum(dtype=np.float64))) or (
            loss_value is not None and not math.isfinite(loss_value)
        )
        # Whether this step's module outputs were scanned: then "no origin" means they were all
        # finite, and the NaN/Inf came from the loss computation or the backward pass.
        checked = False
        if suspicious and self.forward_check != "off":
            if layout.origin is not None or layout.checked:
                nonfinite, checked = layout.origin, True
            elif refs:
                nonfinite, checked = self._first_nonfinite(refs), True

        self.engine.observe(
            layout.step,
            grad_norms,
            weight_norms=weight_norms,
            activations=activations,
            inputs=input_stats,
            loss=loss_value,
            lr=layout.lr,
            nonfinite_module=nonfinite,
            outputs_checked=checked,
        )
        if self.on_observed is not None:
            self.on_observed(layout.step)

    def _first_nonfinite(self, refs: List[Tuple[int, Any, Any]]) -> Optional[int]:
        """Index (in the engine's module order) of the module whose own computation first
        produced a NaN/Inf in this step's forward pass.

        Module calls are scanned in completion order. The first call with a non-finite output
        is the origin if its inputs were finite. If its inputs were already non-finite, no
        module that had finished produced them: they came from inline code (``torch.softmax``,
        a division...) of a module still running: the enclosing module (skipping
        ``nn.Sequential``, which has no code of its own), which is reported.

        Runs only on a step whose gradients or loss are not finite (or after a crash): one
        batched finiteness check of every kept output, one of the culprit's inputs.
        """
        calls = [(i, out, args) for i, out, args in refs if out is not None]
        flags = _finite_flags([out for _, out, _ in calls])
        for (i, _, args), ok in zip(calls, flags):
            if ok:
                continue
            inputs_finite = all(_finite_flags([args]))
            if inputs_finite or i == 0:
                return self.rank.get(i)
            return self.rank.get(self._enclosing(i))
        return None

    def _parent(self, i: int) -> int:
        name = self.names[i]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        return self.by_name.get(parent, 0)

    def _enclosing(self, i: int) -> int:
        p = self._parent(i)
        while p != 0 and type(self.modules[p]).__name__ == "Sequential" and _is_passive(self.modules[p]):
            p = self._parent(p)
        return p

    def finish(self, crashed: bool) -> None:
        """Called on exit. A step still on its way to the host is handed to the engine. A
        forward pass that never reached ``optimizer.step()`` is observed too (gradients if any,
        inputs, loss, and the forward outputs scanned for NaN/Inf) when the loop raised, or when
        it stopped on its own after that forward went non-finite (``if not
        torch.isfinite(loss): break``), so a run that ended in a failure still leaves its
        diagnosis. A final healthy forward (an evaluation pass) is not a step."""
        if self.disabled:
            return
        self.flush()
        if self.forward_gen > self.observed_gen and (crashed or self._pending_failed()):
            self._observe(lr=None, final=True)
            self.flush()

    def _pending_failed(self) -> bool:
        """Whether the forward pass not yet observed produced a NaN/Inf (read at exit only)."""
        torch = self.torch
        try:
            with torch.no_grad():
                for t in [*self.losses, *self.auto_losses, *self.inputs]:
                    if not bool(torch.isfinite(t).all()):
                        return True
                return bool(self.refs) and self._first_nonfinite(self.refs) is not None
        except Exception:  # pragma: no cover - exit must never raise
            return False


def _unit_axis(probe: _Probe, nd: int) -> int:
    """The axis of one module output (``nd`` dimensions, batch first) that indexes units:
    channels after a convolution when there are spatial dimensions, else the last axis; the
    only axis of an unbatched vector."""
    if nd < 2:
        return 0
    if probe.unit_axis == 1 and nd < 3:
        return -1
    return probe.unit_axis


def _samples_per_unit(probe: _Probe, shape: Sequence[int]) -> float:
    """Batch x spatial samples behind each unit's death verdict (host-side: shapes only)."""
    nd = len(shape)
    if nd == 0:
        return 1.0
    axis = _unit_axis(probe, nd)
    numel = 1
    for d in shape:
        numel *= int(d)
    return numel / max(int(shape[axis]), 1)


def _finite_flags(objs: Sequence[Any]) -> List[bool]:
    """Whether every float tensor inside each object is finite: one transfer for all of them.
    Uses min/max (finite iff both are) to avoid a full-size boolean mask per tensor."""
    torch = _torch()
    per_obj: List[List[Any]] = []
    for obj in objs:
        ts: List[Any] = []
        _float_tensors(obj, ts)
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


def _make_ref_hook(index: int, append: Callable[[Any], None], keep: bool) -> Callable[..., None]:
    if keep:

        def hook(module: Any, args: Any, output: Any) -> None:
            append((index, output, args))

    else:  # forward_check="off": remember that the module ran, keep no tensor

        def hook(module: Any, args: Any, output: Any) -> None:
            append((index, None, None))

    return hook


def _make_slot_hook(row: int, slots: List[Any]) -> Callable[..., None]:
    def hook(module: Any, args: Any, output: Any) -> None:
        slots[row] = output

    return hook


def _lr_of(optimizer: Any) -> Optional[float]:
    try:
        lr = optimizer.param_groups[0].get("lr")
    except Exception:  # pragma: no cover
        return None
    if isinstance(lr, (int, float)):
        return float(lr)
    torch = _torch()
    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.numel() == 1:
        return float(lr)
    return None


def _reaches(fn: Any, targets: List[Any], limit: int = 512) -> bool:
    """Whether autograd node ``fn`` leads (through ``next_functions``) to one of ``targets``,
    visiting at most ``limit`` nodes."""
    wanted = {id(t) for t in targets}
    stack = [fn]
    seen = {id(fn)}
    while stack and limit > 0:
        node = stack.pop()
        limit -= 1
        if id(node) in wanted:
            return True
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append(nxt)
    return False


class _BackwardTap:
    """Observes ``torch.autograd.backward`` (which ``Tensor.backward`` calls) while at least one
    collector without an explicit criterion is active, to read each step's loss without a
    change to the training loop. The call itself is passed through untouched; the original
    function is restored when the last collector leaves."""

    def __init__(self) -> None:
        self.collectors: List[Collector] = []
        self.original: Optional[Callable[..., Any]] = None
        self.installed = self._backward  # one bound method, so identity checks work

    def add(self, c: "Collector") -> None:
        import torch.autograd

        if not self.collectors:
            self.original = torch.autograd.backward
            torch.autograd.backward = self.installed  # type: ignore[assignment]
        self.collectors.append(c)

    def remove(self, c: "Collector") -> None:
        import torch.autograd

        if c in self.collectors:
            self.collectors.remove(c)
            if not self.collectors and torch.autograd.backward is self.installed:
                torch.autograd.backward = self.original  # type: ignore[assignment]

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        for c in list(self.collectors):
            try:
                c.on_backward(tensors)
            except Exception:  # never let observation break the user's backward
                pass
        assert self.original is not None
        return self.original(tensors, *args, **kwargs)


_BACKWARD_TAP = _BackwardTap()
