"""Independent ground truth: plain-PyTorch instrumentation of a training run.

Nothing here imports neuraldbg. The recorder measures, with straightforward per-tensor PyTorch
calls (``.item()`` everywhere; speed is irrelevant here), what actually happened in a run:
per-layer gradient norms, activation saturation / dead units / slope, the first module whose
forward output went non-finite on each step, input finiteness and scale, and the loss. Scenario
checks derive each scenario's ground truth from these measurements and compare it with what the
scenario claims, before the diagnosis is scored.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional

import torch
import torch.nn as nn

VANISHING = 1e-6
EXPLODING = 1e3


def _tensors(out) -> List[torch.Tensor]:
    if isinstance(out, torch.Tensor):
        return [out] if out.is_floating_point() else []
    if isinstance(out, (list, tuple)):
        return [t for o in out for t in _tensors(o)]
    return []


@dataclass
class Record:
    """What happened, step by step."""

    layer_names: List[str] = field(default_factory=list)  # modules owning parameters, forward order
    module_order: List[str] = field(default_factory=list)  # all modules, forward completion order
    grad: Dict[str, List[float]] = field(default_factory=dict)  # layer -> norm per step
    weight: Dict[str, List[float]] = field(default_factory=dict)  # layer -> parameter norm per step (before its update)
    training: List[bool] = field(default_factory=list)  # model.training at each step
    out_scale: Dict[str, float] = field(default_factory=dict)  # module -> largest |output| of the first step
    saturated: Dict[str, List[float]] = field(default_factory=dict)
    dead: Dict[str, List[float]] = field(default_factory=dict)
    slope: Dict[str, List[float]] = field(default_factory=dict)
    first_nonfinite: List[Optional[str]] = field(default_factory=list)
    input_finite: List[bool] = field(default_factory=list)
    input_scale: List[float] = field(default_factory=list)
    loss: List[float] = field(default_factory=list)
    steps: int = 0

    # ----------------------------------------------------------- derived facts

    def first_step(self, pred: Callable[[int], bool], persist: int = 1) -> Optional[int]:
        """First step from which ``pred`` holds for ``persist`` consecutive steps (or to the end)."""
        for s in range(self.steps):
            end = min(self.steps, s + persist)
            if all(pred(t) for t in range(s, end)):
                return s
        return None

    def layers_where(self, step: int, pred: Callable[[float], bool]) -> List[str]:
        return [n for n in self.layer_names if len(self.grad[n]) > step and pred(self.grad[n][step])]

    def gradient_root(self, step: int, pred: Callable[[float], bool]) -> Optional[str]:
        """Where a gradient failure begins along the backward pass: among the layers failing at
        ``step``, the longest run of adjacent layers (forward order), and its last layer."""
        failing = set(self.layers_where(step, pred))
        best: List[str] = []
        run: List[str] = []
        for n in self.layer_names:
            if n in failing:
                run.append(n)
                if len(run) >= len(best):
                    best = list(run)
            else:
                run = []
        return best[-1] if best else None

    def any_layer(self, step: int, pred: Callable[[float], bool]) -> bool:
        return bool(self.layers_where(step, pred))

    def max_grad(self, step: int) -> float:
        vals = [self.grad[n][step] for n in self.layer_names if len(self.grad[n]) > step]
        return max(vals, default=0.0)

    def all_finite(self, step: int) -> bool:
        vals = [self.grad[n][step] for n in self.layer_names if len(self.grad[n]) > step]
        return all(math.isfinite(v) for v in vals) and math.isfinite(self.loss[step])


class Recorder:
    """Attach to a model before training; call the step methods from the loop."""

    def __init__(self, model: nn.Module, band: float = 0.01) -> None:
        self.model = model
        self.band = band
        self.rec = Record()
        self._names = {id(m): n for n, m in model.named_modules()}
        self._owners = [
            (n, m) for n, m in model.named_modules() if any(p.requires_grad for p in m.parameters(recurse=False))
        ]
        self._first_forward = True
        self._step_nonfinite: Optional[str] = None
        self._handles = [m.register_forward_hook(self._hook) for m in model.modules()]

    def close(self) -> None:
        for h in self._handles:
            h.remove()

    def _hook(self, module: nn.Module, args, out) -> None:
        name = self._names[id(module)]
        if self._first_forward and name not in self.rec.module_order:
            self.rec.module_order.append(name)
        ts = _tensors(out)
        if self._step_nonfinite is None and any(not torch.isfinite(t).all().item() for t in ts):
            # The module made the NaN/Inf itself if its inputs were finite; otherwise it came
            # from inline code of the module that called it (its parent).
            if all(torch.isfinite(t).all().item() for t in _tensors(args)) or not name:
                self._step_nonfinite = name
            else:
                self._step_nonfinite = name.rsplit(".", 1)[0] if "." in name else ""
        if not ts:
            return
        y = ts[0].detach()
        if self._first_forward:
            scale = y.abs().max().item() if y.numel() else 0.0
            self.rec.out_scale[name] = max(self.rec.out_scale.get(name, 0.0), scale)
        kind = type(module).__name__
        if kind == "Tanh":
            self._act(name, (y.abs() > 1 - 2 * self.band).float().mean().item(), None, (1 - y * y).mean().item())
        elif kind == "Sigmoid":
            sat = ((y < self.band) | (y > 1 - self.band)).float().mean().item()
            self._act(name, sat, None, (y * (1 - y)).mean().item())
        elif kind == "ReLU":
            if y.dim() >= 3 and self._conv_before(name):
                dead = (y <= 0).transpose(0, 1).reshape(y.shape[1], -1).all(dim=1)
            elif y.dim() >= 2:
                dead = (y <= 0).reshape(-1, y.shape[-1]).all(dim=0)
            else:
                dead = y <= 0
            self._act(name, None, dead.float().mean().item(), None)

    def _conv_before(self, name: str) -> bool:
        order = self.rec.module_order
        k = order.index(name) if name in order else len(order)
        owners = {n for n, _ in self._owners}
        for prev in reversed(order[:k]):
            if prev in owners:
                return type(dict(self.model.named_modules())[prev]).__name__.startswith("Conv")
        return False

    def _act(self, name: str, sat, dead, slope) -> None:
        for table, v in ((self.rec.saturated, sat), (self.rec.dead, dead), (self.rec.slope, slope)):
            if v is not None:
                series = table.setdefault(name, [])
                # One value per step: the last forward of the step wins.
                if len(series) > self.rec.steps:
                    series[-1] = v
                else:
                    series.append(v)

    def begin_forward(self, x) -> None:
        ts = _tensors(x)
        if ts:
            t = ts[0].detach()
            finite = bool(torch.isfinite(t).all().item())
            scale = t.abs().max().item() if finite else math.inf
        else:
            finite, scale = True, 0.0
        if len(self.rec.input_finite) > self.rec.steps:  # gradient accumulation: any bad batch counts
            self.rec.input_finite[-1] &= finite
            self.rec.input_scale[-1] = max(self.rec.input_scale[-1], scale)
        else:
            self.rec.input_finite.append(finite)
            self.rec.input_scale.append(scale)

    def end_step(self, loss: torch.Tensor) -> None:
        """After backward, before the optimizer step."""
        if self._first_forward:
            self._first_forward = False
            order = {n: i for i, n in enumerate(self.rec.module_order)}
            self.rec.layer_names = sorted((n for n, _ in self._owners), key=lambda n: order.get(n, len(order)))
            for n in self.rec.layer_names:
                self.rec.grad[n] = []
                self.rec.weight[n] = []
        for n, m in self._owners:
            sq = 0.0
            seen = False
            for p in m.parameters(recurse=False):
                if p.grad is not None:
                    seen = True
                    sq += p.grad.detach().double().norm().item() ** 2
            self.rec.grad[n].append(math.sqrt(sq) if seen else math.nan)
            self.rec.weight[n].append(
                math.sqrt(sum(p.detach().double().norm().item() ** 2 for p in m.parameters(recurse=False)))
            )
        self.rec.training.append(self.model.training)
        self.rec.loss.append(float(loss.detach().item()))
        self.rec.first_nonfinite.append(self._step_nonfinite)
        self._step_nonfinite = None
        self.rec.steps += 1
