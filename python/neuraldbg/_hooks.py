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
* torch's global optimizer step post hook (the step boundary);
* a post-accumulate-grad hook on every trainable parameter: the end of each backward pass
  that gave the model gradients is where they are read (before any clipping or unscaling);
* :class:`BackwardTap`, a pass-through wrapper of ``torch.autograd.backward`` that picks up
  the loss when no criterion is given;
* :class:`ScalerTap`, a pass-through wrapper of ``GradScaler.step``: which optimizer step a
  scaler skipped, and the loss scale;
* :class:`StateTap`: ``nn.Module.__getstate__`` leaves our hooks out, so ``copy.deepcopy``,
  ``pickle`` and ``torch.save`` of a watched model work and the copy carries none of them.

Under ``torch.compile`` the forward hooks are traced into the compiled graph: there they only
keep references (no reads of the collector's state, which would become guards and recompile),
and the hook set is frozen once compilation is seen (removing a traced hook recompiles).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set

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


class Trace:
    """Compilation seen by a forward hook (set from inside traced code: a plain attribute store,
    which dynamo replays without a guard)."""

    __slots__ = ("compiled",)

    def __init__(self) -> None:
        self.compiled = False


class Hooks:
    """The handles of every hook installed for one collector; :meth:`remove` takes them all
    away (and never raises)."""

    def __init__(self, modules: List[Any], refs: List[Any], keep_outputs: bool) -> None:
        self.modules = modules
        self.refs = refs
        self.keep_outputs = keep_outputs
        self.trace = Trace()
        # Index of the module that completes first in a forward pass (known after the first
        # step): its call starts a new forward, so the previous forward's outputs are let go
        # even when the model itself is not what the loop calls (a LightningModule whose
        # training_step calls a submodule).
        self.first = [-1]
        self.handles: List[Any] = []
        # Forward hooks on modules: index -> handle. Activation probes have their own.
        self.module_handles: Dict[int, Any] = {}
        self.probe_handles: List[Any] = []
        self.probes_armed = False

    @property
    def frozen(self) -> bool:
        """Hooks traced into a compiled graph must stay: removing one recompiles."""
        return self.trace.compiled

    def install(self, c: "Collector", params: List[Any]) -> None:
        # Until the first step is observed every module is hooked, to learn the forward order.
        for i in range(1, len(self.modules)):
            self.hook_module(i, keep=True)
        root = self.modules[0]
        self._own(root.register_forward_pre_hook(c._on_root_pre, with_kwargs=True))
        self._own(root.register_forward_hook(c._on_root_post))
        if c.criterion is not None:
            self._own(c.criterion.register_forward_hook(c._on_criterion))
        for p in params:
            self.handles.append(p.register_post_accumulate_grad_hook(c._on_grad_ready))
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.handles.append(register_optimizer_step_post_hook(c._on_optimizer_post))
        SCALER_TAP.add(c)
        STATE_TAP.add(self)
        if c.criterion is None:
            BACKWARD_TAP.add(c)

    def _own(self, handle: Any) -> Any:
        STATE_TAP.ours.add(handle.id)
        self.handles.append(handle)
        return handle

    def hook_module(self, i: int, keep: bool) -> None:
        hook = make_ref_hook(i, self.refs, keep, self.trace, self.first)
        h = self.modules[i].register_forward_hook(hook)
        STATE_TAP.ours.add(h.id)
        self.module_handles[i] = h

    def rehook(self, owners: "set[int]") -> None:
        """After the first step: keep hooks only on modules that can create a non-finite value
        (and on parameter owners, whose running tells "no gradient" from a zero gradient)."""
        if self.frozen:
            return
        wanted = {i for i in range(1, len(self.modules)) if i in owners or not is_passive(self.modules[i])}
        for i in list(self.module_handles):
            self.module_handles.pop(i).remove()
        for i in sorted(wanted):
            self.hook_module(i, keep=self.keep_outputs)

    def arm_probes(self, on: bool, probe_modules: "List[tuple[int, int]]", slots: List[Any]) -> None:
        """Activation probes (``(row, module index)`` pairs) are hooked only on steps whose
        activations are measured; each writes its module's output into ``slots[row]``."""
        if on == self.probes_armed or not probe_modules or self.frozen:
            return
        if on:
            for row, module in probe_modules:
                h = self.modules[module].register_forward_hook(make_slot_hook(row, slots))
                STATE_TAP.ours.add(h.id)
                self.probe_handles.append(h)
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
        SCALER_TAP.remove(c)
        STATE_TAP.remove(self)


def _compiling() -> Callable[[], bool]:
    import torch

    return torch.compiler.is_compiling


def make_ref_hook(
    index: int, refs: List[Any], keep: bool, trace: Trace, first: List[int]
) -> Callable[..., None]:
    compiling = _compiling()
    append = refs.append
    if keep:

        def hook(module: Any, args: Any, output: Any) -> None:
            if compiling():  # traced: keep the reference only
                trace.compiled = True
                append((index, output, args))
                return
            if index == first[0]:
                refs.clear()
            append((index, output, args))

    else:  # forward_check="off": remember that the module ran, keep no tensor

        def hook(module: Any, args: Any, output: Any) -> None:
            if compiling():
                trace.compiled = True
                append((index, None, None))
                return
            if index == first[0]:
                refs.clear()
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
        self.current: Any = None

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
        # The tensor being differentiated, while its backward runs: a collector whose
        # parameters receive gradients from it takes it as its loss.
        outer = self.current
        self.current = tensors
        try:
            return self.original(tensors, *args, **kwargs)
        finally:
            self.current = outer


BACKWARD_TAP = BackwardTap()


class ScalerTap:
    """Observes ``GradScaler.step`` (``torch.amp``; ``torch.cuda.amp``'s is a subclass) while a
    collector is active: the collector learns the scaler of the step (its loss scale, and that
    the gradients it read were scaled) and whether the optimizer step ran or was skipped for an
    overflow. The call is passed through untouched; the method is restored when the last
    collector leaves."""

    def __init__(self) -> None:
        self.collectors: List[Collector] = []
        self.original: Optional[Callable[..., Any]] = None
        self.cls: Any = None

    def add(self, c: "Collector") -> None:
        if not self.collectors:
            try:
                from torch.amp.grad_scaler import GradScaler
            except ImportError:  # pragma: no cover - very old torch
                return
            self.cls = GradScaler
            self.original = GradScaler.step
            tap = self

            def step(scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
                return tap._step(scaler, optimizer, *args, **kwargs)

            step.__wrapped__ = self.original  # type: ignore[attr-defined]
            GradScaler.step = step  # type: ignore[method-assign, assignment]
        self.collectors.append(c)

    def remove(self, c: "Collector") -> None:
        if c in self.collectors:
            self.collectors.remove(c)
            if not self.collectors and self.cls is not None:
                self.cls.step = self.original
                self.cls = None

    def _step(self, scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        collectors = list(self.collectors)
        for c in collectors:
            try:
                c.on_scaler_step(scaler, optimizer)
            except Exception:  # pragma: no cover - never break the user's step
                pass
        assert self.original is not None
        try:
            out = self.original(scaler, optimizer, *args, **kwargs)
        finally:
            for c in collectors:
                try:
                    c.on_scaler_step_done(scaler, optimizer)
                except Exception:  # pragma: no cover
                    pass
        for c in collectors:
            c.raise_halt()  # halt_on: from the step that confirmed the failure
        return out


_HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
)


class StateTap:
    """While a model is watched, ``nn.Module.__getstate__`` (what ``copy.deepcopy``,
    ``pickle`` and ``torch.save`` read) leaves our forward hooks out of the copied state: the
    copy is a plain module, loadable where NeuralDBG is not installed. Restored when the last
    collector leaves."""

    def __init__(self) -> None:
        self.users: List[Hooks] = []
        self.ours: Set[int] = set()
        self.original: Optional[Callable[..., Any]] = None

    def add(self, hooks: Hooks) -> None:
        if not self.users:
            import torch.nn

            self.original = torch.nn.Module.__getstate__
            original = self.original
            ours = self.ours

            def __getstate__(module: Any) -> Any:
                state = original(module)
                if not ours or not isinstance(state, dict):
                    return state
                for key in _HOOK_DICTS:
                    d = state.get(key)
                    if d and any(k in ours for k in d):
                        state[key] = OrderedDict((k, v) for k, v in d.items() if k not in ours)
                return state

            __getstate__.__wrapped__ = original  # type: ignore[attr-defined]
            torch.nn.Module.__getstate__ = __getstate__  # type: ignore[method-assign]
        self.users.append(hooks)

    def remove(self, hooks: Hooks) -> None:
        if hooks in self.users:
            self.users.remove(hooks)
            if not self.users and self.original is not None:
                import torch.nn

                torch.nn.Module.__getstate__ = self.original  # type: ignore[method-assign]
                self.original = None
                self.ours.clear()


SCALER_TAP = ScalerTap()
STATE_TAP = StateTap()
