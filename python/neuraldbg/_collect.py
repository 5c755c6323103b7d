"""When a step is read: the collector's life over one training run.

The hooks (:mod:`._hooks`: what is hooked) call the collector's entry points; this module
decides when a forward pass starts and ends, which backward is this model's loss, and where one
optimizer step ends and the next begins. What a step gathers meanwhile is one
:class:`~._step.StepState`, replaced when the step has been observed.

How a step is read depends on where the model is, decided until it is registered (its first
step) and fixed after:

* a CPU model in one process: :class:`~._read_host.HostReader` (every statistic read by the
  extension from the tensors' memory into the engine's arrays; its common steps observed by the
  extension's ``PlainStep`` with no Python on their path);
* a model on an accelerator, under torch.distributed, or the CUDA path's stand-in:
  :class:`~._read_device.DeviceReader` (one float32 vector of reductions on the device, moved to
  the host once; deferred a step on CUDA; exchanged across ranks under torch.distributed).

Either ends a step in the :class:`~._sink.Sink` (the engine and the per-step callback). When a
step's gradients or loss are not finite, :class:`~._origin.OriginSearch` names the module
where the forward first went non-finite. This module decides nothing about health.
"""

from __future__ import annotations

import operator
import warnings
from threading import get_ident as _thread_id
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Set, Union

import numpy as np

# Whether dynamo is tracing (torch.compile): hooks then run inside a compiled graph. (This module
# is imported only once torch is, by NeuralDbg.__enter__.)
from torch.compiler import is_compiling as _compiling

from ._boundary import StepBoundary
from ._distributed import PeerLeft, has_shards, local_tensors
from ._guard import REPORT, guarded
from ._hooks import Hooks
from ._loop import LoopFacts, grad_changed, unscaled_loss
from ._measure import Measurer, Probe, Summaries, first_float_tensor
from ._model import WatchedModel, learn_order
from ._origin import OriginSearch
from ._read_device import DeviceReader
from ._read_host import HostReader
from ._sink import Sink
from ._step import Stage, StepState
from ._taps import reaches
from .errors import NeuralDbgWarning

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


class Collector:
    """Installs hooks on one model and feeds a ``neuraldbg._native.Engine``."""

    def __init__(
        self,
        model: torch.nn.Module,
        engine: Any,
        *,
        criterion: Optional[torch.nn.Module],
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
        # The loop updates the weights itself, with no torch optimizer: steps end at the end of
        # each backward pass (see StepBoundary.updated_by_hand), until an optimizer steps them.
        self.by_hand = False
        # Entered between an iteration's forward pass and its backward (``neuraldbg run`` finds a
        # loop that updates by hand at its first backward): that backward's gradients are of a
        # forward of the model that no hook saw.
        self.joined_in_backward = False
        # Parameters whose optimizer maximizes (``maximize=True``): their steps go up the
        # gradient on purpose.
        self.maximized: Set[int] = set()
        self.on_observed = on_observed
        self.any_autocast = _any_autocast
        # Whether the host reader's common steps may be observed by the extension's PlainStep
        # (off only for neuraldbg.testing.spy_engine: PlainStep calls the engine itself).
        self.fast_path = True
        # The reader a test chose (neuraldbg.testing.device_path), whatever the device.
        self.forced_reader: Optional[DeviceReader] = None

        # Set before anything can fail: the guard (see _guard.py) reads them.
        self.disabled = False
        self.registered = False
        self.raising: Optional[BaseException] = None
        # Why monitoring stopped before the run ended (None: it did not).
        self.internal_error: Optional[BaseException] = None
        self.step = 0
        # Steps of the model's optimizer that found no forward pass and no gradient of the model
        # since the last step (counted while no step was observed: the loop trains another model).
        self.idle_steps = 0
        self.cur = StepState()
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
        # NEURALDBG_DEVICE_PATH (see device_path_override) makes a CPU model take the device path.
        forced = device_path_override()
        self.forced_device = forced is not None
        self.accelerator = not all(p.device.type == "cpu" for p in self.params)
        # (module index, output, positional args) of every hooked module call of the current
        # forward, in completion order (the hooks append to this list).
        self.refs: List[Any] = []
        # The device path's summaries of the module calls of the current forward pass:
        # they replace kept calls where device memory is at stake (a model on an accelerator,
        # or the CUDA path's CPU stand-in).
        self.summaries = Summaries()
        summarize = (self.accelerator or self.forced_device) and forward_check != "off"
        self.hooks = Hooks(
            self.watched.modules,
            self.refs,
            keep_outputs=forward_check != "off",
            unhookable={i for i, s in enumerate(self.watched.scripted) if s},
            summaries=self.summaries if summarize else None,
        )
        # Latest output of each activation probe in this step (by probe row).
        self.act_out: List[Any] = []
        self.act_none: List[Any] = []
        self.probes: List[Probe] = []
        self.reader: Union[HostReader, DeviceReader] = DeviceReader(
            self, None if forced is None else forced == "deferred"
        )
        self.sink = Sink(self)
        self.boundary = StepBoundary(self)
        self.origin_search = OriginSearch(self)
        self.decide_reader()
        self.order: Optional[List[int]] = None
        self.order_set: set = set()
        # Reading points (see on_backward_end): a backward pass that gave the model gradients
        # queues one callback for its end; under torch.distributed it is queued once more, to
        # run after the job's own reduction.
        self.bw_queued = False
        self.bw_deferred = False
        # The parameter whose gradient norm is read again just before the update (the largest
        # up to 64k elements): against the backward's reading, it tells whether gradients were
        # clipped.
        self.clip_index: Optional[int] = None
        # The GradScaler whose step() is running (mixed precision), if any.
        self.scaler: Any = None
        self.blind_warned = False
        # An exception to raise into the training loop once the current step is handled
        # (halt_on's TrainingFailure, or the user's on_failure error).
        self.halt: Optional[BaseException] = None
        from torch.autograd import Variable

        self._queue_callback = Variable._execution_engine.queue_callback
        # The entry points torch calls, each under the guard (see _guard.py).
        self.entry_forward_pre = guarded(self, "forward_pre", self.on_forward_pre)
        self.entry_forward_post = guarded(self, "forward_post", self.on_forward_post)
        self.entry_criterion = guarded(self, "criterion", self.on_criterion)
        self.entry_grad_ready = guarded(self, "grad_ready", self.on_grad_ready)
        self.entry_backward_end = guarded(self, "backward_end", self.on_backward_end)
        self.entry_backward_start = guarded(self, "backward_start", self.on_backward)
        self.entry_backward_done = guarded(self, "backward_done", self.after_backward)
        self.entry_optimizer_step = guarded(self, "optimizer_step", self.boundary.on_optimizer_step)
        self.entry_scaler_step = guarded(self, "scaler_step", self.boundary.on_scaler_step)
        self.entry_scaler_step_done = guarded(self, "scaler_step_done", self.boundary.on_scaler_step_done)
        self.entry_record_loss = guarded(self, "record_loss", self.record_loss)
        self.relevant: Dict[int, bool] = {}
        self.optimizer_name: Optional[str] = None
        # Host mode: whether a forward can be computed again from the model's own calls (False
        # for good when the model itself is not called, or an Embedding has max_norm), and
        # steps left that record which modules ran (exact-zero gradients were seen).
        self.replay_ok = self.watched.replayable()
        self.need_ran = 0
        # The engine's activation_pending after the last observed step (see activations_next).
        self.act_pending = False

    # -------------------------------------------------------------- the reader

    def decide_reader(self) -> None:
        """The host reader or the device reader, from where the parameters are now (until the
        model is registered: a model moved to its device after ``NeuralDbg`` was entered is
        seen there)."""
        if self.forced_reader is not None:
            self.reader = self.forced_reader
            self.reader.hold_outputs()
            return
        host = (
            not self.forced_device
            and self.dist is None
            and not self.sharded
            and all(p.device.type == "cpu" for p in self.params)
        )
        if host and not self.reader.host:
            self.reader = HostReader(self)
        elif not host:
            if self.reader.host:
                self.reader = DeviceReader(self, None)
            self.accelerator = not all(p.device.type == "cpu" for p in self.params)
            self.reader.hold_outputs()

    def summarized(self) -> bool:
        """Whether this step's module calls are summarized on the device instead of kept (the
        device path on an accelerator or its stand-in, once registered, outputs checked)."""
        return (
            not self.reader.host
            and self.registered
            and self.forward_check != "off"
            and (self.accelerator or self.forced_device)
        )

    def autocast_on(self) -> bool:
        return bool(_any_autocast() and self.torch.is_autocast_enabled("cpu"))

    # ----------------------------------------------------------------- installation

    def install(self) -> None:
        self.hooks.install(self, self.params)

    def remove(self) -> None:
        self.reader.drop()
        self.hooks.remove(self)
        self.loop.remove()
        self.refs.clear()
        self.act_out[:] = self.act_none
        self.cur = StepState()
        self.scaler = None

    # ----------------------------------------------------------------- forward

    def new_forward(self) -> None:
        """A forward pass of the model starts: the previous one's calls go."""
        s = self.cur
        s.forwards += 1
        s.stage = Stage.FORWARD
        s.ran = None
        self.refs.clear()
        if self.hooks.probes_armed:
            self.act_out[:] = self.act_none

    def on_forward_pre(self, module: Any, args: Any, kwargs: Any) -> None:
        if _compiling():
            # Traced into a compiled graph: keep references only. Reading the collector's
            # state here would become a guard (a recompile whenever it changes).
            self.hooks.trace.compiled = True
            self.refs.clear()
            self.summaries.clear()
            self.cur.raw_inputs.clear()
            x = first_float_tensor(args)
            if x is not None:
                self.cur.raw_inputs.append(x)
            return
        self.thread = _thread_id()
        if self.step == 0 and (self.cur.root_seen or self.joined_in_backward) and self.boundary.updated_by_hand():
            # This forward begins the second iteration: the first, stepped by hand, is step 0.
            # (Gradients of no forward pass of the model are not an iteration of its loop.)
            self.step_on, self.by_hand = "backward", True
            self.boundary.backward_step()
            self.loop.forget_gradient()  # (seen after the loop may have zeroed it, not at its backward's end)
        if self.backward_due:
            self.boundary.run_due()
        if _functorch_active():
            self._functional_forward()
            return
        reader = self.reader
        plain = reader.plain  # (None when disabled)
        if plain is not None and plain.forward(module, args, kwargs):
            return
        if self.disabled:
            return
        if self.registered and isinstance(reader, HostReader):
            reader.take_forward(module, args, kwargs)
            return
        if not self.registered:
            self.decide_reader()
            reader = self.reader
        if isinstance(reader, DeviceReader):
            reader.forward_starts()
        self.new_forward()
        self.summaries.clear()
        self.loop.on_forward(module.training, self.torch.is_grad_enabled())
        self.cur.root_seen = True
        try:
            x = first_float_tensor(args)
            if x is None and kwargs:
                x = first_float_tensor(kwargs)
            if x is not None and x.numel() > 0:
                self._read_inputs(x)
        except Exception as e:  # pragma: no cover - defensive
            self.fail("observation", e)

    def on_forward_post(self, module: Any, args: Any, output: Any) -> None:
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
            self.reader.clear_outputs()
            return
        if self.hooks.hold[0] is self.summaries:
            self.refs.append((0, None, None))
            self.summaries(0, output, args)
        else:
            self.refs.append((0, output, args))
        # The output's grad_fn: which backward is this model's loss (no criterion given; host
        # mode needs none once registered, see on_backward), and, on the first step, where
        # the loss's graph reaches the model (the loss facts).
        if not self.registered or (self.criterion is None and not self.reader.host):
            t = first_float_tensor(output)
            fn = t.grad_fn if t is not None else None
            fns = self.cur.output_fns
            if fn is not None and len(fns) < 8:
                fns.append(fn)
                if not self.registered and self.loop.first_output is None:
                    self.loop.first_output = t
        if self.order is None:
            self.order, self.order_set = learn_order(self.refs)

    def _functional_forward(self) -> None:
        """A forward pass inside a ``torch.func`` transform (``vmap(grad(functional_call))``):
        its tensors have no storage to read, so it is not observed; the gradients the loop
        sets and the optimizer steps are. Said once."""
        self.cur.forwards += 1  # (a forward happened: its optimizer step is a step)
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

    # ------------------------------------------------------------------- loss

    def on_criterion(self, module: Any, args: Any, output: Any) -> None:
        if isinstance(output, self.torch.Tensor) and output.numel() == 1:
            # Detached: a loss computed without backward (evaluation) must not hold its graph.
            self.cur.losses.append(output.detach())
            if _compiling():
                # Traced into a compiled train step: nothing more (reading the collector's state
                # would become a guard, walking the loss's graph a graph break; a compiled
                # graph's autograd node shows nothing of the loss's operations anyway).
                return
            if not self.registered:
                self.loop.describe_loss(output, self.cur.output_fns)
            self.on_loss(output)

    def record_loss(self, loss: Any) -> None:
        if self.disabled:
            return
        torch = self.torch
        if isinstance(loss, torch.Tensor):
            if loss.numel() != 1:
                loss = loss.detach().float().mean()
            self.cur.losses.append(loss.detach())
        else:
            # A number stays on the host: a tensor made of it would be copied to the device
            # from pageable memory, which waits for the device's queue.
            self.cur.losses.append(float(loss))

    def on_loss(self, loss: torch.Tensor) -> None:
        """The loss of a forward pass exists, so that forward is complete: measure its sampled
        statistics now (its outputs are still hot in cache) and release them. When reading the
        loss costs no wait (a CPU loss), a finite one releases the kept module outputs before
        backward starts, as a plain loop would have; a NaN/Inf one has them scanned now."""
        if self.disabled or not self.registered or self.cur.stage is not Stage.FORWARD:
            return
        try:
            self.release_forward(self.reader.loss_nonfinite(loss))
        except Exception as e:  # pragma: no cover - defensive
            self.fail("observation", e)

    def release_forward(self, nonfinite: Optional[bool]) -> None:
        """The forward pass is complete: its sampled statistics are staged and, when whether it
        went non-finite is known (``nonfinite`` not None), a non-finite one has its kept module
        outputs scanned for the origin, then they are let go. Otherwise (CUDA) they wait for
        the observation."""
        s = self.cur
        s.stage = Stage.RELEASED
        if self.hooks.probes_armed:
            self.reader.stage_forward()
            self.act_out[:] = self.act_none
        self._entry_inputs()
        if nonfinite is None or self.forward_check == "off":
            return
        if nonfinite and s.origin is None and self.refs:
            s.origin, s.origin_checked = self.origin_search.scan(self.refs)
        s.ran = list(map(_FIRST, self.refs))
        self.refs.clear()
        s.released = len(s.root_calls)

    def _read_inputs(self, x: Any) -> None:
        """The model's input batch: its statistics for this step and, until the model is
        registered, the first batch's per-feature scales."""
        self.reader.input_stats(x)
        if not self.registered:
            self.loop.note_input(x)

    def _entry_inputs(self) -> None:
        """The model itself was not called in this step (a LightningModule whose
        ``training_step`` calls ``self.net(x)``): its batch is read where it first entered a
        watched module, the inputs of the first module call recorded. Nothing when the model's
        own call was seen or an input was read already."""
        s = self.cur
        if s.root_seen or s.raw_inputs or s.host_inputs or s.inputs or not self.refs:
            return
        for _, _, args in self.refs:
            x = first_float_tensor(args) if args is not None else None
            if x is None or x.numel() == 0:
                continue
            if _functorch_wrapped(x):
                return
            self._read_inputs(x)
            return

    # --------------------------------------------------------------- backward

    def on_backward(self, tensors: Any) -> Any:
        """A ``backward()`` started somewhere in the process: keep its tensor if it is a scalar
        whose graph reaches this model's output (the loss of this model, not of another).
        Taken here, before backward runs, the forward's outputs go first (CPU); a loss this
        misses (a compiled forward, a LightningModule whose step calls a submodule) is taken
        when the backward reaches the model's parameters.

        When the gradients are read at the tap (``Hooks.tap_reads``), returns what
        :meth:`after_backward` compares with when the backward has returned (True: the loss
        of a plain step, taken by the extension's PlainStep)."""
        reader = self.reader
        plain = reader.plain  # (None when disabled, not registered, or not in host mode)
        if plain is not None and plain.backward(tensors):
            return True
        if self.disabled:
            return None
        if self.registered and isinstance(reader, HostReader):
            # Host mode: the forward's work is done now, before its backward, without walking
            # the graph to prove this is the model's loss: the loss itself is taken at the
            # backward's end (the tensor whose backward gave the parameters gradients).
            reader.take_loss(tensors)
            if not self.hooks.tap_reads:
                return None
            params = self.params
            marks = []
            for k in self.hooks.sentinels:
                g = params[k].grad
                marks.append((k, g, None if g is None else g._version))
            return marks, self.loop.before_backward()
        s = self.cur
        if not isinstance(tensors, self.torch.Tensor) or not s.output_fns:
            return None
        fn = tensors.grad_fn
        if fn is None or tensors.numel() != 1 or not reaches(fn, s.output_fns):
            return None
        s.auto_losses.append(unscaled_loss(tensors))
        s.tap_taken = tensors
        if not self.registered:
            self.loop.describe_loss(tensors, s.output_fns)
        self.on_loss(tensors)
        return None

    def after_backward(self, marks: Any) -> None:
        """A backward pass the tap saw has returned (``Hooks.tap_reads``): if it changed a
        sentinel's gradient, it gave the model gradients, and its end is their reading point.
        ``marks`` True: the backward of a plain step's loss, the extension's."""
        if marks is True:
            plain = self.reader.plain
            if plain is not None:
                plain.after_backward()
            return
        if marks is None:
            self.boundary.run_due()
            return
        sentinels, probe = marks
        params = self.params
        reached = False
        for k, g, version in sentinels:
            if grad_changed(params[k], g, version):
                reached = True
                break
        if probe is not None:
            self.loop.after_backward(probe)
        if reached:
            self.on_backward_end()  # (a halt it raises goes to the loop, as from the hooks)

    def on_grad_ready(self, k: int) -> None:
        """Parameter ``k``'s gradient was accumulated: once per backward pass, have the
        gradients read when that backward pass ends (every parameter's gradient is final then)."""
        if self.bw_queued or self.disabled:
            return
        self.bw_queued = True
        try:
            self._queue_callback(self.entry_backward_end)
        except Exception:  # pragma: no cover - outside the autograd engine
            self.bw_queued = False
            raise

    def on_backward_end(self) -> None:
        """A backward pass gave the model gradients and has just ended: the reading point of
        the gradients, exactly what the backward produced, before any clipping, unscaling or
        optimizer touches them. With accumulation each backward reads again; the last reading
        before the optimizer step is the step's."""
        if self.dist is not None and not self.bw_deferred and not self.disabled:
            # DDP and FSDP reduce the gradients in end-of-backward callbacks of their own,
            # queued during the backward pass: queued again now, this reading runs after them.
            self.bw_deferred = True
            self._queue_callback(self.entry_backward_end)
            return
        self.bw_deferred = False
        self.bw_queued = False
        if self.disabled:
            return
        if not self.registered:
            self.decide_reader()
        if self.step == 0 and not self.cur.root_seen and self.refs and self.boundary.updated_by_hand():
            # A loop that calls the model's modules, never the model (``model.encode(x)``), and
            # updates the weights by hand: found at its second backward, whose iteration is step 1
            # (the module calls recorded since the first are kept for it).
            self.step_on, self.by_hand = "backward", True
            calls = list(self.refs)
            self.boundary.backward_step()
            self.refs.extend(calls)
        self.cur.take_loss(self.tap_current, self.criterion is not None)
        self.reader.read_gradients()
        self.reader.check_after_backward()
        if self.step_on != "backward" and self.params and self.boundary.update_due():
            weights = local_tensors(self.params) if self.sharded else self.params
            self.cur.weights_before = self.measure.weights_before(weights)
            self.cur.grads_before = self.measure.grads_at([w.grad for w in weights], self.cur.weights_before)
        if self.step_on == "backward":
            if self.thread is not None and _thread_id() != self.thread:
                # Autograd's device thread (CUDA): the engine is fed from the training thread,
                # when the backward returns there or at the next forward pass.
                self.backward_due = True
                return
            self.boundary.backward_step()

    # ------------------------------------------------------------ optimizer step

    # ------------------------------------------------------------------ failure

    def raise_halt(self) -> None:
        """Raises a pending halt into the training loop (from the step that confirmed it); the
        guard lets it through (``raising``)."""
        if self.halt is not None:
            e, self.halt = self.halt, None
            self.raising = e
            raise e

    def fail(self, entry: str, e: BaseException) -> None:
        """Monitoring broke at ``entry`` (see _guard.py): say so once and stop, leaving training
        untouched. What was observed until then stays in the engine and the trace."""
        if self.disabled:
            return
        self.internal_error = e
        self.disabled = True
        self.reader.stop()
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
        warnings.warn(f"{who} {message}", NeuralDbgWarning, stacklevel=3)


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
