"""When a step is read: the collector's state machine over one training run.

The hooks (:mod:`._hooks`: what is hooked) call back here; this module decides when a forward
pass starts and ends, which backward is this model's loss, where one optimizer step ends and the
next begins, and then has the step measured (:mod:`._measure`: what is measured), moved to the
host in one transfer (:mod:`._transfer`) and handed to the engine. The model's structure and
the non-finite origin search live in :mod:`._model`. This module decides nothing about health.

Per step (at the first ``optimizer.step()`` after a forward pass):

* gradient L2 norm of every trainable parameter;
* on sampled steps, parameter norms and the activation statistics the engine asks for;
* per forward pass, ``min, max, mean, std`` of the model's first floating-point input;
* the loss (given, or picked up from ``loss.backward()``).

On a GPU (or under torch.distributed) all of it is concatenated on the device into one float32
vector and moved to the host once (:meth:`Collector._observe_inner` builds it: the one place a
step's vector is assembled); on CUDA the step is handed to the engine when the next forward
pass starts (or at exit, or when results are read), so nothing in the step ever blocks the GPU. On a
CPU model (host mode, :meth:`Collector._observe_host`) the extension reads every statistic from
the tensors' memory straight into the engine's host arrays: no torch operation, no vector.

Forward hooks are installed only where they are needed. The first forward pass hooks every
module, once, to learn the execution order. After that, module outputs are kept (by reference,
until the step is observed) only for modules that can *create* a NaN/Inf. Activation modules
get a second, separate hook only on the steps whose activation statistics are measured. In host
mode the module hooks and records themselves are there only on the steps that need them
(:meth:`Collector._modules_wanted`): an unmeasured step sees only the model's own calls. Such
a step, on a CPU model whose loss and gradients are read at the backward tap, is observed by
the extension's ``PlainStep`` (:meth:`Collector._make_plain`): the hooks hand it the forward,
the loss's backward and the optimizer step, and this module's state is only told of the step
(:meth:`Collector._plain_done`), or handed what it saw when the step turns out not to be a
plain one.

Only when a step's gradients or loss are not finite are the kept outputs scanned (in forward
order) for the first module whose output went non-finite: two transfers on such a failure step,
none on a healthy one, and the origin is still named on the very step it happens. A host step
that kept no module call has its forward computed again for that (:meth:`Collector._scan`).
"""

from __future__ import annotations

import json
import math
import operator
import warnings
from threading import get_ident as _thread_id
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Tuple

import numpy as np

from ._distributed import PeerLeft, has_shards, local_tensors
from ._guard import REPORT, guarded
from ._hooks import BACKWARD_TAP, Hooks, reaches
from ._loop import LoopFacts, grad_changed
from ._measure import HostMeasurer, Measurer, Probe, Summaries, first_float_tensor, input_stats, read_summaries
from ._model import WatchedModel
from ._transfer import HostCopy, HostStep, Layout, Pending, Unpacked, clip_ratio, flatten
from .errors import NeuralDbgWarning

# Whether dynamo is tracing (torch.compile): hooks then run inside a compiled graph. (This module
# is imported only once torch is, by NeuralDbg.__enter__.)
from torch.compiler import is_compiling as _compiling  # noqa: E402

# Whether a torch.func transform (vmap, grad...) is running: its tensors have no storage to read
# (a private torch function, so with a fallback).
try:
    from torch._C._functorch import peek_interpreter_stack as _interpreter
except ImportError:  # pragma: no cover - other torch versions
    _interpreter = None  # type: ignore[assignment]


def _functorch_active() -> bool:
    return _interpreter is not None and _interpreter() is not None


# Whether any autocast is on (one cheap check before the per-device one; a private torch
# function, so with a fallback).
try:
    from torch._C import _is_any_autocast_enabled as _any_autocast
except ImportError:  # pragma: no cover - other torch versions

    def _any_autocast() -> bool:
        return True


if TYPE_CHECKING:  # pragma: no cover
    import torch

# The module index of a kept reference (index, output, args).
_FIRST = operator.itemgetter(0)

# The kept reference of a call of the model itself on a step that hooks no module.
_ROOT_CALL = (0, None, None)

# What a step's gradient norms hold (TensorReader.grad_norms), UNKNOWN when not said.
NONFINITE, ZERO, UNKNOWN = 1, 2, 8

# Steps that record which modules ran after exact-zero gradients were seen on a step that did
# not (host mode): while zeros keep coming, they are told apart from "no gradient".
NEED_RAN_STEPS = 32


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
        distributed: Any = None,
    ) -> None:
        import torch

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

        # Set before anything can fail: the guard (see _guard.py) reads them.
        self.disabled = False
        self.registered = False
        self.raising: Optional[BaseException] = None
        self.step = 0
        # The thread of the model's latest forward pass: only backward passes on that thread
        # can be its loss's (models trained on two threads at once).
        self.thread: Optional[int] = None
        # The tensor whose backward the tap is running for this model (see BackwardTap), and a
        # step_on="backward" step whose backward ended on another thread (a CUDA device
        # thread): observed back on the training thread (see _run_due).
        self.tap_current: Any = None
        self.backward_due = False
        self.watched = WatchedModel(model)
        self.params = self.watched.params
        self.param_owner = self.watched.param_owner
        self.param_ids = self.watched.param_ids
        self.no_grads = np.full(len(self.params), -1.0, dtype=np.float32)
        self.measure = Measurer()
        # Facts about the loop (training mode, gradient accumulation, optimizer groups, loss).
        self.loop = LoopFacts(self.params, guard=lambda fn: guarded(self, "loop_probe", fn))
        # Under torch.distributed: the job-wide exchange (neuraldbg._distributed.Distributed).
        self.dist = distributed
        self.sharded = has_shards(self.params)
        if distributed is not None:
            distributed.bind(self.params, model)
        # A model on the CPU, one process: every statistic is computed on the host, straight
        # into the arrays the engine takes (HostMeasurer), and a recorded layer keeps its output
        # only on the steps whose outputs are measured (its NaN/Inf is found by computing it
        # again; see _hooks.make_record).
        self.hm: Optional[HostMeasurer] = None
        # NEURALDBG_DEVICE_PATH (see device_path_override) makes a CPU model take the device path.
        forced = device_path_override()
        self.host_allowed = forced is None
        # Transfer: None until the first observation decides (True on CUDA: asynchronous copy
        # into pinned memory, handed to the engine a step later).
        self.defer: Optional[bool] = None if forced is None else forced == "deferred"
        # Host mode: this step's gradient norms (read at the end of backward), input statistics,
        # and the loss tensor read when its backward started, with its value.
        self.grad_host: Optional[np.ndarray] = None
        self.grad_buf = np.empty(len(self.params), dtype=np.float32)
        # What the gradient norms hold (see TensorReader.grad_norms: bit 1 not finite, 2 an
        # exact zero, 4 a missing gradient; UNKNOWN: not said, the arrays are checked).
        self.grad_flags = UNKNOWN
        # The zero-gradient shares (rows, cols) read with the gradient norms on a sampled step.
        self.zeros_read: Optional[Tuple[np.ndarray, np.ndarray]] = None
        # Input statistics of this step's forward passes, 4 floats each, one after another.
        self.host_inputs: List[float] = []
        self.loss_read: Optional[Tuple[Any, float]] = None

        # (module index, output, positional args) of every hooked module call of the current
        # forward, in completion order.
        self.refs: List[Tuple[int, Any, Any]] = []
        # Host mode, a sampled step: the output maxima of recorded layers read as they
        # return (the extension's OutputMaxima, called by the layer-class wrapper), and the
        # outputs it could not read.
        self.out_kept: List[Tuple[int, Any, Any]] = []
        self.maxima: Any = None
        # The extension's PlainStep (see _make_plain): the plain host steps, with no Python of
        # ours on their path; None when not used.
        self.plain: Any = None
        # The device path's summaries of the module calls of the current forward pass.
        self.summaries = Summaries()
        # Summaries replace kept calls where device memory is at stake: a model on an
        # accelerator, or the CUDA path's CPU stand-in (a CPU job under torch.distributed keeps
        # its calls: reading every output again costs a CPU more than the memory they hold).
        self.forced_device = forced is not None
        self.accelerator = not all(p.device.type == "cpu" for p in self.params)
        summarize = (self.accelerator or self.forced_device) and forward_check != "off"
        self.hooks = Hooks(
            self.watched.modules, self.refs, keep_outputs=forward_check != "off",
            unhookable={i for i, s in enumerate(self.watched.scripted) if s},
            summaries=self.summaries if summarize else None,
        )
        self._decide_host()
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
        # Reading points (see _on_backward_end): a backward pass that gave the model gradients
        # queues one callback for its end (bw_queued); the gradient norms read there wait
        # (on the device) in grad_parts until the step boundary.
        self.bw_queued = False
        self.bw_gen = 0
        self.grad_read = False
        self.bw_deferred = False  # distributed: the reading re-queued once, after the job's
        self.grad_parts: List[Any] = []
        self.grad_order: Optional[np.ndarray] = None
        self.tap_taken: Any = None
        # Host mode: a product loss seen when its backward started, and its unscaled value.
        self.tap_product: Optional[Tuple[Any, Any]] = None
        # The parameter whose gradient norm is read again just before the update (the
        # largest up to 64k elements), and that reading (a device tensor; host mode: a float):
        # their ratio tells whether gradients were clipped.
        self.clip_index: Optional[int] = None
        # See _plain_host_step.
        self.plain_optimizer: Any = None
        self.clip_after: Any = None
        # Host mode: the clip_index gradient read at the end of backward, and its version.
        self.clip_seen: Optional[Tuple[Any, Any]] = None
        # The GradScaler whose step() is running (mixed precision), if any.
        self.scaler: Any = None
        # Inputs of compiled forward passes (references; measured at observation).
        self.raw_inputs: List[Any] = []
        self.blind_warned = False
        # An exception to raise into the training loop once the current step is handled
        # (halt_on's TrainingFailure, or the user's on_failure error).
        self.halt: Optional[BaseException] = None
        from torch.autograd import Variable

        self._queue_callback = Variable._execution_engine.queue_callback
        # The entry points torch calls, each under the guard (see _guard.py).
        self.entry_forward_pre = guarded(self, "forward_pre", self._on_root_pre)
        self.entry_forward_post = guarded(self, "forward_post", self._on_root_post)
        self.entry_criterion = guarded(self, "criterion", self._on_criterion)
        self.entry_grad_ready = guarded(self, "grad_ready", self._on_grad_ready)
        self.entry_backward_end = guarded(self, "backward_end", self._on_backward_end)
        self.entry_backward_start = guarded(self, "backward_start", self.on_backward)
        self.entry_backward_done = guarded(self, "backward_done", self.after_backward)
        self.entry_optimizer_step = guarded(self, "optimizer_step", self._on_optimizer_post)
        self.entry_scaler_step = guarded(self, "scaler_step", self.on_scaler_step)
        self.entry_scaler_step_done = guarded(self, "scaler_step_done", self.on_scaler_step_done)
        self.entry_record_loss = guarded(self, "record_loss", self.record_loss)
        self.relevant: Dict[int, bool] = {}
        self.optimizer_name: Optional[str] = None
        self.probes: List[Probe] = []
        self.internal_error: Optional[BaseException] = None
        self.pending: Optional[Pending] = None
        # CUDA: a second step on its way while the first is (the pinned copy is double-buffered:
        # a step is waited for only when a third would need its buffer).
        self.later: Optional[Pending] = None
        self.host_copy = HostCopy()
        # Work done when the step's forward is complete (see _release_forward): the activation
        # statistics (device parts, index, samples; host mode: the engine's table) and the
        # largest magnitude of each kept module output ((values, module ranks)), on the steps
        # activations are measured.
        self.staged_gen = 0
        self.act_staged: Any = None
        # (values, engine module indices), or (per-module table, None) on the host path.
        self.out_staged: Optional[Tuple[Any, Optional[np.ndarray]]] = None
        self.origin: Optional[int] = None
        self.origin_checked = False
        self.ran: Optional[List[int]] = None
        # Host mode: the steps that need nothing per module run with no module hook or record
        # at all (see _modules_wanted); a step that goes non-finite then has its forward
        # passes computed again (WatchedModel.replay) from the model's own calls, kept here
        # as (args, kwargs) until the forward is released. `replay_ok` turns False for good
        # when that cannot work (the model itself is not called: a LightningModule whose
        # step calls a submodule; an Embedding with max_norm), and `need_ran` counts steps
        # left that record which modules ran (exact-zero gradients were seen: "no gradient"
        # or "zero gradient" depends on it).
        self.root_calls: List[Tuple[Any, Any]] = []
        self.released = 0  # root_calls before this index belong to released forward passes
        self.root_seen = False
        self.replay_ok = self.watched.replayable()
        self.need_ran = 0
        # The engine's activation_pending after the last observed step (see _activations_next).
        self.act_pending = False

    def _decide_host(self) -> None:
        """Host mode or not, from where the parameters are now (until the model is registered:
        a model moved to its device after ``NeuralDbg`` was entered is seen there)."""
        host = (
            self.host_allowed and self.dist is None and not self.sharded
            and all(p.device.type == "cpu" for p in self.params)
        )
        if host and self.hm is None:
            self.hm = HostMeasurer(self.measure, len(self.params))
            if self.hm.reader is not None:
                from ._native import OutputMaxima

                self.maxima = OutputMaxima(self.hm.reader, self.out_kept)
        elif not host:
            self.hm = None
            self.maxima = None
            self.accelerator = not all(p.device.type == "cpu" for p in self.params)
            self._hold_outputs()

    def _hold_outputs(self, autocast: bool = False) -> None:
        """What recorded layers keep (see ``_hooks.make_record``): on the device path, no
        tensor, each call summarized on the device as it returns (:class:`Summaries`; its
        outputs and inputs on the first step, which learns the model, and under
        torch.distributed); under CPU autocast their outputs and inputs (whose precision
        neither a recomputation nor a replay would have); in host mode no tensor when the
        model's forward can be replayed (a sampled step reads each output's largest magnitude
        as the layer returns), else their inputs, and their outputs when measured."""
        hold = self.hooks.hold
        if self.hm is None:
            hold[0] = self.summaries if self._summarized() else True
        elif autocast:
            hold[0] = True
        elif not self.replay_ok:
            hold[0] = self.hooks.probes_armed
        elif self.hooks.probes_armed:
            hold[0] = self.maxima if self.maxima is not None else self._keep_output
        else:
            hold[0] = None

    def _summarized(self) -> bool:
        """Whether this step's module calls are summarized on the device instead of kept (the
        device path on an accelerator or its stand-in, once registered, outputs checked)."""
        return (
            self.hm is None and self.registered and self.forward_check != "off"
            and (self.accelerator or self.forced_device)
        )

    def _keep_output(self, index: int, output: Any, args: Any = None) -> None:
        """A recorded layer returned on a sampled host step without the extension's reader:
        its output is kept and measured with the others."""
        self.out_kept.append((index, output, None))

    def _host_outputs(self) -> Optional[Tuple[np.ndarray, None]]:
        """Host mode, a sampled forward is complete: the largest magnitude of each module's
        outputs, as the engine's per-module table ``(table, None)`` (see :meth:`_module_table`):
        read by the extension as recorded layers returned (``OutputMaxima``), and of the
        outputs kept (by forward hooks on modules of other classes, or not readable then)."""
        hm = self.hm
        assert hm is not None
        kept = self.refs + self.out_kept if self.out_kept else self.refs
        # (Recorded layers keep no output here: OutputMaxima read it.)
        base = hm.absmax([r for r in kept if r[1] is not None], self.watched.rank)
        self.out_kept.clear()
        if self.maxima is None:
            return None if base is None else (self._module_table(base[1], base[0]), None)
        table = self.maxima.table(self.watched.rank_of, len(self.watched.spec_order), *(base or (None, None)))
        return None if table is None else (table, None)

    # ----------------------------------------------------------------- installation

    def install(self) -> None:
        self.hooks.install(self, self.params)

    def _arm_probes(self, on: bool) -> None:
        """Activation probes are hooked only on steps whose activations are measured."""
        on = on and not self.disabled
        if on != self.hooks.probes_armed:
            self.hooks.arm_probes(on, self.probes, self.act_out)
        if self.registered:
            self.hooks.arm_modules(self._modules_wanted(on))
        self._hold_outputs()

    def _modules_wanted(self, sampled: bool) -> bool:
        """Whether the coming step needs the calls of the model's modules seen: always on the
        device path (a NaN is known only after the step, when the parameters have changed);
        in host mode only on sampled steps (their outputs are measured), while exact-zero
        gradients need to know which modules ran, or when a forward cannot be replayed."""
        return self.hm is None or sampled or not self.replay_ok or self.need_ran > 0 or self.disabled

    def remove(self) -> None:
        self._drop_plain()
        self.hooks.remove(self)
        self.loop.remove()
        self.pending = self.later = None
        self.refs.clear()
        self.act_out[:] = self.act_none
        self.inputs.clear()
        self.raw_inputs.clear()
        self.losses.clear()
        self.auto_losses.clear()
        self.output_fns.clear()
        self.grad_parts = []
        self.clip_after = None
        self.clip_seen = None
        self.scaler = None

    # ----------------------------------------------------------------------- hooks

    def _on_root_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if _compiling():
            # Traced into a compiled graph: keep references only. Reading the collector's
            # state here would become a guard (a recompile whenever it changes).
            self.hooks.trace.compiled = True
            self.refs.clear()
            self.summaries.clear()
            self.raw_inputs.clear()
            x = first_float_tensor(args)
            if x is not None:
                self.raw_inputs.append(x)
            return
        self.thread = _thread_id()
        if self.backward_due:
            self._run_due()
        if _functorch_active():
            self._functional_forward()
            return
        plain = self.plain  # (None when disabled)
        if plain is not None and plain.forward(module, args, kwargs):
            return
        if self.disabled:
            return
        hm = self.hm
        if hm is not None and self.registered:
            self._host_forward(module, args, kwargs, hm)
            return
        if not self.registered:
            self._decide_host()
        if self.pending is not None and self.pending.ready():
            self._consume()
            if self.pending is not None and self.pending.ready():
                self._consume()
            self.raise_halt()  # CUDA: the step was handed to the engine just now
        self.forward_gen += 1
        self.refs.clear()
        self.summaries.clear()
        self.ran = None
        if self.hooks.probes_armed:
            self.act_out[:] = self.act_none
        self.loop.on_forward(module.training, self.torch.is_grad_enabled())
        self.root_seen = True
        try:
            x = first_float_tensor(args)
            if x is None and kwargs:
                x = first_float_tensor(kwargs)
            if x is not None and x.numel() > 0:
                if self.hm is not None:
                    self.host_inputs.extend(self.hm.stats(x))
                else:
                    self.inputs.append(input_stats(x.detach()))
        except Exception as e:  # pragma: no cover - defensive
            self._fail(e)

    def _host_forward(
        self, module: Any, args: Any, kwargs: Any, hm: HostMeasurer, seen: Optional[Tuple[bool, bool, Any]] = None
    ) -> None:
        """Host mode, registered: a forward pass of the model starts (the hot path of
        :meth:`_on_root_pre`: no pending step, no device). ``seen``: ``(module.training,
        torch.is_grad_enabled(), input statistics or None)`` as they were when the forward ran,
        no autocast on (a forward the extension's PlainStep saw, handed over later)."""
        self.forward_gen += 1
        self.refs.clear()
        self.ran = None
        hooks = self.hooks
        if hooks.probes_armed:
            self.act_out[:] = self.act_none
            self.out_kept.clear()
            if self.maxima is not None:
                self.maxima.clear()
        torch = self.torch
        if seen is None:
            self.loop.on_forward(module.training, torch.is_grad_enabled())
        else:
            self.loop.on_forward(seen[0], seen[1])
        self.root_seen = True
        self.root_calls.append((args, kwargs))
        if seen is None and _any_autocast() and torch.is_autocast_enabled("cpu"):
            if not hooks.modules_armed:
                hooks.arm_modules(True)  # a replay would lack the autocast precision
            self._hold_outputs(True)
        elif hooks.modules_armed:
            self._hold_outputs(False)
        else:
            # No module hook, not even the model's forward hook: its call is recorded now
            # (what that hook records, less the output, which a replay computes again).
            self.refs.append(_ROOT_CALL)
        try:
            # The model's first input, read by the extension (a float CPU tensor, the common
            # case); anything else goes the general way.
            x = args[0] if args else None
            reader = hm.reader
            if seen is not None:
                v = seen[2]
            else:
                v = reader.stats(x) if reader is not None and type(x) is torch.Tensor else None
            if v is None:
                x = first_float_tensor(args)
                if x is None and kwargs:
                    x = first_float_tensor(kwargs)
                if x is not None and x.numel() > 0:
                    v = hm.stats(x)
            if v is not None:
                self.host_inputs.extend(v)
        except Exception as e:  # pragma: no cover - defensive
            self._fail(e)

    def _on_root_post(self, module: Any, args: Any, output: Any) -> None:
        if _compiling():
            self.refs.append((0, output, args))
            return
        if self.disabled:
            return
        if _functorch_active():
            # This forward's calls and probes hold tensors without storage: let them go.
            self.refs.clear()
            self.summaries.clear()
            self.act_out[:] = self.act_none
            self.out_kept.clear()
            if self.maxima is not None:
                self.maxima.clear()
            return
        if self.hooks.hold[0] is self.summaries:
            self.refs.append((0, None, None))
            self.summaries(0, output, args)
        else:
            self.refs.append((0, output, args))
        # The output's grad_fn: which backward is this model's loss (no criterion given; host
        # mode needs none once registered, see on_backward), and, on the first step, where
        # the loss's graph reaches the model (the loss facts).
        if not self.registered or (self.criterion is None and self.hm is None):
            t = first_float_tensor(output)
            fn = t.grad_fn if t is not None else None
            if fn is not None and len(self.output_fns) < 8:
                self.output_fns.append(fn)
                if not self.registered and self.loop.first_output is None:
                    self.loop.first_output = t
        if self.order is None:
            self._learn_order()

    def _functional_forward(self) -> None:
        """A forward pass inside a ``torch.func`` transform (``vmap(grad(functional_call))``):
        its tensors have no storage to read, so it is not observed; the gradients the loop
        sets and the optimizer steps are. Said once."""
        self.forward_gen += 1  # (a forward happened: its optimizer step is a step)
        if self.blind_warned:
            return
        self.blind_warned = True
        warnings.warn(
            "NeuralDBG sees this model's forward passes inside torch.func transforms (vmap, grad): "
            "their tensors cannot be read, so inputs, activations and the module where a NaN/Inf "
            "first appears are not observed. Gradients set on the parameters and the optimizer's "
            "steps are.",
            NeuralDbgWarning,
            stacklevel=4,
        )

    def _learn_order(self) -> None:
        order: List[int] = []
        done = set()
        for i, _, _ in self.refs:
            if i not in done:
                done.add(i)
                order.append(i)
        self.order = order
        self.order_set = done

    def _on_grad_ready(self, k: int) -> None:
        """Parameter ``k``'s gradient was accumulated: once per backward pass, have the
        gradients read when that backward pass ends (every parameter's gradient is final then)."""
        if self.bw_queued or self.disabled:
            return
        self.bw_queued = True
        try:
            self._queue_callback(self.entry_backward_end)
        except Exception as e:  # pragma: no cover - outside the autograd engine
            self.bw_queued = False
            self._fail(e)

    def _on_backward_end(self) -> None:
        """A backward pass gave the model gradients and has just ended. This is the reading
        point of the gradients: they are exactly what the backward produced, before any
        clipping, unscaling or optimizer touches them. With accumulation each backward reads
        again; the last reading before the optimizer step is the step's."""
        if self.dist is not None and not self.bw_deferred and not self.disabled:
            # DDP and FSDP reduce the gradients in end-of-backward callbacks of their own, queued
            # during the backward pass: queued again now, this reading runs after them.
            self.bw_deferred = True
            try:
                self._queue_callback(self.entry_backward_end)
                return
            except Exception as e:  # pragma: no cover - outside the autograd engine
                self._fail(e)
        self.bw_deferred = False
        self.bw_queued = False
        if self.disabled:
            return
        if not self.registered:
            self._decide_host()
        try:
            self.bw_gen += 1
            self._take_loss()
            self._read_gradients()
            if self.hm is not None and self.registered and self.refs and (
                self.staged_gen != self.forward_gen or not self.root_seen
            ):
                # Host mode, no release before backward (no loss seen then; or the model itself
                # was not called): a non-finite loss or gradient has the outputs scanned now,
                # while the parameters are unchanged.
                bad = not self._grads_finite()
                bad = bad or not all(math.isfinite(v) for v in self._loss_values())
                self._release_forward(bad)
        except Exception as e:
            self._fail(e)
            return
        if self.step_on == "backward":
            if self.thread is not None and _thread_id() != self.thread:
                # Autograd's device thread (CUDA): the engine is fed from the training thread,
                # when the backward returns there or at the next forward pass.
                self.backward_due = True
                return
            self._backward_step()

    def _backward_step(self, halt: bool = True) -> None:
        """``step_on="backward"``: the backward pass that just ended is a step."""
        self._observe(lr=None)
        self.step += 1
        self._arm_probes(self._activations_next())
        if halt:
            self.raise_halt()

    def _run_due(self, halt: bool = True) -> None:
        """On the training thread: the step of a backward that ended on another thread
        (``halt``: raise a halt it confirms into the loop)."""
        if self.backward_due:
            self.backward_due = False
            self._backward_step(halt)

    def _read_gradients(self) -> None:
        if self.hm is not None:
            # A step whose zero-gradient shares are measured reads them in the same pass.
            n = len(self.params)
            zeros = (np.empty(n, np.float32), np.empty(n, np.float32)) if self._sampled(self.activation_every) else None
            flags = self.hm.grad_norms(self.params, self.grad_buf, zeros)
            clip_seen = None
            if self.clip_index is not None:
                # The clipping check's gradient as read, and its version: unchanged at the
                # optimizer step, nothing rescaled it (see _read_clipped).
                g = self.params[self.clip_index].grad
                clip_seen = (g, getattr(g, "_version", None)) if g is not None else None
            self._host_grads(flags, zeros, clip_seen)
            return
        parts: List[Any] = []
        grads = [p.grad for p in self.params]
        if self.sharded:  # each rank measures what it holds: DTensors' local shards
            grads = local_tensors(grads)
        with self.torch.no_grad():
            self.grad_order = self.measure.gradient_norms(grads, parts)
        self.grad_parts = parts
        self.grad_read = True

    def _host_grads(self, flags: int, zeros: Any, clip_seen: Any) -> None:
        """Host mode: the gradient norms are in ``grad_buf`` (``flags``: what they hold; see
        TensorReader.grad_norms), with their zero shares ``zeros`` when read."""
        self.grad_flags = flags
        self.zeros_read = zeros if zeros is not None and not flags & UNKNOWN else None
        self.grad_host = self.grad_buf
        self.grad_read = True
        self.clip_seen = clip_seen

    def _spill_grads(self, loss: Any, flags: int, clip_seen: Any, accumulated: Optional[bool]) -> None:
        """A plain step's gradients, handed over by the extension's PlainStep (see
        :meth:`_make_plain`): what the end of that backward made of them at the tap (the loss
        taken, the norms read), from the values read then."""
        self.bw_gen += 1
        self.tap_taken = None
        self.tap_product = None
        seen = self.loss_read
        if loss is not None and seen is not None and seen[0] is loss:
            self.auto_losses.append(loss)
        self._host_grads(flags, None, clip_seen)
        if accumulated is not None:
            self.loop.accumulated = accumulated

    def _make_plain(self) -> None:
        """The extension's ``PlainStep``, which observes the plain host steps itself (see its
        docs in ``crates/neuraldbg-py/src/plain.rs``): a CPU model read by the extension, its
        loss taken and its gradients read at the backward tap. Made again when the sentinels
        change; None otherwise."""
        self.plain = None
        hm = self.hm
        if hm is None or hm.reader is None or not self.hooks.tap_reads or self.criterion is not None or self.dist is not None:
            return
        try:
            from ._native import PlainStep

            torch = self.torch
            self.plain = PlainStep(
                self, hm.reader, self.engine, self.params, self.grad_buf, self.loop, list(self.hooks.sentinels),
                self.clip_index, torch.Tensor, torch.is_grad_enabled, _any_autocast,
            )
        except (ImportError, TypeError):  # an older extension, or an engine stand-in (tests)
            self.plain = None

    def _drop_plain(self) -> None:
        """No more plain steps: a step the extension's PlainStep was taking is handed over."""
        plain, self.plain = self.plain, None
        if plain is not None:
            plain.arm(False)

    def _plain_next(self) -> bool:
        """Whether the coming step may be a plain one, taken by the extension's PlainStep:
        nothing sampled or hooked in it (what :meth:`_plain_host_step` asks of a step, known
        before it starts)."""
        hooks = self.hooks
        return (
            self.plain is not None
            and not self.disabled
            and self.plain_optimizer is not None
            and not hooks.probes_armed
            and not hooks.modules_armed
            and not hooks.frozen
            and self.scaler is None
            and self.forward_check != "off"
            and self._unsampled()
            and not self.act_pending
        )

    def _unsampled(self) -> bool:
        """The current step is past the dense ones and measures neither activations nor
        weights (by its number; an unconfirmed activation change is ``act_pending``)."""
        s = self.step
        return s >= self.dense_steps and s % self.activation_every != 0 and s % self.weight_every != 0

    def _plain_done(self, pending: Optional[bool], step: int) -> bool:
        """The extension's PlainStep observed step ``step`` (``pending``: the engine's answer,
        None when observing it failed): what :meth:`_plain_host_step` does after observing.
        Returns whether the coming step may be a plain one too."""
        self.forward_gen += 1
        self.bw_gen += 1
        self.observed_gen = self.forward_gen
        if pending is not None:
            self.act_pending = pending
            try:
                if self.on_observed is not None:
                    self.on_observed(step)
            except Exception as e:
                self._fail(e)
        if self._next_step():
            return self._plain_next()
        # Nothing armed: what _plain_next asks held for this step (a plain one), and nothing
        # sampled comes, so the coming step is plain unless its weights are measured.
        return self.plain is not None and self.step % self.weight_every != 0

    def _next_step(self) -> bool:
        """A plain step was observed: count it, let the loop facts' probe see the gradient the
        optimizer used, and arm what the coming step needs. True when something was armed
        (or disarmed)."""
        self.step += 1
        try:
            self.loop.after_optimizer_step()
        except Exception as e:  # pragma: no cover - defensive
            self._fail(e)
        sampled = self._activations_next()
        if sampled or self.hooks.modules_armed or self._modules_wanted(sampled):
            self._arm_probes(sampled)
            return True
        return False  # (nothing to arm or disarm, nothing held)

    def _grads_finite(self) -> bool:
        """Host mode: whether every gradient norm read in this step is finite."""
        flags = self.grad_flags
        if flags & UNKNOWN:
            assert self.grad_host is not None
            return math.isfinite(float(self.grad_host.sum(dtype=np.float64)))
        return not flags & NONFINITE

    def _take_loss(self) -> None:
        """The loss of this backward, when no criterion gives it: the tensor passed to
        ``backward()`` (unless the tap already took it before backward started)."""
        t = self.tap_current
        taken, self.tap_taken = self.tap_taken, None
        product, self.tap_product = self.tap_product, None
        if self.criterion is not None or t is None or t is taken:
            return
        if product is not None and t is product[0]:
            self.auto_losses.append(product[1])  # host mode: unscaled before its backward
            return
        seen = self.loss_read
        if seen is not None and t is seen[0]:
            self.auto_losses.append(t)  # host mode: the loss read before its backward
            return
        torch = self.torch
        if isinstance(t, torch.Tensor) and t.numel() == 1 and t.grad_fn is not None:
            self.auto_losses.append(self._unscaled_loss(t))

    def _unscaled_loss(self, tensors: "torch.Tensor") -> "torch.Tensor":
        torch = self.torch
        fn = tensors.grad_fn
        if type(fn).__name__ != "MulBackward0":
            # Being differentiated: its graph lets go of its saved tensors in this backward, and
            # it is read under no_grad (or by the host reader), so no detach is needed.
            return tensors
        loss = tensors.detach()
        # GradScaler's `scaler.scale(loss)` multiplies by a constant 1-element scale tensor:
        # undo it so the loss keeps its own scale when the scale factor changes.
        try:
            other = getattr(fn, "_saved_other", None)
        except RuntimeError:  # freed by its backward already
            other = None
        if isinstance(other, torch.Tensor) and other.numel() == 1 and not other.requires_grad:
            loss = loss / other.detach()
        return loss.reshape(())

    def _on_criterion(self, module: Any, args: Any, output: Any) -> None:
        torch = self.torch
        if isinstance(output, torch.Tensor) and output.numel() == 1:
            # Detached: a loss computed without backward (evaluation) must not hold its graph.
            self.losses.append(output.detach())
            if not self.registered:
                self.loop.describe_loss(output, self.output_fns)
            self._on_loss(output)

    def record_loss(self, loss: Any) -> None:
        if self.disabled:
            return
        torch = self.torch
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                loss = loss.detach().float().mean()
            self.losses.append(loss.detach())
        else:
            # A number stays on the host: a tensor made of it would be copied to the device
            # from pageable memory, which waits for the device's queue.
            self.losses.append(float(loss))

    def on_backward(self, tensors: Any) -> Any:
        """A ``backward()`` started somewhere in the process: keep its tensor if it is a scalar
        whose graph reaches this model's output (the loss of this model, not of another).
        Taking it here, before backward runs, lets the forward's outputs go first (CPU); a
        loss this misses (no output seen: a compiled forward, a LightningModule whose step
        calls a submodule) is taken when the backward reaches the model's parameters.

        When the gradients are read at the tap (``Hooks.tap_reads``), returns what
        :meth:`after_backward` compares with when the backward has returned (True: the loss
        of a plain step, taken by the extension's PlainStep)."""
        plain = self.plain  # (None when disabled, not registered, or not in host mode)
        if plain is not None and plain.backward(tensors):
            return True
        torch = self.torch
        if self.disabled:
            return None
        if self.hm is not None and self.registered:
            # Host mode: the forward's work is done now, before its backward (the kept inputs
            # and outputs go before backward allocates, as in a plain loop), without walking
            # the graph to prove this is the model's loss: the loss itself is taken at the
            # backward's end (the tensor whose backward gave the parameters gradients). A
            # product may be GradScaler's scaled loss: its scale is read now, before backward
            # frees it, and the unscaled loss kept for that end.
            self._host_loss(tensors)
            if not self.hooks.tap_reads:
                return None
            params = self.params
            marks = []
            for k in self.hooks.sentinels:
                g = params[k].grad
                marks.append((k, g, None if g is None else g._version))
            return marks, self.loop.before_backward()
        if not isinstance(tensors, torch.Tensor) or not self.output_fns:
            return None
        fn = tensors.grad_fn
        if fn is None or tensors.numel() != 1 or not reaches(fn, self.output_fns):
            return
        self.auto_losses.append(self._unscaled_loss(tensors))
        self.tap_taken = tensors
        if not self.registered:
            self.loop.describe_loss(tensors, self.output_fns)
        self._on_loss(tensors)
        return None

    def _host_loss(self, tensors: Any) -> None:
        """Host mode: a backward of ``tensors`` starts; a scalar is taken as the loss of the
        forward pass seen (see :meth:`on_backward`)."""
        torch = self.torch
        if self.refs and isinstance(tensors, torch.Tensor) and tensors.numel() == 1:
            if type(tensors.grad_fn).__name__ == "MulBackward0":
                self.tap_product = (tensors, self._unscaled_loss(tensors))
            self._on_loss(tensors)

    def after_backward(self, marks: Any) -> None:
        """A backward pass the tap saw has returned (``Hooks.tap_reads``): if it changed a
        sentinel's gradient, it gave the model gradients, and its end is their reading point
        (what :meth:`_on_backward_end` does when the sentinels' hooks queue it). ``marks``
        True: the backward of a plain step's loss, the extension's."""
        if marks is True:
            plain = self.plain
            if plain is not None:
                plain.after_backward()
            return
        if marks is None:
            self._run_due()
            return
        sentinels, probe = marks
        params = self.params
        reached = False
        try:
            for k, g, version in sentinels:
                if grad_changed(params[k], g, version):
                    reached = True
                    break
            if probe is not None:
                self.loop.after_backward(probe)
        except Exception as e:  # pragma: no cover - never break the user's backward
            self._fail(e)
            return
        if reached:
            self._on_backward_end()  # (a halt it raises goes to the loop, as from the hooks)

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
        try:
            hm = self.hm
            if hm is not None:
                value = hm.scalar(loss)
                self.loss_read = (loss, value)  # (not read again when the step is observed)
                self._release_forward(not math.isfinite(value))
            elif not self.defer and loss.device.type == "cpu":
                self._release_forward(not math.isfinite(float(loss.detach())))
            else:
                self._release_forward(None)  # (CUDA: no host read inside the step)
        except Exception as e:  # pragma: no cover - defensive
            self._fail(e)

    def _release_forward(self, nonfinite: Optional[bool]) -> None:
        """The forward pass is complete: its sampled activation and output statistics are
        measured, and, when whether it went non-finite is known (``nonfinite`` not None: a
        host read of the loss or gradients), a non-finite one has its kept module outputs
        scanned for the origin, then they are let go (as a plain loop would have). Otherwise
        (CUDA) they wait for the observation."""
        self.staged_gen = self.forward_gen
        hm = self.hm
        if self.hooks.probes_armed:
            if hm is not None:
                self.act_staged = hm.activations(self.probes, self.act_out)
                self.out_staged = self._host_outputs()
            else:
                self.act_staged = self.measure.activation_parts(self.probes, self.act_out)
                if not self.summaries:  # (summarized calls carry their output scale)
                    self.out_staged = self.measure.output_absmax(self.refs, self.watched.rank)
            self.act_out[:] = self.act_none
        self._entry_inputs()
        if nonfinite is None or self.forward_check == "off":
            return
        if nonfinite and self.origin is None and self.refs:
            self.origin, self.origin_checked = self._scan(self.refs)
        self.ran = list(map(_FIRST, self.refs))
        self.refs.clear()
        self.released = len(self.root_calls)

    def _entry_inputs(self) -> None:
        """The model itself was not called in this step (a LightningModule whose
        ``training_step`` calls ``self.net(x)``): its batch is read where it first entered a
        watched module, the inputs of the first module call recorded (in completion order: the
        first layer that consumed it). Nothing when the model's own call was seen or an input
        was read already."""
        if self.root_seen or self.raw_inputs or self.host_inputs or self.inputs or not self.refs:
            return
        for _, _, args in self.refs:
            x = first_float_tensor(args) if args is not None else None
            if x is None or x.numel() == 0:
                continue
            if _functorch_wrapped(x):
                return
            if self.hm is not None:
                self.host_inputs.extend(self.hm.stats(x))
            else:
                self.inputs.append(input_stats(x.detach()))
            return

    def _device_origin(self, vals: Any) -> Any:
        """:meth:`Summaries.origin` of the step's summary vector ``vals``, for this model."""
        from ._distributed import _to_device

        watched = self.watched

        def ranks_of(calls: List[Tuple[int, int, int]]) -> Tuple[np.ndarray, np.ndarray]:
            own = [watched.rank.get(i, -1) for i, _, _ in calls]
            enclosing = [watched.rank.get(i if i == 0 else watched._enclosing(i), -1) for i, _, _ in calls]
            return np.asarray(own, dtype=np.float32), np.asarray(enclosing, dtype=np.float32)

        torch = self.torch
        return self.summaries.origin(vals, ranks_of, lambda a, device: _to_device(torch, a, device))

    def _scan(self, refs: List[Tuple[int, Any, Any]]) -> Tuple[Optional[int], bool]:
        """The module where this step's forward first went non-finite, and whether that was
        known: from the kept module calls, or, when the step recorded none (host mode), by
        computing the model's forward passes again while the parameters are unchanged."""
        if self.summaries:  # the device path: its calls were summarized (a host read: a failure step)
            vec = self.summaries.vector()
            summary = read_summaries(self.summaries.calls, vec.detach().cpu().numpy())
            return self.watched.first_nonfinite_summary(summary), True
        calls = self.root_calls[self.released :]
        kept = self.hooks.hold[0]
        if not calls or (self.hooks.modules_armed and (kept is True or kept is False)):
            return self.watched.first_nonfinite(refs), True
        replayed = self.watched.replay(self.model, calls)
        if replayed is None:
            return None, False
        return self.watched.first_nonfinite(replayed), True

    def _loss_values(self) -> List[float]:
        """Host mode: the values of this step's losses (the one read before backward is not
        read again)."""
        hm = self.hm
        assert hm is not None
        seen = self.loss_read
        return [
            t if isinstance(t, float) else seen[1] if seen is not None and t is seen[0] else hm.scalar(t)
            for t in self.losses or self.auto_losses
        ]

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

    def _on_optimizer_post(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The step boundary: the optimizer step of the model's parameters ran (a closure's
        forward and backward ran inside it)."""
        plain = self.plain
        if plain is not None and plain.step(optimizer):
            self.raise_halt()
            return
        if optimizer is self.plain_optimizer and self.grad_read and self._plain_host_step(optimizer):
            self.raise_halt()
            return
        if self.disabled:
            if self.step_on != "backward" and self._is_relevant(optimizer):
                self.step += 1  # still a step of the run: the trace records it as not observed
            return
        if self.step_on == "backward" or not self._is_relevant(optimizer):
            return
        if not self.grad_read and self.forward_gen == self.observed_gen:
            if self.step_on != "each_optimizer":
                return  # a second optimizer of the same iteration: one step
            try:
                self._read_gradients()  # a step of its own: the gradients it used, as they are
            except Exception as e:  # pragma: no cover - defensive
                self._fail(e)
                return
        if not self.grad_read:
            # Gradients no backward pass accumulated (set by hand), or one that reached no
            # sentinel: read as they are, and sentinels chosen among those that have one.
            # Read at the tap, sentinels that stay the same had gradients from a backward the
            # tap did not see: from now on their hooks say where a backward ends.
            moved = self.hooks.hook_grads(self, self.params)
            if self.hooks.tap_reads and not moved:
                self.hooks.read_at_tap(self, self.params, False)
                self.loop.hook_probe()
            if self.plain is not None:
                self._make_plain()  # (new sentinels, or none read at the tap any more)
            try:
                self._read_gradients()
            except Exception as e:  # pragma: no cover - defensive
                self._fail(e)
                return
        self._read_clipped()
        self._step_boundary(optimizer, skipped=False)
        self.raise_halt()

    def _plain_host_step(self, optimizer: Any) -> bool:
        """The step boundary of the common host-mode step, in one function: registered, CPU,
        nothing sampled in it or armed for it, no GradScaler, finite loss and gradients, every
        gradient norm read by the extension (what :meth:`_read_clipped`, :meth:`_step_boundary`,
        :meth:`_observe_host` and :meth:`_feed` do then, without their calls and checks: on a
        1 ms step each Python call runs with its code out of cache). False, having done
        nothing, when the step is not such a step: the general path observes it."""
        flags = self.grad_flags
        if (
            flags & (NONFINITE | UNKNOWN)
            or (flags & ZERO and self.loop.grads_kept is not False)
            or self.disabled
            or self.hooks.probes_armed
            or self.hooks.frozen
            or self.act_staged is not None
            or self.out_staged is not None
            or self.raw_inputs
            or self.scaler is not None
            or self.forward_gen == self.observed_gen
            or not self._unsampled()
        ):
            return False
        grads = self.grad_host
        if grads is None:
            return False
        seen = self.loss_read
        pending = self.losses or self.auto_losses
        if len(pending) == 1 and seen is not None and pending[0] is seen[0]:
            loss: Optional[float] = seen[1]
        elif not pending:
            loss = None
        else:
            return False
        if loss is not None and not math.isfinite(loss):
            return False
        try:
            facts = self.loop.step_facts()
            k = self.clip_index
            if k is not None:
                self._read_clipped()
                ratio = clip_ratio(float(grads[k]), self.clip_after) if self.clip_after is not None else None
                if ratio is not None:
                    facts["clip_ratio"] = ratio
            step = self.step
            self.act_pending = self.engine.observe(
                step, grads, None, None, self.host_inputs or None, loss, _lr_of(optimizer), None, False, facts or None, None
            )
            if self.on_observed is not None:
                self.on_observed(step)
        except Exception as e:
            self._fail(e)
        finally:
            self._end_plain_step(False)
        self._next_step()
        if self.plain is not None:
            self.plain.arm(self._plain_next())
        return True

    def _step_boundary(self, optimizer: Any, skipped: bool) -> None:
        """One optimizer iteration ended (``skipped``: a GradScaler skipped its step): observe
        it, count it, and prepare the next one."""
        if not self.registered:
            self.loop.optimizer = optimizer  # the loop facts' optimizer, read at registration
        self._observe(lr=_lr_of(optimizer), skipped=skipped)
        # The optimizer whose steps may take the short path (host mode, the step boundary of
        # the optimizer: the one optimizer of the model seen stepping).
        self.plain_optimizer = (
            optimizer
            if self.hm is not None and self.registered and self.step_on == "optimizer" and not self.disabled
            else None
        )
        self.step += 1
        try:
            self.loop.after_optimizer_step()
        except Exception as e:  # pragma: no cover - defensive
            self._fail(e)
        self._arm_probes(self._activations_next())
        if self.plain is not None:
            self.plain.arm(self._plain_next())

    def _read_clipped(self) -> None:
        """The gradient the optimizer received, read again after its step (an optimizer does
        not change ``.grad``; with a closure, clipping happens inside ``step()``): the norm of
        one parameter's gradient (see ``clip_index``) against what the backward produced says
        whether something (clipping) rescaled the gradients in between."""
        if self.clip_index is None:
            return
        if self.hm is not None:
            seen, self.clip_seen = self.clip_seen, None
            grads = self.grad_host
            if seen is not None and seen[1] is not None and grads is not None:
                # In-place rescaling (clip_grad_norm_, GradScaler.unscale_) bumps the tensor's
                # version: the same tensor at the same version is what the backward produced.
                g = self.params[self.clip_index].grad
                if g is seen[0] and getattr(g, "_version", None) == seen[1]:
                    self.clip_after = float(grads[self.clip_index])
                    return
            self.clip_after = self.hm.norm(self.params[self.clip_index], "grad")
            return
        g = self.params[self.clip_index].grad
        if g is not None and self.sharded:
            g = local_tensors([g])[0]
        try:
            if g is not None and g.layout == self.torch.strided:
                with self.torch.no_grad():
                    self.clip_after = self.torch.linalg.vector_norm(g).float()
        except Exception as e:  # pragma: no cover - defensive: never break the user's step
            self._fail(e)

    def raise_halt(self) -> None:
        """Raises a pending halt into the training loop (from the step that confirmed it); the
        guard lets it through (``raising``)."""
        if self.halt is not None:
            e, self.halt = self.halt, None
            self.raising = e
            raise e

    def on_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        """``scaler.step(optimizer)`` starts: the gradients read were scaled by its scale."""
        if self.disabled or self.step_on == "backward" or not self._is_relevant(optimizer):
            return
        if scaler.is_enabled():
            self.scaler = scaler

    def on_scaler_step_done(self, scaler: Any, optimizer: Any) -> None:
        """``scaler.step`` returned. If the optimizer step did not run (an overflow), the
        iteration is still a step, marked skipped."""
        if self.scaler is not scaler:
            return
        try:
            if self.grad_read and not self.disabled:
                self._step_boundary(optimizer, skipped=True)
        finally:
            self.scaler = None

    # ------------------------------------------------------------------ observation

    def _fail(self, e: BaseException) -> None:
        """Monitoring broke while observing a step (see :meth:`fail`)."""
        self.fail("observation", e)

    def fail(self, entry: str, e: BaseException) -> None:
        """Monitoring broke at ``entry`` (see _guard.py): say so once and stop, leaving training
        untouched. What was observed until then stays in the engine and the trace."""
        if self.disabled:
            return
        self.internal_error = e
        self.disabled = True
        self.pending = self.later = None
        self.plain = None
        who = "NeuralDBG"
        message = (
            f"stopped observing at step {self.step} after an internal error in {entry}: "
            f"{type(e).__name__}: {e}. Training goes on unobserved; "
            + (f"steps 0 to {self.step - 1} are diagnosed and in the trace. " if self.step else "")
            + f"This is a bug in NeuralDBG: {REPORT}"
        )
        if self.dist is not None:
            try:
                self.dist.abandon(e)
            except Exception:  # pragma: no cover - the warning below says it all
                pass
            who = f"NeuralDBG (rank {self.dist.rank})"
            if isinstance(e, PeerLeft):  # the peer's doing, not an error of ours
                message = f"stopped observing at step {self.step}: {e}; training goes on"
        warnings.warn(
            f"{who} {message}",
            NeuralDbgWarning,
            stacklevel=3,
        )

    def _register(self) -> None:
        if self.order is None:
            self._learn_order()  # the model itself was not called: its submodules were
        executed = self.order or []
        if executed and executed[0] != 0:
            self.hooks.first[0] = executed[0]
        if self.params:
            # The gradient read again after the step to detect clipping: the largest parameter
            # up to 64k elements (a full read of a multi-million one would cost milliseconds on
            # CPU; clip_grad_norm_ scales every gradient alike, so any one shows it).
            sizes = [int(p.numel()) for p in self.params]
            small = [k for k, n in enumerate(sizes) if n <= 1 << 16]
            pool = small or list(range(len(sizes)))
            self.clip_index = max(pool, key=lambda k: sizes[k])
        spec = self.watched.spec(executed, self.optimizer_name)
        spec["param_lr"] = self.loop.param_lrs()
        spec["loss"] = self.loop.loss_facts()
        # A CPU model whose loss is taken at the backward tap has its gradients read there
        # too, when the backward returns, instead of by hooks that fire inside it.
        tap = self.hm is not None and self in BACKWARD_TAP.collectors and not self.hooks.frozen
        self.hooks.read_at_tap(self, self.params, tap)
        self.loop.install_probe(hook=not tap)
        self._make_plain()
        self.loop.optimizer = None
        probes = json.loads(self.engine.register_model(json.dumps(spec)))
        axes = self.watched.unit_axes(executed)
        self.probes = []
        for row, d in enumerate(probes):
            module = self.watched.spec_order[d["module"]]
            d = dict(d, module=module)
            self.probes.append(Probe(row, d, axes.get(module, -1)))
        self.act_none = [None] * len(self.probes)
        if self.dist is not None:
            self.dist.setup(len(self.params), len(self.probes))
        # This first step ran with every module hooked: its probe outputs are in refs.
        self._fill_act_out()
        self.registered = True
        self.hooks.probes_armed = False

    def _fill_act_out(self) -> None:
        """Each probe's latest output from the kept module outputs."""
        self.act_out[:] = self.act_none
        row_of = {p.module: p.row for p in self.probes}
        for i, out, _ in self.refs:
            r = row_of.get(i)
            if r is not None:
                self.act_out[r] = out

    def _activations_now(self) -> bool:
        return self._activations_next()

    def _check_seen(self) -> None:
        """Gradients without any forward pass seen: the forward ran where module hooks are not
        called. Said once; gradients, loss and steps are still observed."""
        if self.blind_warned or self.refs or self.raw_inputs or self.ran:
            return
        if self.forward_gen != self.observed_gen or self.hooks.frozen:
            return
        self.blind_warned = True
        warnings.warn(
            "NeuralDBG sees this model's gradients but none of its forward passes: the forward "
            "ran where module hooks are not called (a torch.compile'd model first called before "
            "`with NeuralDbg(...)` was entered, or torch.func). Inputs, activations and the module "
            "where a NaN/Inf first appears are not observed; enter NeuralDbg before the first "
            "compiled call to get them.",
            NeuralDbgWarning,
            stacklevel=4,
        )

    def _sampled(self, every: int) -> bool:
        return self.step < self.dense_steps or (every > 0 and self.step % every == 0)

    def _activations_next(self) -> bool:
        """Measure activations in the coming step: on its sample period, or densely while the
        engine has an unconfirmed activation change (so it is confirmed within `persistence`
        steps, not `persistence` samples)."""
        return self._sampled(self.activation_every) or self.act_pending

    def _observe(self, lr: Optional[float], final: bool = False, skipped: bool = False) -> None:
        try:
            self._observe_inner(lr, final, skipped)
        except Exception as e:
            self._fail(e)
        finally:
            self._end_step(final)

    def _end_step(self, final: bool) -> None:
        """The per-step state back to that of a step not yet begun (after its observation)."""
        self._end_plain_step(final)
        self.grad_parts = []
        self.raw_inputs.clear()
        self.inputs.clear()
        self.output_fns.clear()
        self.act_out[:] = self.act_none
        self.act_staged = None
        self.out_staged = None
        self.out_kept.clear()
        if self.maxima is not None:
            self.maxima.clear()
        self.zeros_read = None
        self.summaries.clear()

    def _end_plain_step(self, final: bool) -> None:
        """The part of :meth:`_end_step` a step that :meth:`_plain_host_step` observes needs:
        the state every step sets. The rest is only set on the steps that path leaves to the
        general one (device or distributed, sampled, compiled, measured outputs)."""
        self.observed_gen = self.forward_gen
        self.grad_read = False
        self.clip_after = None
        self.clip_seen = None
        self.losses.clear()
        self.auto_losses.clear()
        if not final:
            self.refs.clear()
        self.grad_host = None
        self.tap_product = None
        self.grad_flags = UNKNOWN
        self.host_inputs.clear()
        self.loss_read = None
        self.origin = None
        self.origin_checked = False
        self.ran = None
        if not final:
            if not self.root_seen:
                self.replay_ok = False  # gradients without a call of the model itself
            self.root_seen = False
            self.root_calls.clear()
            self.released = 0
            if self.need_ran > 0:
                self.need_ran -= 1

    def _observe_inner(self, lr: Optional[float], final: bool, skipped: bool = False) -> None:
        torch = self.torch
        first = not self.registered
        if first:
            self._register()
        self._check_seen()
        if self.hm is not None:
            self._observe_host(lr, final, first, skipped)
            return
        self._entry_inputs()
        layout = Layout(self.step, lr, final)
        layout.facts = self.loop.step_facts()
        parts: List[Any] = []
        with torch.no_grad():
            if not self.grad_read:
                self._read_gradients()  # at exit, or a step seen only at its boundary
            grad_parts = self.grad_parts
            scale = getattr(self.scaler, "_scale", None) if self.scaler is not None else None
            if isinstance(scale, torch.Tensor):
                # Read at the end of backward, the gradients were scaled: unscale the norms.
                inv = scale.double().reciprocal().float()
                grad_parts = [g * inv.to(g.device) for g in grad_parts]
                layout.skipped = skipped
            parts.extend(grad_parts)
            layout.grad_order = self.grad_order
            weights = local_tensors(self.params) if self.sharded else self.params
            if self.params and self._sampled(self.weight_every):
                layout.weight_order = self.measure.weight_norms(weights, parts)
            staged = self.act_staged
            if staged is None and self.probes and self.hooks.frozen and self._activations_now():
                self._fill_act_out()  # compiled: the probes are the kept module outputs
                staged = self.measure.activation_parts(self.probes, self.act_out)
            elif staged is None and self.probes and (first or self.hooks.probes_armed):
                staged = self.measure.activation_parts(self.probes, self.act_out)
            if staged is not None:
                parts.extend(staged[0])
                layout.act_index = staged[1]
                layout.n_act = int(staged[1].size)
                layout.act_samples = staged[2]
            layout.origin = self.origin
            layout.checked = self.origin_checked
            layout.ran = self.ran
            pending = self.losses or self.auto_losses
            tensors = [t for t in pending if not isinstance(t, float)]
            if tensors:
                layout.loss = True
                loss = tensors[0] if len(tensors) == 1 else torch.stack([t.reshape(()).float() for t in tensors]).mean()
                parts.append(loss.reshape(1).to(torch.float32))
            if len(tensors) < len(pending):  # numbers given to record_loss: averaged in on the host
                floats = [t for t in pending if isinstance(t, float)]
                layout.loss_floats = (math.fsum(floats), len(floats), len(tensors))
            for x in self.raw_inputs:
                if x.numel() > 0:
                    self.inputs.append(input_stats(x.detach()))
            if self.inputs:
                layout.n_inputs = len(self.inputs)
                parts.extend(self.inputs)
            # Facts measured on the device travel in the same vector (after the inputs).
            if self.clip_after is not None and self.clip_index is not None:
                layout.clip_index = self.clip_index
                parts.append(self.clip_after.reshape(1).float())
            if isinstance(scale, torch.Tensor):
                layout.loss_scale = True
                parts.append(scale.reshape(1).float())
            outs = self.out_staged
            if outs is None and first and not self.summaries:
                outs = self.measure.output_absmax(self.refs, self.watched.rank)
            if outs is not None:
                # At the end of the vector: the engine's per-module output scale (forward growth).
                parts.append(outs[0])
                layout.out_ranks = outs[1]
            if self.params and self._sampled(self.activation_every):
                # Last: units that never fire behind functional activations (zero gradient rows).
                grads = [p.grad for p in self.params]
                zeros = self.measure.grad_zero_shares(local_tensors(grads) if self.sharded else grads)
                if zeros is not None:
                    parts.append(zeros[0])
                    layout.zero_index = zeros[1]
            if self.summaries:
                # Very last: the summaries of the step's module calls (where a NaN/Inf first
                # appeared; on sampled steps, each module's output scale).
                vec = self.summaries.vector()
                if vec is not None:
                    parts.append(vec)
                    if self.dist is not None and layout.origin is None and not layout.checked:
                        # The exchange takes each rank's origin before the vector reaches a
                        # host: found on the device.
                        layout.origin_device = self._device_origin(vec)
                layout.summary_calls, layout.summary_n = self.summaries.take()
                layout.summary_out = first or self._sampled(self.activation_every)
            flat = flatten(parts)
        refs = self.refs
        if first:
            self.hooks.rehook(set(self.param_owner))
        if self.dist is not None and not final:
            # The job's one collective for this step; the job-wide step reaches the engine
            # when it has arrived (see _distributed.py). A crashed rank's last forward (final)
            # is observed alone: the other ranks are not there to exchange with.
            if self.pending is not None:
                self._consume()
            keep = list(refs) if self.forward_check != "off" else [(i, None, None) for i, _, _ in refs]
            self.pending = Pending(layout, None, None, keep, self.dist.exchange(layout, flat))
            return
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
        # at a later forward pass once the copy is done (see _consume). Two steps may be on
        # their way (two buffers): the oldest of them is handed over first when a third comes,
        # also when no forward pre-hook of the model runs (traced into a compiled graph, or the
        # model itself is not called). Module calls were summarized: nothing heavy waits.
        if self.later is not None:
            self._consume()
        host, event = self.host_copy.start(flat)
        keep = list(refs) if self.forward_check != "off" or final else [(i, None, None) for i, _, _ in refs]
        p = Pending(layout, host, event, keep)
        if self.pending is None:
            self.pending = p
        else:
            self.later = p
        if final:
            self.flush()

    def _observe_host(self, lr: Optional[float], final: bool, first: bool, skipped: bool) -> None:
        """Host mode (a CPU model, one process): the step's statistics are computed straight
        into host arrays (:class:`HostMeasurer`) and fed to the engine; no device vector."""
        hm = self.hm
        assert hm is not None
        self._entry_inputs()
        facts = self.loop.step_facts()
        if not self.grad_read:
            self._read_gradients()
        if self.grad_host is not None:
            grads, flags = self.grad_host, self.grad_flags
        else:
            grads, flags = self.no_grads.copy(), UNKNOWN
        if self.scaler is not None:
            scale = getattr(self.scaler, "_scale", None)
            if isinstance(scale, self.torch.Tensor):
                # Read at the end of backward, the gradients were scaled: unscale the norms.
                inv = np.float32(1.0 / float(scale))
                grads, flags = np.where(grads >= 0, grads * inv, grads).astype(np.float32), UNKNOWN
                facts["loss_scale"] = float(scale)
                facts["optimizer_skipped"] = 1.0 if skipped else 0.0
        step = HostStep(self.step, lr, final, grads)
        if self.clip_after is not None and self.clip_index is not None:
            ratio = clip_ratio(float(grads[self.clip_index]), self.clip_after)
            if ratio is not None:
                facts["clip_ratio"] = ratio
        seen = self.loss_read
        pending = self.losses or self.auto_losses
        if len(pending) == 1 and seen is not None and pending[0] is seen[0]:
            step.loss = seen[1]  # the loss read before its backward (the common case)
        elif pending:
            values = self._loss_values()
            step.loss = values[0] if len(values) == 1 else float(np.mean(np.asarray(values, dtype=np.float32)))
        inputs = self.host_inputs
        if self.raw_inputs:
            inputs = list(inputs)
            for x in self.raw_inputs:  # compiled forward passes: measured now
                if x.numel() > 0:
                    inputs.extend(hm.stats(x))
        if inputs:
            step.inputs = inputs
        measures: Optional[Dict[str, np.ndarray]] = None
        act = self.act_staged
        if act is None and self.probes and self.hooks.frozen and self._activations_now():
            self._fill_act_out()  # compiled: the probes are the kept module outputs
            act = hm.activations(self.probes, self.act_out)
        elif act is None and self.probes and (first or self.hooks.probes_armed):
            act = hm.activations(self.probes, self.act_out)
        step.activations = act
        act_sampled = self._sampled(self.activation_every)
        weight_sampled = self._sampled(self.weight_every)
        if self.params and (first or self.out_staged is not None or act_sampled or weight_sampled):
            measures = self._host_sampled(step, first, act_sampled, weight_sampled)
        step.origin = self.origin
        step.checked = self.origin_checked
        step.ran = self.ran
        refs = self.refs
        if first:
            self.hooks.rehook(set(self.param_owner))
        self._feed(step, step, refs, measures, facts or None, self.hooks.modules_armed, flags)

    def _host_sampled(
        self, step: HostStep, first: bool, act_sampled: bool, weight_sampled: bool
    ) -> Optional[Dict[str, np.ndarray]]:
        """Host mode, a sampled step: parameter norms, the largest output of each kept module
        call, and the shares of exactly-zero gradient rows and columns."""
        hm = self.hm
        assert hm is not None
        if weight_sampled:
            step.weight_norms = hm.norms(self.params)
        measures: Dict[str, np.ndarray] = {}
        outs = self.out_staged
        if outs is None and first:
            outs = hm.absmax(self.refs, self.watched.rank)
        if outs is not None:
            measures["output_absmax"] = outs[0] if outs[1] is None else self._module_table(outs[1], outs[0])
        if act_sampled:
            zeros = self.zeros_read if self.zeros_read is not None else hm.zero_shares(self.params)
            if zeros is not None:
                measures["grad_zero_rows"], measures["grad_zero_cols"] = zeros
        return measures or None

    def _consume(self) -> None:
        """Hands the oldest pending (CUDA) step to the engine: at a forward pass when its copy
        is done (``Pending.ready``), else when a third step needs its buffer, at exit, or when
        results are read."""
        p = self.pending
        self.pending, self.later = self.later, None
        if p is None or self.disabled:
            return
        try:
            if p.exchange is not None:
                job = self.dist.receive(p.exchange, p.layout)
                facts = {**(p.layout.facts or {}), **job.facts} or None
                self._feed(p.layout, job, p.refs, job.measures or None, facts)
                return
            if p.event is not None and not p.event.query():
                # Handed over because a third step needs its buffer (or at the end, or for a
                # read of results): the copy is two steps old then; this waits only when the
                # device is more than two steps behind the CPU, and never drains its queue.
                p.event.synchronize()
            assert p.host is not None
            self._ingest(p.layout, p.host, p.refs)
        except Exception as e:
            self._fail(e)

    def flush(self) -> None:
        """Makes every observed step visible to the engine (before results are read)."""
        if self.backward_due:
            self._run_due(halt=False)
        while self.pending is not None:
            self._consume()

    def _ingest(self, layout: Layout, flat: np.ndarray, refs: List[Tuple[int, Any, Any]]) -> None:
        """Host side of one step: unpack the flat vector and feed the engine."""
        u = Unpacked(layout, flat, self.no_grads, len(self.probes))
        self._feed(layout, u, refs, self._measures(layout, flat), {**(layout.facts or {}), **u.facts} or None)

    def _feed(
        self,
        layout: Any,
        u: Any,
        refs: List[Tuple[int, Any, Any]],
        measures: Optional[Dict[str, np.ndarray]],
        facts: Optional[Dict[str, float]],
        recorded: bool = True,
        flags: int = UNKNOWN,
    ) -> None:
        """Feeds the engine one step (``layout``: a :class:`Layout` or :class:`HostStep`) with
        its host arrays (``u``: :class:`Unpacked`, a distributed job's step, or the
        :class:`HostStep`), its measures and its facts."""
        grad_norms = u.grad_norms
        loss_value = u.loss
        # An exactly-zero gradient of a module that ran before but not in this step is "no
        # gradient" (zero_grad(set_to_none=False) leaves zeros), not a vanishing one. When each
        # step's gradients are made anew (set_to_none=True), a module that sat out has none at
        # all and every zero is a real one.
        kept = self.loop.grads_kept is not False
        if kept and flags & (ZERO | UNKNOWN) and self.order and not grad_norms.all():
            ran_before = self.order_set
            owners = self.param_owner
            left = [p for p in np.flatnonzero(grad_norms == 0.0) if owners[p] in ran_before]
            if recorded:
                ran_now = set(layout.ran) if layout.ran is not None else {i for i, _, _ in refs}
            else:
                # Not recorded in this step: unknown, read as "no gradient" (one zero would
                # confirm a vanishing gradient; a layer that really died is seen from the next
                # step on, which records which modules ran).
                ran_now = set()
            if left and self.hm is not None and (self.loop.grads_kept or not recorded):
                self.need_ran = NEED_RAN_STEPS  # the coming steps record which modules ran
            for p in left:
                if owners[p] not in ran_now:
                    grad_norms[p] = -1.0

        nonfinite = None
        if flags & UNKNOWN:
            # "No gradient" is -1, finite: the float64 sum is finite iff every norm is.
            bad_grads = not math.isfinite(float(grad_norms.sum(dtype=np.float64)))
        else:
            bad_grads = bool(flags & NONFINITE)
        suspicious = layout.final or bad_grads or (loss_value is not None and not math.isfinite(loss_value))
        # Whether this step's module outputs were scanned: then "no origin" means they were all
        # finite, and the NaN/Inf came from the loss computation or the backward pass.
        checked = False
        if suspicious and self.forward_check != "off":
            summary = getattr(layout, "summary", None)
            if layout.origin is not None or layout.checked:
                nonfinite, checked = layout.origin, True
            elif summary is not None:
                nonfinite, checked = self.watched.first_nonfinite_summary(summary), True
            elif refs:
                nonfinite, checked = self._scan(refs)

        self.act_pending = self.engine.observe(
            layout.step,
            grad_norms,
            weight_norms=u.weight_norms,
            activations=u.activations,
            inputs=u.inputs,
            loss=loss_value,
            lr=layout.lr,
            nonfinite_module=nonfinite,
            outputs_checked=checked,
            facts=facts,
            measures=measures,
        )
        if self.on_observed is not None:
            self.on_observed(layout.step)

    def _measures(self, layout: Layout, flat: np.ndarray) -> Optional[Dict[str, np.ndarray]]:
        """The named measures at the end of the step's vector (last part last); the summaries of
        the module calls, read into ``layout.summary`` for the non-finite scan."""
        out: Dict[str, np.ndarray] = {}
        end = flat.size
        calls = layout.summary_calls
        if calls is not None and end >= layout.summary_n:
            summary = read_summaries(calls, flat[end - layout.summary_n : end])
            end -= layout.summary_n
            layout.summary = summary
            if layout.summary_out:
                known = [(self.watched.rank[i], v) for i, v, _, _ in summary if i in self.watched.rank and v == v]
                if known:
                    out["output_absmax"] = self._module_table(
                        np.asarray([r for r, _ in known], dtype=np.intp), np.asarray([v for _, v in known], np.float32)
                    )
        index = layout.zero_index
        if index is not None and end >= 2 * index.size:
            k = index.size
            shares = flat[end - 2 * k : end]
            end -= 2 * k
            for name, values in (("grad_zero_rows", shares[:k]), ("grad_zero_cols", shares[k:])):
                table = np.full(len(self.params), np.nan, dtype=np.float32)
                table[index] = values
                out[name] = table
        ranks = layout.out_ranks
        if ranks is not None and ranks.size and end >= ranks.size:
            out["output_absmax"] = self._module_table(ranks, flat[end - ranks.size : end])
        return out or None

    def _module_table(self, ranks: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Per engine module, its largest value (NaN: none); a module called several times in
        the step (a shared block) keeps its largest output."""
        table = np.full(len(self.watched.spec_order), np.nan, dtype=np.float32)
        np.fmax.at(table, ranks, values)
        return table

    def finish(self, crashed: bool) -> None:
        """Called on exit. A step still on its way to the host is handed to the engine. A
        forward pass that never reached ``optimizer.step()`` is observed too (gradients if any,
        inputs, loss, and the forward outputs scanned for NaN/Inf) when the loop raised, or when
        it stopped on its own after that forward went non-finite (``if not
        torch.isfinite(loss): break``), so a run that ended in a failure still leaves its
        diagnosis. A final healthy forward (an evaluation pass) is not a step."""
        self._drop_plain()
        if self.disabled:
            return
        self.flush()
        unobserved = self.forward_gen > self.observed_gen or self.grad_read or bool(self.raw_inputs)
        if unobserved and (crashed or self._pending_failed()):
            self._observe(lr=None, final=True)
            self.flush()

    def _pending_failed(self) -> bool:
        """Whether the forward pass not yet observed produced a NaN/Inf (read at exit only)."""
        torch = self.torch
        try:
            with torch.no_grad():
                for t in [*self.losses, *self.auto_losses, *self.inputs, *self.raw_inputs]:
                    if isinstance(t, float):
                        if not math.isfinite(t):
                            return True
                    elif not bool(torch.isfinite(t).all()):
                        return True
                if not all(math.isfinite(v) for v in self.host_inputs):
                    return True
                vec = self.summaries.vector()
                if vec is not None and not bool(torch.isfinite(vec).all()):
                    return True
                return bool(self.refs) and self.watched.first_nonfinite(self.refs) is not None
        except Exception:  # pragma: no cover - exit must never raise
            return False


DEVICE_PATHS = ("direct", "deferred")


def device_path_override() -> Optional[str]:
    """``NEURALDBG_DEVICE_PATH``: ``deferred`` makes a CPU model take the CUDA code path (one
    float32 vector of torch reductions a step, copied and handed to the engine a step later,
    as on a GPU), ``direct`` the same path with the vector read at once; unset (or ``auto``),
    the path follows the device. The CUDA stand-in the tests and CI run on every commit."""
    import os

    value = os.environ.get("NEURALDBG_DEVICE_PATH", "auto").strip().lower()
    if value in ("", "auto"):
        return None
    if value not in DEVICE_PATHS:
        warnings.warn(
            f"NEURALDBG_DEVICE_PATH={value!r} is not one of auto, {', '.join(DEVICE_PATHS)}: ignored",
            NeuralDbgWarning,
            stacklevel=3,
        )
        return None
    return value


def _functorch_wrapped(x: Any) -> bool:
    """Whether ``x`` is a tensor of a ``torch.func`` transform (vmap, grad): it has no storage
    of its own to read."""
    try:
        from torch._C._functorch import is_functorch_wrapped_tensor

        return bool(is_functorch_wrapped_tensor(x))
    except Exception:  # pragma: no cover - other torch versions
        return False


def _lr_of(optimizer: Any) -> Optional[float]:
    try:
        lr = optimizer.param_groups[0].get("lr")
    except Exception:  # pragma: no cover
        return None
    if isinstance(lr, (int, float)):
        return float(lr)
    import torch

    if isinstance(lr, torch.Tensor) and lr.device.type == "cpu" and lr.numel() == 1:
        return float(lr)
    return None
