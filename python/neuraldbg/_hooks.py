"""What is hooked: every hook NeuralDBG installs on the watched model and in torch, and their
removal. The hooks only call back into the :class:`~neuraldbg._collect.Collector`, which decides
when a step is read.

* a forward pre-hook and a forward hook on the model itself (a forward pass starts and ends;
  the forward hook comes and goes with the module hooks, see :meth:`Hooks.arm_modules`);
* forward hooks on modules, in two sets: first on every module (to learn the forward order),
  then only on those that can *create* a NaN/Inf (:func:`is_passive` says which cannot) and on
  parameter owners; their outputs are kept by reference for the non-finite scan. After the
  first step (when no compilation was seen), modules of the common torch layer classes
  (``_record.RECORDED``: Linear, Conv, norms...) get no hook: their calls are recorded by a wrapper
  of their class's ``forward`` (``_record.CallRecorder``), which leaves them torch's fast call path;
* activation probes: a separate forward hook on each activation module the engine measures
  (for torch's activation classes, ``_record.RECORDED_PROBES``, a call recorder entry), armed
  only on the steps whose activation statistics are measured;
* the criterion's forward hook (the loss, when a ``criterion`` is given);
* torch's global optimizer step post hook (the step boundary), one for every watched model
  (``_taps.StepTap``);
* the end of each backward pass that gave the model gradients is where they are read (before
  any clipping or unscaling). On a CPU model whose loss the backward tap takes (no criterion
  given), that is when ``torch.autograd.backward`` returns, and the backward gave the model
  gradients when it changed a sentinel's gradient (``Hooks.tap_reads``: no hook fires inside
  the backward). Otherwise through post-accumulate-grad hooks: two sentinel parameters are hooked,
  the first and the last trainable one (in the model's order: usually the first to get its
  gradient and the last), never every parameter: a parameter that ever had such a hook keeps
  torch's C++ shim for it, which takes the GIL and walks an empty dict on every backward even
  after the hook is removed (+1.2-2 ms a backward on a 1,024-layer MLP, for good). When a
  step's gradients arrived without a sentinel firing (a sentinel frozen later), the step is
  read at the optimizer step and two new sentinels are chosen among the parameters that have
  a gradient (:meth:`Hooks.hook_grads`). Read at the tap, a step whose sentinels did get
  gradients the tap did not see (``torch.autograd.backward`` called under a name taken before
  NeuralDBG was entered) has the sentinels hooked from then on;
* ``_taps.BackwardTap``, a pass-through wrapper of ``torch.autograd.backward`` that picks up
  the loss when no criterion is given;
* ``_taps.ScalerTap``, a pass-through wrapper of ``GradScaler.step``: which optimizer step a
  scaler skipped, and the loss scale;
* ``_taps.StateTap``: ``nn.Module.__getstate__`` leaves our hooks out, so ``copy.deepcopy``,
  ``pickle`` and ``torch.save`` of a watched model work and the copy carries none of them.

Under ``torch.compile`` the forward hooks are traced into the compiled graph: there they only
keep references (no reads of the collector's state, which would become guards and recompile),
and the hook set is frozen once compilation is seen (removing a traced hook recompiles). What a
traced hook closes over is reached by attribute, never held as a bound method: dynamo guards a
bound method by its identity, new for every collector, so each watched model compiled its own
graph and, the old ones dead but still counted, the eighth watched model of a process sent every
compiled module to eager. Dynamo does not guard module hooks themselves
(``skip_nnmodule_hook_guards``): a graph compiled before the model was watched would run on
without them, so while watched the model (and any compiled submodule) carries :func:`retrace_mark`.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from ._measure import Summaries
from ._record import CALL_RECORDER, RECORDED_PROBES, RecordGroup, is_recorded, make_record, make_slot_record
from ._taps import BACKWARD_TAP, SCALER_TAP, STATE_TAP, STEP_TAP, is_retrace_mark

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector

# torch.nn classes whose output is finite whenever their input is (element-wise functions,
# max-pooling, dropout, reshapes) or is a child's output (nn.Sequential): they can never be
# where a NaN/Inf is created, so they need no hook for the non-finite scan. Exact classes only:
# a user subclass may add its own computation.
PASSIVE = frozenset(
    {
        "Sequential",
        "Identity",
        "Flatten",
        "Unflatten",
        "ReLU",
        "ReLU6",
        "LeakyReLU",
        "ELU",
        "CELU",
        "SELU",
        "GELU",
        "SiLU",
        "Mish",
        "Hardswish",
        "Tanh",
        "Sigmoid",
        "Hardtanh",
        "Hardsigmoid",
        "Softsign",
        "Tanhshrink",
        "Softshrink",
        "Hardshrink",
        "Dropout",
        "Dropout1d",
        "Dropout2d",
        "Dropout3d",
        "AlphaDropout",
        "FeatureAlphaDropout",
        "MaxPool1d",
        "MaxPool2d",
        "MaxPool3d",
        "AdaptiveMaxPool1d",
        "AdaptiveMaxPool2d",
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

    def __init__(
        self, modules: List[Any], refs: List[Any], keep_outputs: bool, unhookable: Set[int], summaries: Any = None
    ) -> None:
        self.modules = modules
        # The device path's summaries of module calls, for hooks traced into a compiled graph
        # (None on the host path; see make_ref_hook).
        self.summaries = summaries
        # Modules that take no forward hook (TorchScript ones): watched from around.
        self.unhookable = unhookable
        self.refs = refs
        self.keep_outputs = keep_outputs
        self.trace = Trace()
        # Index of the module that completes first in a forward pass (known after the first
        # step): its call starts a new forward, so the previous forward's outputs are let go
        # even when the model itself is not what the loop calls (a LightningModule whose
        # training_step calls a submodule).
        self.first = [-1]
        # What recorded modules keep this step (see :func:`make_record`).
        self.hold: List[Any] = [True]
        self.handles: List[Any] = []
        # Forward hooks on modules: index -> handle. Activation probes have their own.
        self.module_handles: Dict[int, Any] = {}
        self.probe_handles: List[Any] = []
        self.probes_armed = False
        # The two sentinels (parameter indices), and their post-accumulate-grad hooks:
        # parameter index -> handle. With `tap_reads` they have none: the backward tap reads
        # the gradients when ``torch.autograd.backward`` returns, and a sentinel whose gradient
        # changed in it says the backward reached the model (four entries into Python a step
        # fewer: two sentinels, the queued end-of-backward callback, the loop facts' probe).
        self.sentinels: List[int] = []
        self.grad_handles: Dict[int, Any] = {}
        self.tap_reads = False
        # The modules whose calls are seen after the first step (see :meth:`rehook`), and
        # whether their hooks and records are in place now (:meth:`arm_modules`).
        self.wanted: List[int] = []
        self.modules_armed = True
        # The (module, record) pairs armed together (made once), and the probes' likewise.
        self.recorded_pairs: Optional[RecordGroup] = None
        self.hooked_wanted: List[int] = []
        self.probe_pairs: Optional[RecordGroup] = None
        self.probe_hooked: List[Tuple[int, Any]] = []
        # The model's own forward hook (Collector.on_forward_post), hooked as module 0.
        self.root_post: Any = None
        # Modules given a retrace mark (see retrace_mark), taken off by remove().
        self.marked: List[Any] = []
        # The pre-hooks of the modules that read their input's first dimension as the sequence,
        # and the forward hooks of the recurrent ones.
        self.sequence_handles: List[Any] = []

    @property
    def frozen(self) -> bool:
        """Hooks traced into a compiled graph must stay: removing one recompiles."""
        return self.trace.compiled

    def install(self, c: Collector, params: List[Any]) -> None:
        from torch.nn.modules.rnn import RNNBase

        # Until the first step is observed every module is hooked, to learn the forward order.
        for i in range(1, len(self.modules)):
            self.hook_module(i, keep=True)
        root = self.modules[0]
        self._own(root.register_forward_pre_hook(c.entry_forward_pre, with_kwargs=True))
        # The model's own forward hook goes with the module hooks (see arm_modules): a step
        # that sees no module call needs no end of the forward either.
        self.root_post = c.entry_forward_post
        self._hook_root_post()
        if c.criterion is not None:
            self._own(c.criterion.register_forward_hook(c.entry_criterion))
        # Modules that read their input's first dimension as the sequence: the shape they
        # are given (a fact for the engine's batch_axis_mismatch), until registration.
        self.sequence_handles = [
            self._own(m.register_forward_pre_hook(c.loop.sequence_first_hook(c.watched.names[i])))
            for i, m in enumerate(self.modules)
            if i > 0 and getattr(m, "batch_first", None) is False
        ]
        # Recurrent modules: their first output's autograd nodes (which of its steps the
        # model reads: a fact for the engine's sequence_start_readout), until registration.
        self.sequence_handles += [
            self._own(m.register_forward_hook(c.loop.recurrent_hook(c.watched.names[i])))
            for i, m in enumerate(self.modules)
            if i > 0 and isinstance(m, RNNBase)
        ]
        self.hook_grads(c, params)
        STEP_TAP.add(c.entry_optimizer_step)
        SCALER_TAP.add(c)
        STATE_TAP.add(self)
        self.marked = [m for m in _compiled_entries(self.modules) if retrace_mark(m)]
        if c.criterion is None:
            BACKWARD_TAP.add(c)

    def unhook_sequences(self) -> None:
        """The first step's shapes and outputs are read: the sequence modules' hooks go (not
        from a compiled graph, where removing a hook recompiles it)."""
        if not self.frozen:
            for h in self.sequence_handles:
                h.remove()
        self.sequence_handles = []

    def hook_grads(self, c: Collector, params: List[Any]) -> bool:
        """Chooses two sentinels, the first and the last trainable parameter that has a
        gradient now (at install, when none has: the first and the last trainable one), and
        hooks their gradient accumulation (not with ``tap_reads``). False, changing nothing,
        when those are the sentinels already."""
        # (A frozen one takes no hook, nor does a lazy module's parameter before it is made.)
        trainable = [k for k, p in enumerate(params) if p.requires_grad and not _uninitialized(p)]
        present = [k for k in trainable if params[k].grad is not None]
        pool = present or trainable
        keep = sorted({pool[0], pool[-1]}) if pool else []
        if keep == self.sentinels:
            return False
        self.sentinels = keep
        if not self.tap_reads:
            self._hook_sentinels(c, params)
        return True

    def _hook_sentinels(self, c: Collector, params: List[Any]) -> None:
        for h in self.grad_handles.values():
            h.remove()
        self.grad_handles = {k: params[k].register_post_accumulate_grad_hook(_grad_hook(c, k)) for k in self.sentinels}

    def read_at_tap(self, c: Collector, params: List[Any], on: bool) -> None:
        """Gradients read by the backward tap (``on``), or at the end of each backward pass
        through the sentinels' hooks again (a backward the tap did not see gave the model
        gradients: ``torch.autograd.backward`` was called under another name)."""
        if on == self.tap_reads:
            return
        self.tap_reads = on
        if on:
            for h in self.grad_handles.values():
                h.remove()
            self.grad_handles = {}
        else:
            self._hook_sentinels(c, params)

    def _own(self, handle: Any) -> Any:
        STATE_TAP.ours.add(handle.id)
        self.handles.append(handle)
        return handle

    def _hook_root_post(self) -> None:
        """The model's own forward hook, kept with the module hooks as module 0."""
        h = self.modules[0].register_forward_hook(self.root_post)
        STATE_TAP.ours.add(h.id)
        self.module_handles[0] = h

    def hook_module(self, i: int, keep: bool, record: bool = False) -> None:
        if i in self.unhookable:
            return
        m = self.modules[i]
        if record and is_recorded(m):
            self.module_handles[i] = CALL_RECORDER.add(m, make_record(i, self.refs, keep, self.first, self.hold))
            return
        hook = make_ref_hook(
            i, self.refs, keep, self.trace, self.first, self.hold, self.summaries, is_recorded(m, RECORDED_PROBES)
        )
        try:
            h = self.modules[i].register_forward_hook(hook)
        except Exception:  # a module that refuses hooks (a user's ScriptModule-like class)
            self.unhookable.add(i)
            return
        STATE_TAP.ours.add(h.id)
        self.module_handles[i] = h

    def rehook(self, owners: set[int]) -> None:
        """After the first step: keep hooks only on modules that can create a non-finite value
        (and on parameter owners, whose running tells "no gradient" from a zero gradient)."""
        if self.frozen:
            return
        self.wanted = [
            i
            for i in range(1, len(self.modules))
            if (i in owners or not is_passive(self.modules[i])) and i not in self.unhookable
        ]
        self.recorded_pairs = None
        for i in list(self.module_handles):
            self.module_handles.pop(i).remove()
        self.modules_armed = False
        self.arm_modules(True)

    def arm_modules(self, on: bool) -> None:
        """Puts the hooks and records of the wanted modules in place, or takes them away (the
        steps that need nothing per module; see ``StepBoundary.modules_wanted``). Hooks traced
        into a compiled graph stay."""
        if on == self.modules_armed or self.frozen:
            return
        if on:
            record = not self.trace.compiled
            group = self.recorded_pairs
            if group is None or not record:
                pairs = []
                self.hooked_wanted = []
                for i in self.wanted:
                    m = self.modules[i]
                    if record and is_recorded(m):
                        rec = make_record(i, self.refs, self.keep_outputs, self.first, self.hold)
                        pairs.append((m, rec, [rec]))
                    else:
                        self.hooked_wanted.append(i)
                group = RecordGroup(pairs)
                if record:
                    self.recorded_pairs = group
            self._hook_root_post()
            for i in self.hooked_wanted:
                self.hook_module(i, keep=self.keep_outputs)
            if group:
                self.module_handles[-1] = CALL_RECORDER.add_group(group)
        else:
            for h in self.module_handles.values():
                h.remove()
            self.module_handles.clear()
        self.modules_armed = on

    def arm_probes(self, on: bool, probe_modules: Sequence[Any], slots: List[Any]) -> None:
        """Activation probes (objects with ``row`` and ``module``, the module's index) are
        hooked only on steps whose activations are measured; each writes its module's output
        into ``slots[row]``."""
        if on == self.probes_armed or not probe_modules or self.frozen:
            return
        if on:
            record = not self.trace.compiled
            group = self.probe_pairs
            if group is None or not record:
                pairs = []
                self.probe_hooked = []
                for p in probe_modules:
                    row, module = p.row, p.module
                    m = self.modules[module]
                    if record and is_recorded(m, RECORDED_PROBES):
                        rec = make_slot_record(row, slots)
                        pairs.append((m, rec, [rec]))
                    else:
                        self.probe_hooked.append((row, m))
                group = RecordGroup(pairs)
                if record:
                    self.probe_pairs = group
            for row, m in self.probe_hooked:
                h = m.register_forward_hook(make_slot_hook(row, slots))
                STATE_TAP.ours.add(h.id)
                self.probe_handles.append(h)
            if group:
                self.probe_handles.append(CALL_RECORDER.add_group(group))
        else:
            for h in self.probe_handles:
                h.remove()
            self.probe_handles.clear()
        self.probes_armed = on

    def remove(self, c: Collector) -> None:
        hooks = [*self.handles, *self.module_handles.values(), *self.probe_handles, *self.grad_handles.values()]
        self.grad_handles.clear()
        for h in hooks:
            try:
                h.remove()
            except Exception:  # pragma: no cover - removal must never raise into the user's code
                pass
        self.handles.clear()
        self.module_handles.clear()
        self.probe_handles.clear()
        self.probes_armed = False
        for m in self.marked:
            retrace_unmark(m)
        self.marked = []
        STEP_TAP.remove(c.entry_optimizer_step)
        BACKWARD_TAP.remove(c)
        SCALER_TAP.remove(c)
        STATE_TAP.remove(self)


def _uninitialized(p: Any) -> bool:
    """A lazy module's parameter that has no shape yet (it gets one at the first forward)."""
    from torch.nn.parameter import UninitializedParameter

    return isinstance(p, UninitializedParameter)


def _compiling() -> Callable[[], bool]:
    import torch

    return torch.compiler.is_compiling


def _grad_hook(c: Collector, k: int) -> Callable[[Any], None]:
    """The post-accumulate-grad hook of parameter ``k``."""

    ready = c.entry_grad_ready

    def hook(param: Any) -> None:
        ready(k)

    return hook


def make_ref_hook(
    index: int,
    refs: List[Any],
    keep: bool,
    trace: Trace,
    first: List[int],
    hold: List[Any],
    summaries: Any = None,
    keep_traced: bool = True,
) -> Callable[..., None]:
    """A module's forward hook: keeps ``(index, output, args)`` for the non-finite scan, or,
    when ``hold[0]`` is the device path's :class:`~neuraldbg._measure.Summaries`, has the call
    summarized (no tensor kept). Traced into a compiled graph it reads nothing of ours:
    ``summaries`` (given on the device path) and ``keep_traced`` (keep the output: an
    activation module, whose output its probe measures) decide there, once."""
    compiling = _compiling()
    if keep:

        def hook(module: Any, args: Any, output: Any) -> None:
            if compiling():  # traced: keep the reference only
                trace.compiled = True
                if summaries is None:
                    refs.append((index, output, args))
                else:
                    refs.append((index, output if keep_traced else None, None))
                    summaries(index, output, args)
                return
            if index == first[0]:
                refs.clear()
            h = hold[0]
            if h.__class__ is Summaries:
                refs.append((index, None, None))
                h(index, output, args)
                return
            refs.append((index, output, args))

    else:  # forward_check="off": remember that the module ran, keep no tensor

        def hook(module: Any, args: Any, output: Any) -> None:
            if compiling():
                trace.compiled = True
                refs.append((index, None, None))
                return
            if index == first[0]:
                refs.clear()
            refs.append((index, None, None))

    return hook


def make_slot_hook(row: int, slots: List[Any]) -> Callable[..., None]:
    def hook(module: Any, args: Any, output: Any) -> None:
        slots[row] = output

    return hook


def _compiled_entries(modules: Sequence[Any]) -> List[Any]:
    """Where a compiled graph can begin among the watched modules: the model itself, a
    ``torch.compile``'d submodule's inner module, a submodule compiled in place. None while
    nothing was compiled in this process (dynamo never imported)."""
    if "torch._dynamo" not in sys.modules or not modules:
        return []
    entries = [modules[0]]
    for m in modules[1:]:
        inner = getattr(m, "_orig_mod", None)
        if inner is not None and type(m).__name__ == "OptimizedModule":
            entries.append(inner)
        elif getattr(m, "_compiled_call_impl", None) is not None:
            entries.append(m)
    return entries


_MARKS: Dict[type, Callable[..., Any]] = {}


def retrace_mark(module: Any) -> bool:
    """Gives ``module`` an instance ``forward`` that calls its class's: a graph dynamo compiled
    before the module was watched guards that the instance has none, so the next compiled call
    traces again, with our hooks (one graph for every watched model of the class: the mark is
    one function per class). Taken off by :func:`retrace_unmark`; copies do not carry it
    (``_taps.StateTap``). A module with a ``forward`` of its own in ``__dict__`` is left alone."""
    if "forward" in module.__dict__:
        return False
    cls = type(module)
    if cls not in _MARKS:

        @functools.wraps(cls.forward)
        def mark(self: Any, *args: Any, **kwargs: Any) -> Any:
            return type(self).forward(self, *args, **kwargs)

        mark._neuraldbg_mark = True  # type: ignore[attr-defined]
        _MARKS[cls] = mark
    module.__dict__["forward"] = _MARKS[cls].__get__(module, cls)
    return True


def retrace_unmark(module: Any) -> None:
    if is_retrace_mark(module.__dict__.get("forward")):
        del module.__dict__["forward"]
