"""What is hooked: every hook NeuralDBG installs on the watched model and in torch, and their
removal. The hooks only call back into the :class:`~neuraldbg._collect.Collector`, which decides
when a step is read.

* a forward pre-hook and a forward hook on the model itself (a forward pass starts and ends;
  the forward hook comes and goes with the module hooks, see :meth:`Hooks.arm_modules`);
* forward hooks on modules, in two sets: first on every module (to learn the forward order),
  then only on those that can *create* a NaN/Inf (:func:`is_passive` says which cannot) and on
  parameter owners; their outputs are kept by reference for the non-finite scan. After the
  first step (when no compilation was seen), modules of the common torch layer classes
  (:data:`RECORDED`: Linear, Conv, norms...) get no hook: their calls are recorded by a wrapper
  of their class's ``forward`` (:class:`CallRecorder`), which leaves them torch's fast call path;
* activation probes: a separate forward hook on each activation module the engine measures
  (for torch's activation classes, :data:`RECORDED_PROBES`, a call recorder entry), armed
  only on the steps whose activation statistics are measured;
* the criterion's forward hook (the loss, when a ``criterion`` is given);
* torch's global optimizer step post hook (the step boundary);
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

import threading
from collections import OrderedDict, deque
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

try:  # the records as single calls into the extension (a Python frame less per layer call)
    from ._native import LayerRecord, SlotRecord
except ImportError:  # pragma: no cover - an extension built without them
    LayerRecord = SlotRecord = None  # type: ignore[assignment,misc]

from ._measure import Summaries

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


# torch.nn classes whose calls are recorded by :class:`CallRecorder` (a wrapper of the class's
# ``forward``) instead of a forward hook: the parameter owners that make up most layers of
# deep models. Exact classes only (a subclass may override ``forward``).
RECORDED = frozenset(
    {
        "Linear", "Bilinear", "Conv1d", "Conv2d", "Conv3d", "ConvTranspose1d", "ConvTranspose2d",
        "ConvTranspose3d", "BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "LayerNorm", "GroupNorm",
        "RMSNorm", "Embedding",
    }
)


# Activation classes whose probes (armed on sampled steps) are recorded the same way: arming
# and disarming a probe is then a dict entry, not a hook registered and removed.
RECORDED_PROBES = frozenset(
    {
        "ReLU", "ReLU6", "LeakyReLU", "PReLU", "ELU", "CELU", "SELU", "GELU", "SiLU", "Mish",
        "Hardswish", "Tanh", "Sigmoid", "Hardtanh", "Hardsigmoid", "Softsign", "Softplus",
        "LogSigmoid", "Tanhshrink", "Softshrink", "Hardshrink", "Threshold",
    }
)


def is_recorded(m: Any, names: "frozenset[str]" = RECORDED) -> bool:
    cls = type(m)
    return cls.__name__ in names and cls.__module__.startswith("torch.nn.modules")


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`CallRecorder` change, made under its lock: models watched on two threads
    arm and disarm records of the same classes."""

    def call(self: "CallRecorder", *args: Any) -> Any:
        with self.lock:
            return method(self, *args)

    call.__doc__ = method.__doc__
    return call


class CallRecorder:
    """Sees the calls of chosen modules of a few torch classes without a forward hook.

    A forward hook sends every call of its module through ``Module._call_impl``'s slow path
    (a few microseconds of Python per call, more on a fast step where that code is out of
    cache): on a deep model it was most of the cost of watching. Instead, while a module of
    such a class is watched, the class's ``forward`` is wrapped once: the module keeps torch's
    fast call path, and the wrapper looks the module up (one dict read) and records ``(index,
    output, args)`` like the hook did. Unwatched modules of the class (other models, copies of
    a watched one) pass straight through. The class's own ``forward`` is put back when its last
    watched module is released. Used only after the first step and only when no compilation
    was seen by then (then forward hooks stay, traced into the graph); in a model compiled
    later, recorded modules record nothing (their NaN/Inf then shows at the next hooked module,
    or in the gradients).
    """

    def __init__(self) -> None:
        # id(module) -> its records, and what the wrapper calls: the record itself when it is
        # alone (the common case), else a callable that calls each in turn.
        self.records: Dict[int, List[Any]] = {}
        self.watched: Dict[int, Any] = {}
        self.count: Dict[type, int] = {}
        # Per wrapped class: its own forward (None when inherited), and our wrapper.
        self.original: Dict[type, Optional[Callable[..., Any]]] = {}
        self.wrappers: Dict[type, Callable[..., Any]] = {}
        # Per wrapped class: the forward the wrapper calls (own or inherited).
        self.calls: Dict[type, Callable[..., Any]] = {}
        # Per class ever wrapped: (its own forward then, the forward called, our wrapper), so
        # that wrapping it again (each sampled step arms and disarms) makes nothing new.
        self.made: Dict[type, Tuple[Optional[Callable[..., Any]], Callable[..., Any], Callable[..., Any]]] = {}
        # How many record changes were made one by one (add, discard, a group that shared a
        # module): a group added the fast way is removed the fast way only if none was since.
        self.mixed = 0
        self.lock = threading.RLock()

    @_locked
    def add(self, module: Any, record: Any) -> "RecorderHandle":
        cls = type(module)
        if cls not in self.wrappers:
            self._wrap(cls)
        self.count[cls] = self.count.get(cls, 0) + 1
        key = id(module)
        # A new list: a group's one-record lists are never changed in place (see add_group).
        self.records[key] = [*self.records.get(key, ()), record]
        self._route(key)
        self.mixed += 1
        return RecorderHandle(self, module, record)

    def _route(self, key: int) -> None:
        records = self.records.get(key)
        if not records:
            self.records.pop(key, None)
            self.watched.pop(key, None)
        elif len(records) == 1:
            self.watched[key] = records[0]
        else:
            calls = tuple(records)

            def all_records(output: Any, args: Any) -> None:
                for record in calls:
                    record(output, args)

            self.watched[key] = all_records

    @_locked
    def add_group(self, group: "RecordGroup | List[Tuple[Any, Any, List[Any]]]") -> "GroupHandle":
        """:meth:`add` for many ``(module, record, [record])`` at once, removed together by
        the handle (arming and disarming a model's layers on sampled steps). The one-record
        list is made once by the caller (a :class:`RecordGroup`, kept for re-use) and is never
        changed in place: on a deep model a new list per layer and sampled step was enough
        garbage to set off the collector's full collections. When none of the group's modules
        has a record already (the common case), the group goes in with two dict updates."""
        if not isinstance(group, RecordGroup):
            group = RecordGroup(group)
        records, watched, count, wrappers = self.records, self.watched, self.count, self.wrappers
        if group.unique and records.keys().isdisjoint(group.keyed):
            records.update(group.lists)
            watched.update(group.keyed)
            for cls, n in group.classes.items():
                if cls not in wrappers:
                    self._wrap(cls)
                count[cls] = count.get(cls, 0) + n
            group.added = self.mixed
            return GroupHandle(self, group)
        for module, record, alone in group.pairs:
            cls = type(module)
            if cls not in wrappers:
                self._wrap(cls)
            count[cls] = count.get(cls, 0) + 1
            key = id(module)
            mine = records.get(key)
            if mine is None:
                records[key] = alone if len(alone) == 1 and alone[0] is record else [record]
                watched[key] = record
            else:
                records[key] = [*mine, record]
                self._route(key)
        self.mixed += 1
        group.added = -1
        return GroupHandle(self, group)

    @_locked
    def discard(self, module: Any, record: Any) -> None:
        key = id(module)
        records = self.records.get(key)
        if records is None or not any(r is record for r in records):
            return
        self.mixed += 1
        rest = [r for r in records if r is not record]
        if rest:
            self.records[key] = rest
            self._route(key)
        else:
            del self.records[key]
            self.watched.pop(key, None)
        cls = type(module)
        self.count[cls] -= 1
        if self.count[cls] == 0:
            self._unwrap(cls)

    @_locked
    def discard_group(self, group: "RecordGroup") -> None:
        """:meth:`discard` of every record of a group."""
        records, watched, count = self.records, self.watched, self.count
        if group.added >= 0 and group.added == self.mixed:
            # Added the fast way and no record was added or removed one by one since: each of
            # its modules still holds just its record (deleted in C: map consumed by a deque).
            deque(map(records.__delitem__, group.keyed), 0)
            deque(map(watched.__delitem__, group.keyed), 0)
            for cls, n in group.classes.items():
                count[cls] -= n
                if count[cls] == 0:
                    self._unwrap(cls)
            group.added = -1
            return
        self.mixed += 1
        for module, record, _ in group.pairs:
            key = id(module)
            mine = records.get(key)
            if mine is None:
                continue
            if len(mine) == 1 and mine[0] is record:
                del records[key]
                watched.pop(key, None)
            elif any(r is record for r in mine):
                records[key] = [r for r in mine if r is not record]
                self._route(key)
            else:
                continue
            cls = type(module)
            count[cls] -= 1
        for cls in [c for c, n in count.items() if n == 0]:
            self._unwrap(cls)
        group.added = -1

    def _unwrap(self, cls: type) -> None:
        """Puts back the class's own ``forward`` (its last watched module is gone)."""
        del self.count[cls]
        original = self.original.pop(cls)
        self.calls.pop(cls, None)
        if cls.__dict__.get("forward") is self.wrappers.pop(cls):
            if original is None:  # inherited (BatchNorm2d from _BatchNorm)
                delattr(cls, "forward")
            else:
                cls.forward = original  # type: ignore[attr-defined]

    def _wrap(self, cls: type) -> None:
        own = cls.__dict__.get("forward")
        made = self.made.get(cls)
        if made is not None and made[0] is own and (own is not None or cls.forward is made[1]):  # type: ignore[attr-defined]
            self.original[cls], self.calls[cls], self.wrappers[cls] = made
            cls.forward = made[2]  # type: ignore[attr-defined]
            return
        import functools

        import torch

        call = own if own is not None else cls.forward  # type: ignore[attr-defined]
        watched = self.watched
        compiling = torch.compiler.is_compiling

        @functools.wraps(call)
        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            output = call(module, *args, **kwargs)
            if compiling():  # traced: read nothing of ours (it would become a guard)
                return output
            record = watched.get(id(module))
            if record is not None:
                record(output, args)
            return output

        self.original[cls] = own
        self.wrappers[cls] = forward
        self.calls[cls] = call
        self.made[cls] = (own, call, forward)
        cls.forward = forward  # type: ignore[attr-defined]

    def is_watched(self, module: Any) -> bool:
        return id(module) in self.watched

    def recompute(self, module: Any, args: Any) -> Any:
        """The output of a recorded module's call on ``args`` (its class's own ``forward``, no
        grad, nothing recorded), leaving the module's buffers (BatchNorm's running statistics)
        untouched. None when it cannot be computed."""
        import torch

        cls = type(module)
        if not is_recorded(module) or not isinstance(args, tuple):
            return None
        if getattr(module, "max_norm", None) is not None:
            return None  # an Embedding that renormalizes its weight in place when called
        forward = self.calls.get(cls) or cls.forward  # type: ignore[attr-defined]
        buffers = module._buffers
        saved = dict(buffers)
        try:
            with torch.no_grad():
                # The call works on copies of the buffers: the module's own are not written
                # (autograd may have saved them: writing would bump their version).
                for name, b in saved.items():
                    if b is not None:
                        buffers[name] = b.clone()
                return forward(module, *args)
        except Exception:
            return None
        finally:
            buffers.update(saved)


class RecordGroup:
    """``(module, record, [record])`` triples armed and disarmed together, with what adding
    them at once needs: the records and one-record lists by module key, and the number of
    modules per class."""

    __slots__ = ("pairs", "keyed", "lists", "classes", "unique", "added")

    def __init__(self, pairs: List[Tuple[Any, Any, List[Any]]]) -> None:
        self.pairs = pairs
        self.keyed = {id(m): record for m, record, _ in pairs}
        self.lists = {id(m): alone if len(alone) == 1 and alone[0] is record else [record] for m, record, alone in pairs}
        classes: Dict[type, int] = {}
        for m, _, _ in pairs:
            classes[type(m)] = classes.get(type(m), 0) + 1
        self.classes = classes
        self.unique = len(self.keyed) == len(pairs)
        # The recorder's `mixed` count when added the fast way, else -1.
        self.added = -1

    def __bool__(self) -> bool:
        return bool(self.pairs)


class GroupHandle:
    """Removes the records of :meth:`CallRecorder.add_group`."""

    __slots__ = ("recorder", "group")

    def __init__(self, recorder: CallRecorder, group: RecordGroup) -> None:
        self.recorder = recorder
        self.group: Optional[RecordGroup] = group

    def remove(self) -> None:
        if self.group is not None:
            self.recorder.discard_group(self.group)
            self.group = None


class RecorderHandle:
    """Removes one module's record from the :class:`CallRecorder` (like a hook's handle)."""

    __slots__ = ("recorder", "module", "record")

    def __init__(self, recorder: CallRecorder, module: Any, record: Any) -> None:
        self.recorder = recorder
        self.module = module
        self.record = record

    def remove(self) -> None:
        self.recorder.discard(self.module, self.record)


CALL_RECORDER = CallRecorder()


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
        # The model's own forward hook (Collector._on_root_post), hooked as module 0.
        self.root_post: Any = None

    @property
    def frozen(self) -> bool:
        """Hooks traced into a compiled graph must stay: removing one recompiles."""
        return self.trace.compiled

    def install(self, c: "Collector", params: List[Any]) -> None:
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
        self.hook_grads(c, params)
        from torch.optim.optimizer import register_optimizer_step_post_hook

        self.handles.append(register_optimizer_step_post_hook(c.entry_optimizer_step))
        SCALER_TAP.add(c)
        STATE_TAP.add(self)
        if c.criterion is None:
            BACKWARD_TAP.add(c)

    def hook_grads(self, c: "Collector", params: List[Any]) -> bool:
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

    def _hook_sentinels(self, c: "Collector", params: List[Any]) -> None:
        for h in self.grad_handles.values():
            h.remove()
        self.grad_handles = {k: params[k].register_post_accumulate_grad_hook(_grad_hook(c, k)) for k in self.sentinels}

    def read_at_tap(self, c: "Collector", params: List[Any], on: bool) -> None:
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

    def rehook(self, owners: "set[int]") -> None:
        """After the first step: keep hooks only on modules that can create a non-finite value
        (and on parameter owners, whose running tells "no gradient" from a zero gradient)."""
        if self.frozen:
            return
        self.wanted = [
            i for i in range(1, len(self.modules))
            if (i in owners or not is_passive(self.modules[i])) and i not in self.unhookable
        ]
        self.recorded_pairs = None
        for i in list(self.module_handles):
            self.module_handles.pop(i).remove()
        self.modules_armed = False
        self.arm_modules(True)

    def arm_modules(self, on: bool) -> None:
        """Puts the hooks and records of the wanted modules in place, or takes them away (the
        steps that need nothing per module; see ``Collector._modules_wanted``). Hooks traced
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

    def remove(self, c: "Collector") -> None:
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


def _grad_hook(c: "Collector", k: int) -> Callable[[Any], None]:
    """The post-accumulate-grad hook of parameter ``k``."""

    ready = c.entry_grad_ready

    def hook(param: Any) -> None:
        ready(k)

    return hook


def make_ref_hook(
    index: int, refs: List[Any], keep: bool, trace: Trace, first: List[int], hold: List[Any],
    summaries: Any = None, keep_traced: bool = True,
) -> Callable[..., None]:
    """A module's forward hook: keeps ``(index, output, args)`` for the non-finite scan, or,
    when ``hold[0]`` is the device path's :class:`~neuraldbg._measure.Summaries`, has the call
    summarized (no tensor kept). Traced into a compiled graph it reads nothing of ours:
    ``summaries`` (given on the device path) and ``keep_traced`` (keep the output: an
    activation module, whose output its probe measures) decide there, once."""
    compiling = _compiling()
    append = refs.append
    if keep:

        def hook(module: Any, args: Any, output: Any) -> None:
            if compiling():  # traced: keep the reference only
                trace.compiled = True
                if summaries is None:
                    append((index, output, args))
                else:
                    append((index, output if keep_traced else None, None))
                    summaries(index, output, args)
                return
            if index == first[0]:
                refs.clear()
            h = hold[0]
            if h.__class__ is Summaries:
                append((index, None, None))
                h(index, output, args)
                return
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


def make_record(index: int, refs: List[Any], keep: bool, first: List[int], hold: List[Any]) -> Any:
    """What :class:`CallRecorder` does with a recorded module's ``(output, args)``: the
    untraced path of :func:`make_ref_hook`, a callable ``record(output, args)``: keeping
    references, the extension's ``LayerRecord`` (one call, no Python frame per layer; without
    the extension the same in Python). ``hold[0]`` says what a call keeps: True its output
    and inputs; False its inputs only (autograd keeps them alive anyway; holding every layer's
    output makes each forward pass allocate fresh memory, about 3 us a layer on a deep CPU
    model), so that a step that went non-finite computes the output again
    (:meth:`CallRecorder.recompute`) while the parameters are still the forward's; None no
    tensor at all (host mode: such a step is replayed instead, see
    ``WatchedModel.replay``), and a callable the same, after handing it ``(index, output)`` to
    measure now (a sampled step's output maxima, the extension's ``OutputMaxima``: nothing
    the garbage collector has to walk is kept per layer, and no Python frame of ours runs)."""
    if keep and LayerRecord is not None:
        return LayerRecord(index, refs, first, hold)
    append = refs.append
    if not keep:

        def record(output: Any, args: Any) -> None:  # forward_check="off": that it ran, no tensor
            if index == first[0]:
                refs.clear()
            append((index, None, None))

        return record

    def call(output: Any, args: Any) -> None:  # pragma: no cover - LayerRecord, in Python
        if index == first[0]:
            refs.clear()
        h = hold[0]
        if h is True or h is False:
            refs.append((index, output if h else None, args))
        else:
            refs.append((index, None, None))
            if h is not None:
                h(index, output, args)

    return call


def make_slot_record(row: int, slots: List[Any]) -> Callable[[Any, Any], None]:
    if SlotRecord is not None:
        return SlotRecord(row, slots)  # type: ignore[no-any-return]

    def record(output: Any, args: Any) -> None:
        slots[row] = output

    return record


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
