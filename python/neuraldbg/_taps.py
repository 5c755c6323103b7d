"""Pass-through wrappers of torch functions, installed while a watched model needs them and
restored when the last leaves: :class:`BackwardTap` (``torch.autograd.backward``: the loss of a
step, and where its backward ends), :class:`ScalerTap` (``GradScaler.step``: a skipped step and
the loss scale), :class:`StateTap` (``nn.Module.__getstate__``: copies of a watched model
carry none of our hooks) and :class:`StepTap` (torch's global optimizer step post hook: the step
boundary).

Models may be watched on several threads at once: a tap is installed and restored under one
process-wide lock (two threads entering together would otherwise each take the other's wrapper
for the original), and the set of those it serves is a tuple replaced whole, so a call on another
thread walks the set it started with.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, List, Optional, Set, Tuple

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector
    from ._hooks import Hooks

_INSTALL = threading.RLock()


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
        self.collectors: Tuple[Collector, ...] = ()
        self.original: Optional[Callable[..., Any]] = None
        self.installed = self._backward  # one bound method, so identity checks work

    def add(self, c: Collector) -> None:
        import torch.autograd

        with _INSTALL:
            if not self.collectors:
                self.original = torch.autograd.backward
                torch.autograd.backward = self.installed  # type: ignore[assignment]
            self.collectors = (*self.collectors, c)

    def remove(self, c: Collector) -> None:
        import torch.autograd

        with _INSTALL:
            if c in self.collectors:
                self.collectors = tuple(k for k in self.collectors if k is not c)
                if not self.collectors and torch.autograd.backward is self.installed:
                    torch.autograd.backward = self.original  # type: ignore[assignment]

    def _backward(self, tensors: Any, *args: Any, **kwargs: Any) -> Any:
        # Collectors that read their gradients here (see Hooks.tap_reads) answer with what
        # their sentinel gradients were before this backward.
        me = threading.get_ident()
        # Models whose forward ran on another thread are not this backward's (two trained at once).
        mine = [c for c in self.collectors if c.thread == me or c.thread is None]
        marks = [c.entry_backward_start(tensors) for c in mine]  # (guarded: never breaks the backward)
        assert self.original is not None
        # The tensor being differentiated, while its backward runs: a collector whose
        # parameters receive gradients from it takes it as its loss (also in an end-of-backward
        # callback that runs on autograd's device thread).
        outer = [c.tap_current for c in mine]
        for c in mine:
            c.tap_current = tensors
        try:
            result = self.original(tensors, *args, **kwargs)
            for c, m in zip(mine, marks):
                if m is not None or c.backward_due:
                    c.entry_backward_done(m)
            return result
        finally:
            for c, o in zip(mine, outer):
                c.tap_current = o


BACKWARD_TAP = BackwardTap()


class ScalerTap:
    """Observes ``GradScaler.step`` (``torch.amp``; ``torch.cuda.amp``'s is a subclass) while a
    collector is active: the collector learns the scaler of the step (its loss scale, and that
    the gradients it read were scaled) and whether the optimizer step ran or was skipped for an
    overflow. The call is passed through untouched; the method is restored when the last
    collector leaves."""

    def __init__(self) -> None:
        self.collectors: Tuple[Collector, ...] = ()
        self.original: Optional[Callable[..., Any]] = None
        self.cls: Any = None

    def add(self, c: Collector) -> None:
        with _INSTALL:
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
            self.collectors = (*self.collectors, c)

    def remove(self, c: Collector) -> None:
        with _INSTALL:
            if c in self.collectors:
                self.collectors = tuple(k for k in self.collectors if k is not c)
                if not self.collectors and self.cls is not None:
                    self.cls.step = self.original
                    self.cls = None

    def _step(self, scaler: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        collectors = self.collectors
        for c in collectors:
            c.entry_scaler_step(scaler, optimizer)
        assert self.original is not None
        try:
            out = self.original(scaler, optimizer, *args, **kwargs)
        finally:
            for c in collectors:
                c.entry_scaler_step_done(scaler, optimizer)
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
        with _INSTALL:
            if not self.users:
                import torch.nn

                self.original = torch.nn.Module.__getstate__
                original = self.original
                ours = self.ours

                def __getstate__(module: Any) -> Any:
                    state = original(module)
                    if not ours or not isinstance(state, dict):
                        return state
                    if is_retrace_mark(state.get("forward")):
                        del state["forward"]
                    for key in _HOOK_DICTS:
                        d = state.get(key)
                        if d and any(k in ours for k in d):
                            state[key] = OrderedDict((k, v) for k, v in d.items() if k not in ours)
                    return state

                __getstate__.__wrapped__ = original  # type: ignore[attr-defined]
                torch.nn.Module.__getstate__ = __getstate__  # type: ignore[method-assign]
            self.users.append(hooks)

    def remove(self, hooks: Hooks) -> None:
        with _INSTALL:
            if hooks in self.users:
                self.users.remove(hooks)
                if not self.users and self.original is not None:
                    import torch.nn

                    torch.nn.Module.__getstate__ = self.original  # type: ignore[method-assign]
                    self.original = None
                    self.ours.clear()


StepCall = Callable[[Any, Any, Any], Any]


class StepTap:
    """Observes every optimizer step of the process through one torch global step post hook
    (``register_optimizer_step_post_hook``), registered when the first caller arrives and
    removed when the last leaves. torch walks its global hooks, an ``OrderedDict``, while an
    optimizer steps: a hook registered or removed then, from another thread, ends that step
    with "OrderedDict mutated during iteration". One hook for every watched model leaves such
    changes to the process's first entry and last exit. ``last`` callers run after the others
    (``neuraldbg run``'s step counter, which stops the script once the watched models have
    observed the step)."""

    def __init__(self) -> None:
        self.first: Tuple[StepCall, ...] = ()
        self.last: Tuple[StepCall, ...] = ()
        self.calls: Tuple[StepCall, ...] = ()
        self.handle: Any = None

    def add(self, call: StepCall, last: bool = False) -> None:
        with _INSTALL:
            if last:
                self.last = (*self.last, call)
            else:
                self.first = (*self.first, call)
            self._arrange()

    def remove(self, call: StepCall) -> None:
        with _INSTALL:
            # (==: a bound method is a new object at each access, equal to the one added)
            self.first = tuple(k for k in self.first if k != call)
            self.last = tuple(k for k in self.last if k != call)
            self._arrange()

    def _arrange(self) -> None:
        self.calls = (*self.first, *self.last)
        if self.calls and self.handle is None:
            from torch.optim.optimizer import register_optimizer_step_post_hook

            self.handle = register_optimizer_step_post_hook(self._stepped)
        elif not self.calls and self.handle is not None:
            self.handle.remove()
            self.handle = None

    def _stepped(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        for call in self.calls:
            call(optimizer, args, kwargs)


def is_retrace_mark(value: Any) -> bool:
    """Whether a module's instance ``forward`` is our retrace mark (``_hooks.retrace_mark``)."""
    return bool(getattr(getattr(value, "__func__", None), "_neuraldbg_mark", False))


SCALER_TAP = ScalerTap()
STATE_TAP = StateTap()
STEP_TAP = StepTap()
