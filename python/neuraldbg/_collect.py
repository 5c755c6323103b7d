"""Torch-side collection: hooks that gather per-step statistics and hand them to the engine.

This module decides nothing about health. It measures, on the tensors' own device and in as
few kernel launches as it can, what the engine asks for, and moves all of a step's numbers to
the host in a single transfer.

Per step (at the first ``optimizer.step()`` after a forward pass):

* gradient L2 norm of every trainable parameter: one ``torch._foreach_norm`` call;
* on sampled steps, parameter norms (one more ``_foreach_norm``) and, for each activation
  module, its largest magnitude, the share of outputs in its saturation band and the share of
  units that were zero for the whole batch (the engine says which apply);
* per forward pass, ``min, max, mean, std`` of the model's first floating-point input;
* the loss, when a criterion module was given or :meth:`record_loss` was called.

Forward outputs of every module are kept by reference until the step is observed. Only when
the step's gradients or loss are not finite are they scanned (in forward order) for the first
module whose output went non-finite: the check costs nothing on healthy steps and still names
the origin on the very step it happens.
"""

from __future__ import annotations

import json
import math
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


def _torch() -> Any:
    import torch

    return torch


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


class _Probe:
    """What to measure on one activation module (decided by the engine)."""

    __slots__ = ("row", "module", "center", "half", "death", "slope", "unit_axis")

    def __init__(self, row: int, d: Dict[str, Any], unit_axis: int) -> None:
        self.row = row
        self.module: int = d["module"]
        sat = d.get("saturation")
        self.center: Optional[float] = None if sat is None else float(sat[0])
        self.half: Optional[float] = None if sat is None else float(sat[1])
        self.death: bool = bool(d["death"])
        self.slope: Optional[str] = d.get("slope")
        self.unit_axis = unit_axis


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
        self.modules: List[torch.nn.Module] = []
        for name, m in model.named_modules():
            self.names.append(name)
            self.modules.append(m)
        self.module_index = {id(m): i for i, m in enumerate(self.modules)}
        self.by_name = {n: i for i, n in enumerate(self.names)}

        # Trainable parameters, each owned by the first module that holds it directly.
        self.params: List[torch.nn.Parameter] = []
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

        self.step = 0
        self.handles: List[Any] = []
        # (module index, output, positional args) of every module call of the current forward,
        # in completion order.
        self.refs: List[Tuple[int, Any, Any]] = []
        self.order: Optional[List[int]] = None
        self.inputs: List[torch.Tensor] = []
        # Losses of this step: given explicitly (criterion hook, record_loss) or picked up from
        # the backward call they were passed to. Averaged over micro-batches.
        self.losses: List[torch.Tensor] = []
        self.auto_losses: List[torch.Tensor] = []
        # grad_fn of the model's outputs in this step: a backward() whose graph reaches one of
        # them is this model's loss.
        self.output_fns: List[Any] = []
        self.forward_gen = 0
        self.observed_gen = 0
        self.count_pending = False
        self.relevant: Dict[int, bool] = {}
        self.optimizer_name: Optional[str] = None
        self.probes: List[_Probe] = []
        self.registered = False
        self.disabled = False
        self.internal_error: Optional[BaseException] = None

    # ----------------------------------------------------------------- installation

    def install(self) -> None:
        append = self.refs.append
        for i, m in enumerate(self.modules):
            if i == 0:
                continue  # the root's own hooks below
            self.handles.append(m.register_forward_hook(_make_ref_hook(i, append)))
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

    def remove(self) -> None:
        for h in self.handles:
            try:
                h.remove()
            except Exception:  # pragma: no cover - removal must never raise into the user's code
                pass
        self.handles.clear()
        self.refs.clear()
        self.inputs.clear()
        self.losses.clear()
        self.auto_losses.clear()
        self.output_fns.clear()
        _BACKWARD_TAP.remove(self)

    # ----------------------------------------------------------------------- hooks

    def _on_root_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if self.disabled:
            return
        self.forward_gen += 1
        self.refs.clear()
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
        std, mean = torch.std_mean(x, correction=0)
        return torch.stack((lo, hi, mean, std))

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

    def _on_criterion(self, module: Any, args: Any, output: Any) -> None:
        torch = self.torch
        if isinstance(output, torch.Tensor) and output.numel() == 1:
            self.losses.append(output.detach())

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

    # ------------------------------------------------------------------ observation

    def _fail(self, e: BaseException) -> None:
        """Monitoring broke: say so once and stop, leaving training untouched."""
        self.internal_error = e
        self.disabled = True
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
        self.probes = []
        for row, d in enumerate(probes):
            module = self.spec_order[d["module"]]
            d = dict(d, module=module)
            self.probes.append(_Probe(row, d, self._unit_axis(module)))
        self.registered = True

    def _unit_axis(self, module: int) -> int:
        """1 (channels) when the layer feeding the activation is a convolution, else -1."""
        executed = self.order or []
        owners = set(self.param_owner)
        if module in executed:
            k = executed.index(module)
            for j in reversed(executed[:k]):
                if j in owners:
                    return 1 if type(self.modules[j]).__name__.startswith("Conv") else -1
        return -1

    def _sampled(self, every: int) -> bool:
        return self.step < self.dense_steps or (every > 0 and self.step % every == 0)

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

    def _observe_inner(self, lr: Optional[float], final: bool) -> None:
        torch = self.torch
        if not self.registered:
            self._register()
        n_params = len(self.params)
        with torch.no_grad():
            present = [i for i, p in enumerate(self.params) if p.grad is not None]
            parts: List[torch.Tensor] = []
            device = None
            if present:
                grads = [self.params[i].grad for i in present]
                grads = [g.coalesce().values() if g.is_sparse else g for g in grads]
                norms = torch._foreach_norm(grads)
                device = norms[0].device
                parts.append(_stack(norms, device))
            weights = self._sampled(self.weight_every) and n_params > 0
            if weights:
                wn = torch._foreach_norm([p.detach() for p in self.params])
                device = device or wn[0].device
                parts.append(_stack(wn, device))
            act_vals: List[torch.Tensor] = []
            act_slots: List[Tuple[int, int]] = []
            act_samples: Optional[np.ndarray] = None
            if self.probes and self._sampled(self.activation_every):
                act_samples = self._activation_stats(act_vals, act_slots)
                if act_vals:
                    device = device or act_vals[0].device
                    parts.append(_stack(act_vals, device))
            pending = self.losses or self.auto_losses
            loss = None
            if pending:
                device = device or pending[0].device
                loss = torch.stack([t.reshape(()).to(device=device, dtype=torch.float32) for t in pending]).mean()
                parts.append(loss.reshape(1))
            inputs = self.inputs
            if inputs:
                device = device or inputs[0].device
                parts.append(torch.cat([t.to(device=device, dtype=torch.float32) for t in inputs]))
            # The one device-to-host transfer of the step.
            flat = torch.cat([p.to(device=device) for p in parts]).cpu().numpy() if parts else np.zeros(0, np.float32)

        off = 0
        grad_norms = np.full(n_params, -1.0, dtype=np.float32)
        if present:
            grad_norms[present] = flat[off : off + len(present)]
            off += len(present)
        weight_norms = None
        if weights:
            weight_norms = np.ascontiguousarray(flat[off : off + n_params])
            off += n_params
        activations = None
        if act_samples is not None:
            table = np.full((len(self.probes), 5), np.nan, dtype=np.float32)
            for (row, col), v in zip(act_slots, flat[off : off + len(act_vals)]):
                table[row, col] = v
            off += len(act_vals)
            table[:, 4] = act_samples
            activations = table.reshape(-1)
        loss_value = None
        if loss is not None:
            loss_value = float(flat[off])
            off += 1
        input_stats = None
        if inputs:
            input_stats = np.ascontiguousarray(flat[off : off + 4 * len(inputs)])
            off += 4 * len(inputs)

        zeros = np.flatnonzero(grad_norms == 0.0)
        if zeros.size and self.order:
            # An exactly-zero gradient of a module that ran before but not in this step is
            # "no gradient" (zero_grad(set_to_none=False) leaves zeros), not a vanishing one.
            ran_before = set(self.order)
            ran_now = {i for i, _, _ in self.refs}
            for p in zeros:
                owner = self.param_owner[p]
                if owner in ran_before and owner not in ran_now:
                    grad_norms[p] = -1.0

        nonfinite = None
        suspicious = final or not np.isfinite(grad_norms[grad_norms >= 0]).all() or (
            loss_value is not None and not math.isfinite(loss_value)
        )
        if suspicious and self.forward_check != "off":
            nonfinite = self._first_nonfinite()

        self.engine.observe(
            self.step,
            grad_norms,
            weight_norms=weight_norms,
            activations=activations,
            inputs=input_stats,
            loss=loss_value,
            lr=lr,
            nonfinite_module=nonfinite,
        )
        if self.on_observed is not None:
            self.on_observed(self.step)

    def _activation_stats(self, vals: "List[torch.Tensor]", slots: List[Tuple[int, int]]) -> np.ndarray:
        """Appends the stats tensors of each probed module's latest output; returns the
        samples-per-unit column (NaN for modules not measured this step)."""
        torch = self.torch
        latest: Dict[int, Any] = {}
        for i, out, _ in self.refs:
            latest[i] = out
        samples = np.full(len(self.probes), np.nan, dtype=np.float32)
        for probe in self.probes:
            y = latest.get(probe.module)
            if not isinstance(y, torch.Tensor) or not y.is_floating_point() or y.numel() == 0:
                continue
            y = y.detach()
            axis = probe.unit_axis if y.dim() >= 2 else 0
            if axis == 1 and y.dim() < 3:
                axis = -1
            units = int(y.shape[axis])
            samples[probe.row] = y.numel() / max(units, 1)
            vals.append(torch.linalg.vector_norm(y, ord=INF))
            slots.append((probe.row, 0))
            if probe.half is not None:
                shifted = y - probe.center if probe.center else y
                sat = torch.count_nonzero(torch.nn.functional.hardshrink(shifted, probe.half))
                vals.append(sat / y.numel())
                slots.append((probe.row, 1))
            if probe.death:
                if y.dim() >= 2:
                    dims = tuple(d for d in range(y.dim()) if d != axis % y.dim())
                    alive = torch.count_nonzero(y.amax(dim=dims))
                else:
                    alive = torch.count_nonzero(y)
                vals.append(1.0 - alive / units)
                slots.append((probe.row, 2))
            if probe.slope == "tanh":
                vals.append(1.0 - y.square().mean())
            elif probe.slope == "sigmoid":
                vals.append((y * (1.0 - y)).mean())
            elif probe.slope == "softsign":
                vals.append((1.0 - y.abs()).square().mean())
            else:
                continue
            slots.append((probe.row, 3))
        return samples

    def _first_nonfinite(self) -> Optional[int]:
        """Index (in the engine's module order) of the module whose own computation first
        produced a NaN/Inf in this step's forward pass.

        Module calls are scanned in completion order. The first call with a non-finite output
        is the origin if its inputs were finite. If its inputs were already non-finite, no
        module that had finished produced them: they came from inline code (``torch.softmax``,
        a division...) of a module still running, i.e. the enclosing module, which is reported.
        """
        torch = self.torch
        for i, out, args in self.refs:
            outs: List[torch.Tensor] = []
            _float_tensors(out, outs)
            with torch.no_grad():
                if all(bool(torch.isfinite(t).all()) for t in outs):
                    continue
                ins: List[torch.Tensor] = []
                _float_tensors(args, ins)
                inputs_finite = all(bool(torch.isfinite(t).all()) for t in ins)
            if inputs_finite or i == 0:
                return self.rank[i]
            return self.rank[self._parent(i)]
        return None

    def _parent(self, i: int) -> int:
        name = self.names[i]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        return self.by_name.get(parent, 0)

    def finish(self, crashed: bool) -> None:
        """Called on exit. When the loop raised after a forward pass that never reached
        ``optimizer.step()``, that step is observed too (gradients if any, inputs, loss, and the
        forward outputs scanned for NaN/Inf), so a crashed run still leaves its diagnosis."""
        if self.disabled or not crashed:
            return
        if self.forward_gen > self.observed_gen and self.refs:
            self._observe(lr=None, final=True)


def _make_ref_hook(index: int, append: Callable[[Any], None]) -> Callable[..., None]:
    def hook(module: Any, args: Any, output: Any) -> None:
        append((index, output, args))

    return hook


def _stack(tensors: Sequence["torch.Tensor"], device: Any) -> "torch.Tensor":
    torch = _torch()
    if all(t.device == device for t in tensors):
        return torch.stack(list(tensors)).to(torch.float32)
    return torch.stack([t.to(device) for t in tensors]).to(torch.float32)


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
