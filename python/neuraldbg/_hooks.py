"""What is hooked: every hook NeuralDBG installs on the watched model and in torch, and their
removal. The hooks only call back into the :class:`~neuraldbg._collect.Collector`, which decides
when a step is read.

* a forward pre-hook and a forward hook on the model itself (a forward pass starts and ends);
* forward hooks on modules, in two sets: first on every module (to learn the forward order),
  then only on those that can *create* a NaN/Inf (:func:`is_passive` says which cannot) and on
  parameter owners; their outputs are kept by reference for the non-finite scan;
* activation probes: a separate forward hook on each activation module the engine measures,
  armed only on the steps whose activation statistics are measured;
* the criterion's forward hook (the loss, when a ``criterion`` is given);
* torch's global optimizer step pre/post hooks (the step boundary);
* :class:`BackwardTap`, a pass-through wrapper of ``torch.autograd.backward`` that picks up
  the loss when no criterion is given.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector

# torch.nn classes whose output is finite whenever their input is (element-wise functions,
# max-pooling, dropout, reshapes) or is a child's output (nn.Sequential): they can never be
# where a NaN/Inf is created, so they need no hook for the non-finite scan. Exact classes only:
# a user subclass may add its own computation.
PASSIVE = frozenset(
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



def is_passive(m: Any) -> bool:
    cls = type(m)
    return cls.__name__ in PASSIVE and cls.__module__.startswith("torch.nn.modules")


class Hooks:
    """The handles of every hook installed for one collector; :meth:`remove` takes them all
    away (and never raises)."""

    def __init__(self, modules: List[Any], refs: List[Any], keep_outputs: bool) -> None:
        self.modules = modules
        self.refs = refs
        self.keep_outputs = keep_outputs
        self.handles: List[Any] = []
        # Forward hooks on modules: index -> handle. Activation probes have their own.
        self.module_handles: Dict[int, Any] = {}
        self.probe_handles: List[Any] = []
        self.probes_armed = False
        self.tapped = False

    def install(self, c: "Collector") -> None:
        # Until the first step is observed every module is hooked, to learn the forward order.
        for i in range(1, len(self.modules)):
            self.hook_module(i, keep=True)
        root = self.modules[0]
        self.handles.append(root.register_forward_pre_hook(c._on_root_pre, with_kwargs=True))
        self.handles.append(root.register_forward_hook(c._on_root_post))
        if c.criterion is not None:
            self.handles.append(c.criterion.register_forward_hook(c._on_criterion))
        from torch.optim.optimizer import (
            register_optimizer_step_post_hook,
            register_optimizer_step_pre_hook,
        )

        self.handles.append(register_optimizer_step_pre_hook(c._on_optimizer_pre))
        self.handles.append(register_optimizer_step_post_hook(c._on_optimizer_post))
        if c.criterion is None:
            BACKWARD_TAP.add(c)
            self.tapped = True

    def hook_module(self, i: int, keep: bool) -> None:
        hook = make_ref_hook(i, self.refs.append, keep)
        self.module_handles[i] = self.modules[i].register_forward_hook(hook)

    def rehook(self, owners: "set[int]") -> None:
        """After the first step: keep hooks only on modules that can create a non-finite value
        (and on parameter owners, whose running tells "no gradient" from a zero gradient)."""
        wanted = {i for i in range(1, len(self.modules)) if i in owners or not is_passive(self.modules[i])}
        for i in list(self.module_handles):
            self.module_handles.pop(i).remove()
        for i in sorted(wanted):
            self.hook_module(i, keep=self.keep_outputs)

    def arm_probes(self, on: bool, probe_modules: "List[tuple[int, int]]", slots: List[Any]) -> None:
        """Activation probes (``(row, module index)`` pairs) are hooked only on steps whose
        activations are measured; each writes its module's output into ``slots[row]``."""
        if on == self.probes_armed or not probe_modules:
            return
        if on:
            for row, module in probe_modules:
                self.probe_handles.append(self.modules[module].register_forward_hook(make_slot_hook(row, slots)))
        else:
            for h in self.probe_handles:
                h.remove()
            self.probe_handles.clear()
        self.probes_armed = on

    def remove(self, c: "Collector") -> None:
        for h in [*self.handles, *self.module_handles.values(), *self.probe_handles]:
            try:
                h.remove()
            except Exception:  # pragma: no cover - removal must never raise into the user's code
                pass
        self.handles.clear()
        self.module_handles.clear()
        self.probe_handles.clear()
        self.probes_armed = False
        BACKWARD_TAP.remove(c)


def make_ref_hook(index: int, append: Callable[[Any], None], keep: bool) -> Callable[..., None]:
    if keep:

        def hook(module: Any, args: Any, output: Any) -> None:
            append((index, output, args))

    else:  # forward_check="off": remember that the module ran, keep no tensor

        def hook(module: Any, args: Any, output: Any) -> None:
            append((index, None, None))

    return hook


def make_slot_hook(row: int, slots: List[Any]) -> Callable[..., None]:
    def hook(module: Any, args: Any, output: Any) -> None:
        slots[row] = output

    return hook


def reaches(fn: Any, targets: List[Any], limit: int = 512) -> bool:
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


class BackwardTap:
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


BACKWARD_TAP = BackwardTap()
