"""Module calls seen without a forward hook: a wrapper of the ``forward`` of a few torch layer
classes (:class:`CallRecorder`) records the calls of the watched modules of those classes, which
keep torch's fast call path (a module with a forward hook leaves it), and the records
themselves (:func:`make_record`, :func:`make_slot_record`: the extension's ``LayerRecord`` and
``SlotRecord``, one call into Rust per layer call).
"""

from __future__ import annotations

import threading
from collections import deque
from typing import Any, Callable, Dict, List, Optional, Tuple

from ._native import LayerRecord, SlotRecord

# torch.nn classes whose calls are recorded by :class:`CallRecorder` (a wrapper of the class's
# ``forward``) instead of a forward hook: the parameter owners that make up most layers of
# deep models. Exact classes only (a subclass may override ``forward``).
RECORDED = frozenset(
    {
        "Linear",
        "Bilinear",
        "Conv1d",
        "Conv2d",
        "Conv3d",
        "ConvTranspose1d",
        "ConvTranspose2d",
        "ConvTranspose3d",
        "BatchNorm1d",
        "BatchNorm2d",
        "BatchNorm3d",
        "LayerNorm",
        "GroupNorm",
        "RMSNorm",
        "Embedding",
    }
)


# Activation classes whose probes (armed on sampled steps) are recorded the same way: arming
# and disarming a probe is then a dict entry, not a hook registered and removed.
RECORDED_PROBES = frozenset(
    {
        "ReLU",
        "ReLU6",
        "LeakyReLU",
        "PReLU",
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
        "Softplus",
        "LogSigmoid",
        "Tanhshrink",
        "Softshrink",
        "Hardshrink",
        "Threshold",
    }
)


def is_recorded(m: Any, names: frozenset[str] = RECORDED) -> bool:
    cls = type(m)
    return cls.__name__ in names and cls.__module__.startswith("torch.nn.modules")


def _locked(method: Callable[..., Any]) -> Callable[..., Any]:
    """A :class:`CallRecorder` change, made under its lock: models watched on two threads
    arm and disarm records of the same classes."""

    def call(self: CallRecorder, *args: Any) -> Any:
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
    def add(self, module: Any, record: Any) -> RecorderHandle:
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
    def add_group(self, group: RecordGroup | List[Tuple[Any, Any, List[Any]]]) -> GroupHandle:
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
    def discard_group(self, group: RecordGroup) -> None:
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

    __slots__ = ("added", "classes", "keyed", "lists", "pairs", "unique")

    def __init__(self, pairs: List[Tuple[Any, Any, List[Any]]]) -> None:
        self.pairs = pairs
        self.keyed = {id(m): record for m, record, _ in pairs}
        self.lists = {
            id(m): alone if len(alone) == 1 and alone[0] is record else [record] for m, record, alone in pairs
        }
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

    __slots__ = ("group", "recorder")

    def __init__(self, recorder: CallRecorder, group: RecordGroup) -> None:
        self.recorder = recorder
        self.group: Optional[RecordGroup] = group

    def remove(self) -> None:
        if self.group is not None:
            self.recorder.discard_group(self.group)
            self.group = None


class RecorderHandle:
    """Removes one module's record from the :class:`CallRecorder` (like a hook's handle)."""

    __slots__ = ("module", "record", "recorder")

    def __init__(self, recorder: CallRecorder, module: Any, record: Any) -> None:
        self.recorder = recorder
        self.module = module
        self.record = record

    def remove(self) -> None:
        self.recorder.discard(self.module, self.record)


CALL_RECORDER = CallRecorder()


def make_record(index: int, refs: List[Any], keep: bool, first: List[int], hold: List[Any]) -> Any:
    """What :class:`CallRecorder` does with a recorded module's ``(output, args)``: the
    untraced path of :func:`make_ref_hook`, a callable ``record(output, args)``: keeping
    references, the extension's ``LayerRecord`` (one call, no Python frame per layer). ``hold[0]`` says what a call keeps: True its output
    and inputs; False its inputs only (autograd keeps them alive anyway; holding every layer's
    output makes each forward pass allocate fresh memory, about 3 us a layer on a deep CPU
    model), so that a step that went non-finite computes the output again
    (:meth:`CallRecorder.recompute`) while the parameters are still the forward's; None no
    tensor at all (host mode: such a step is replayed instead, see
    ``WatchedModel.replay``), and a callable the same, after handing it ``(index, output)`` to
    measure now (a sampled step's output maxima, the extension's ``OutputMaxima``: nothing
    the garbage collector has to walk is kept per layer, and no Python frame of ours runs)."""
    if keep:
        return LayerRecord(index, refs, first, hold)
    append = refs.append

    def record(output: Any, args: Any) -> None:  # forward_check="off": that it ran, no tensor
        if index == first[0]:
            refs.clear()
        append((index, None, None))

    return record


def make_slot_record(row: int, slots: List[Any]) -> Callable[[Any, Any], None]:
    return SlotRecord(row, slots)  # type: ignore[no-any-return]
