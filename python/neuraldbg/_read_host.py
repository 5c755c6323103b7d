"""The host reader: how a step of a CPU model in one process is read.

Every statistic is read by the extension from the tensors' memory straight into the arrays the
engine takes (:class:`~._measure_host.HostMeasurer`): no torch operation, no vector, no transfer.
The model's module hooks and records are there only on the steps that need them
(:meth:`Collector.modules_wanted`); a step that went non-finite without them has its forward
computed again (``WatchedModel.replay``).

The common step (registered, nothing sampled, the loss taken and the gradients read at the
backward tap) is observed by the extension's ``PlainStep`` with no Python of ours on its path.
It talks to this reader through the :class:`~._native.PlainHost` protocol: what it saw of a
step it does not finish is handed over (:meth:`HostReader.take_forward`, :meth:`take_loss`,
:meth:`take_grads`), and a step it observed is reported (:meth:`plain_done`).
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

from ._loop import unscaled_loss
from ._measure import first_float_tensor
from ._measure_host import HostMeasurer
from ._step import NONFINITE, UNKNOWN, ZERO, Stage
from ._transfer import HostStep, clip_ratio, per_parameter

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector

# The kept reference of a call of the model itself on a step that hooks no module.
_ROOT_CALL = (0, None, None)


class HostReader:
    """Reads the steps of a CPU model on the host; implements ``_native.PlainHost``."""

    host = True

    def __init__(self, c: Collector) -> None:
        self.c = c
        self.hm = HostMeasurer(c.measure, len(c.params))
        # The output maxima of recorded layers, read by the extension as they return on a
        # sampled step (the layer-class wrapper calls it), and the outputs it could not read.
        self.out_kept: List[Tuple[int, Any, Any]] = []
        self.maxima: Any = None
        if self.hm.reader is not None:
            from ._native import OutputMaxima

            self.maxima = OutputMaxima(self.hm.reader, self.out_kept)
        # This step's gradient norms are read into this buffer.
        self.grad_buf = np.empty(len(c.params), dtype=np.float32)
        # The extension's PlainStep (see make_plain), and the optimizer whose steps it may take.
        self.plain: Any = None
        self.plain_optimizer: Any = None

    # -------------------------------------------------------- PlainHost protocol

    @property
    def step(self) -> int:
        return self.c.step

    def fail(self, e: BaseException) -> None:
        self.c.fail("observation", e)

    def backward_end(self) -> None:
        """A backward the extension took ended with gradients it does not judge itself."""
        self.c.on_backward_end()

    def backward_returned(self, marks: Any) -> None:
        """A backward the extension took reached none of the model's gradients: the collector's
        way, from the marks it would have taken."""
        self.c.after_backward(marks)

    def take_forward(self, module: Any, args: Any, kwargs: Any, seen: Optional[Tuple[bool, bool, Any]] = None) -> None:
        """A forward pass of the model starts (registered; the hot path of the collector's
        forward pre-hook). ``seen``: ``(module.training, torch.is_grad_enabled(), input
        statistics or None)`` as they were when the forward ran, no autocast on (a forward the
        extension's PlainStep saw, handed over later)."""
        c = self.c
        s = c.cur
        c.new_forward()
        hooks = c.hooks
        if hooks.probes_armed:
            self.out_kept.clear()
            if self.maxima is not None:
                self.maxima.clear()
        torch = c.torch
        if seen is None:
            c.loop.on_forward(module.training, torch.is_grad_enabled())
        else:
            c.loop.on_forward(seen[0], seen[1])
        s.root_seen = True
        s.root_calls.append((args, kwargs))
        if seen is None and c.autocast_on():
            if not hooks.modules_armed:
                hooks.arm_modules(True)  # a replay would lack the autocast precision
            self.hold_outputs(True)
        elif hooks.modules_armed:
            self.hold_outputs(False)
        else:
            # No module hook, not even the model's forward hook: its call is recorded now
            # (what that hook records, less the output, which a replay computes again).
            c.refs.append(_ROOT_CALL)
        try:
            # The model's first input, read by the extension (a float CPU tensor, the common
            # case); anything else goes the general way.
            if seen is not None:
                v = seen[2]
            else:
                x = args[0] if args else None
                reader = self.hm.reader
                v = reader.stats(x) if reader is not None and type(x) is torch.Tensor else None
            if v is None:
                x = first_float_tensor(args)
                if x is None and kwargs:
                    x = first_float_tensor(kwargs)
                if x is not None and x.numel() > 0:
                    v = self.hm.stats(x)
            if v is not None:
                s.host_inputs.extend(v)
        except Exception as e:  # pragma: no cover - defensive
            self.fail(e)

    def take_loss(self, tensors: Any) -> None:
        """A backward of ``tensors`` starts; a scalar is taken as the loss of the forward seen.
        A product may be GradScaler's scaled loss: its unscaled value is kept now, before
        backward frees its scale."""
        c = self.c
        if c.refs and isinstance(tensors, c.torch.Tensor) and tensors.numel() == 1:
            if type(tensors.grad_fn).__name__ == "MulBackward0":
                c.cur.tap_product = (tensors, unscaled_loss(tensors))
            c.on_loss(tensors)

    def take_grads(self, loss: Any, flags: int, clip_seen: Any, accumulated: Optional[bool]) -> None:
        """A plain step's gradients, handed over by the extension's PlainStep: what the end of
        that backward made of them at the tap (the loss taken, the norms read)."""
        s = self.c.cur
        s.tap_taken = None
        s.tap_product = None
        seen = s.loss_read
        if loss is not None and seen is not None and seen[0] is loss:
            s.auto_losses.append(loss)
        self.grads_read(flags, None, clip_seen)
        if accumulated is not None:
            self.c.loop.accumulated = accumulated

    def plain_done(self, pending: Optional[bool], step: int) -> bool:
        """The extension's PlainStep observed step ``step`` (``pending``: the engine's answer,
        None when observing it failed). Returns whether the coming step may be a plain one too."""
        c = self.c
        if pending is not None:
            c.act_pending = pending
            try:
                if c.on_observed is not None:
                    c.on_observed(step)
            except Exception as e:
                self.fail(e)
        if c.boundary.next_step():
            return self.plain_next()
        # Nothing armed: what plain_next asks held for this step (a plain one), and nothing
        # sampled comes, so the coming step is plain unless its weights are measured.
        return self.plain is not None and c.step % c.weight_every != 0

    # --------------------------------------------------------------- the fast path

    def make_plain(self) -> None:
        """The extension's ``PlainStep`` (see ``crates/neuraldbg-py/src/plain.rs``), for a CPU
        model read by the extension, its loss taken and gradients read at the backward tap.
        Made again when the sentinels change; None otherwise."""
        self.plain = None
        c = self.c
        hm = self.hm
        if hm.reader is None or not c.fast_path or not c.hooks.tap_reads or c.criterion is not None:
            return
        from ._native import PlainStep

        self.plain = PlainStep(
            self,
            hm.reader,
            c.engine,
            c.params,
            self.grad_buf,
            c.loop,
            list(c.hooks.sentinels),
            c.clip_index,
            c.torch.Tensor,
            c.torch.is_grad_enabled,
            c.any_autocast,
        )

    def drop_plain(self) -> None:
        """No more plain steps: a step the extension's PlainStep was taking is handed over."""
        plain, self.plain = self.plain, None
        if plain is not None:
            plain.arm(False)

    def plain_next(self) -> bool:
        """Whether the coming step may be a plain one: nothing sampled or hooked in it (what
        :meth:`plain_step` asks of a step, known before it starts)."""
        c = self.c
        hooks = c.hooks
        return (
            self.plain is not None
            and not c.disabled
            and self.plain_optimizer is not None
            and not hooks.probes_armed
            and not hooks.modules_armed
            and not hooks.frozen
            and c.scaler is None
            and c.forward_check != "off"
            and c.boundary.unsampled()
            and not c.act_pending
        )

    def plain_step(self, optimizer: Any) -> bool:
        """The step boundary of the common host step in one function: registered, nothing
        sampled in it or armed for it, no GradScaler, finite loss and gradients, every gradient
        norm read by the extension (what :meth:`observe` and the sink do then, without their
        calls and checks). False, having done nothing, when the step is not such a step."""
        c = self.c
        s = c.cur
        flags = s.grad_flags
        if (
            flags & (NONFINITE | UNKNOWN)
            or (flags & ZERO and c.loop.grads_kept is not False)
            or c.disabled
            or c.hooks.probes_armed
            or c.hooks.frozen
            or s.act_staged is not None
            or s.out_staged is not None
            or s.raw_inputs
            or c.scaler is not None
            or not s.forwards
            or not c.boundary.unsampled()
        ):
            return False
        grads = s.grad_host
        if grads is None:
            return False
        seen = s.loss_read
        pending = s.loss_pending()
        if len(pending) == 1 and seen is not None and pending[0] is seen[0]:
            loss: Optional[float] = seen[1]
        elif not pending:
            loss = None
        else:
            return False
        if loss is not None and not math.isfinite(loss):
            return False
        try:
            facts = c.loop.step_facts()
            self.read_clipped()
            self._clip_fact(facts, grads)
            step = c.step
            c.act_pending = c.engine.observe(
                step, grads, None, None, s.host_inputs or None, loss, lr_of(optimizer), None, False, facts or None, None
            )
            if c.on_observed is not None:
                c.on_observed(step)
        except Exception as e:
            self.fail(e)
        finally:
            c.boundary.end_step(False)
        c.boundary.next_step()
        if self.plain is not None:
            self.plain.arm(self.plain_next())
        return True

    # ------------------------------------------------------------------ reading

    def hold_outputs(self, autocast: bool = False) -> None:
        """What recorded layers keep (see ``_hooks.make_record``): under CPU autocast their
        outputs and inputs (whose precision a replay would not have); no tensor when the
        model's forward can be replayed (a sampled step reads each output's largest magnitude
        as the layer returns), else their inputs, and their outputs when measured."""
        c = self.c
        hold = c.hooks.hold
        if autocast:
            hold[0] = True
        elif not c.replay_ok:
            hold[0] = c.hooks.probes_armed
        elif c.hooks.probes_armed:
            hold[0] = self.maxima if self.maxima is not None else self._keep_output
        else:
            hold[0] = None

    def _keep_output(self, index: int, output: Any, args: Any = None) -> None:
        """A recorded layer returned on a sampled step without the extension's reader: its
        output is kept and measured with the others."""
        self.out_kept.append((index, output, None))

    def clear_outputs(self) -> None:
        self.out_kept.clear()
        if self.maxima is not None:
            self.maxima.clear()

    def read_gradients(self) -> None:
        """The gradient norms of every parameter into ``grad_buf`` (with the zero-gradient
        shares on a sampled step, in the same pass)."""
        c = self.c
        n = len(c.params)
        zeros = (np.empty(n, np.float32), np.empty(n, np.float32)) if c.boundary.sampled(c.activation_every) else None
        flags = self.hm.grad_norms(c.params, self.grad_buf, zeros)
        clip_seen = None
        if c.clip_index is not None:
            # The clipping check's gradient as read, and its version: unchanged at the
            # optimizer step, nothing rescaled it (see read_clipped).
            g = c.params[c.clip_index].grad
            clip_seen = (g, getattr(g, "_version", None)) if g is not None else None
        self.grads_read(flags, zeros, clip_seen)

    def grads_read(self, flags: int, zeros: Any, clip_seen: Any) -> None:
        """The gradient norms are in ``grad_buf`` (``flags``: what they hold)."""
        s = self.c.cur
        s.grad_flags = flags
        s.zeros_read = zeros if zeros is not None and not flags & UNKNOWN else None
        s.grad_host = self.grad_buf
        s.grad_read = True
        s.clip_seen = clip_seen

    def grads_finite(self) -> bool:
        """Whether every gradient norm read in this step is finite."""
        s = self.c.cur
        if s.grad_flags & UNKNOWN:
            assert s.grad_host is not None
            return math.isfinite(float(s.grad_host.sum(dtype=np.float64)))
        return not s.grad_flags & NONFINITE

    def loss_values(self) -> List[float]:
        """The values of this step's losses (the one read before backward is not read again)."""
        seen = self.c.cur.loss_read
        return [
            t if isinstance(t, float) else seen[1] if seen is not None and t is seen[0] else self.hm.scalar(t)
            for t in self.c.cur.loss_pending()
        ]

    def loss_nonfinite(self, loss: Any) -> bool:
        """Reads the loss (kept with its value: not read again at the boundary)."""
        value = self.hm.scalar(loss)
        self.c.cur.loss_read = (loss, value)
        return not math.isfinite(value)

    def check_after_backward(self) -> None:
        """A backward ended with no release before it (no loss seen then; or the model itself
        was not called): a non-finite loss or gradient has the outputs scanned now, while the
        parameters are unchanged."""
        c = self.c
        s = c.cur
        if c.registered and c.refs and (s.stage is Stage.FORWARD or not s.root_seen):
            bad = not self.grads_finite() or not all(math.isfinite(v) for v in self.loss_values())
            c.release_forward(bad)

    def stage_forward(self) -> None:
        """The forward is complete, on a sampled step: its activation and output statistics."""
        c = self.c
        c.cur.act_staged = self.hm.activations(c.probes, c.act_out)
        c.cur.out_staged = self._outputs()

    def _outputs(self) -> Optional[Tuple[np.ndarray, None]]:
        """The largest magnitude of each module's outputs, as the engine's per-module table
        ``(table, None)``: read by the extension as recorded layers returned, and of the
        outputs kept (by hooks on modules of other classes, or not readable then)."""
        c = self.c
        kept = c.refs + self.out_kept if self.out_kept else c.refs
        base = self.hm.absmax([r for r in kept if r[1] is not None], c.watched.rank)
        self.out_kept.clear()
        if self.maxima is None:
            return None if base is None else (c.watched.module_table(base[1], base[0]), None)
        table = self.maxima.table(c.watched.rank_of, len(c.watched.spec_order), *(base or (None, None)))
        return None if table is None else (table, None)

    def input_stats(self, x: Any) -> None:
        self.c.cur.host_inputs.extend(self.hm.stats(x))

    def read_clipped(self) -> None:
        """The clipping check's gradient as the optimizer received it: the same tensor at the
        same version as read at the end of backward is what the backward produced (in-place
        rescaling bumps the version); else it is read again."""
        c = self.c
        k = c.clip_index
        if k is None:
            return
        s = c.cur
        seen, s.clip_seen = s.clip_seen, None
        grads = s.grad_host
        if seen is not None and seen[1] is not None and grads is not None:
            g = c.params[k].grad
            if g is seen[0] and getattr(g, "_version", None) == seen[1]:
                s.clip_after = float(grads[k])
                return
        s.clip_after = self.hm.norm(c.params[k], "grad")

    def _clip_fact(self, facts: Dict[str, float], grads: np.ndarray) -> None:
        """The ``clip_ratio`` fact: the checked gradient's norm as the optimizer received it
        over its norm when the backward produced it."""
        k = self.c.clip_index
        after = self.c.cur.clip_after
        if after is not None and k is not None:
            ratio = clip_ratio(float(grads[k]), after)
            if ratio is not None:
                facts["clip_ratio"] = ratio

    # -------------------------------------------------------------- observation

    def observe(self, lr: Optional[float], final: bool, first: bool, skipped: bool) -> None:
        """The step's statistics, computed into host arrays, to the sink."""
        c = self.c
        s = c.cur
        hm = self.hm
        facts = c.loop.step_facts()
        if not s.grad_read:
            self.read_gradients()
        if s.grad_host is not None:
            grads, flags = s.grad_host, s.grad_flags
        else:
            grads, flags = c.no_grads.copy(), UNKNOWN
        if c.scaler is not None:
            scale = getattr(c.scaler, "_scale", None)
            if isinstance(scale, c.torch.Tensor):
                # Read at the end of backward, the gradients were scaled: unscale the norms.
                inv = np.float32(1.0 / float(scale))
                grads, flags = np.where(grads >= 0, grads * inv, grads).astype(np.float32), UNKNOWN
                facts["loss_scale"] = float(scale)
                facts["optimizer_skipped"] = 1.0 if skipped else 0.0
        step = HostStep(c.step, lr, final, grads)
        self._clip_fact(facts, grads)
        seen = s.loss_read
        pending = s.loss_pending()
        if len(pending) == 1 and seen is not None and pending[0] is seen[0]:
            step.loss = seen[1]  # the loss read before its backward (the common case)
        elif pending:
            values = self.loss_values()
            step.loss = values[0] if len(values) == 1 else float(np.mean(np.asarray(values, dtype=np.float32)))
        inputs = s.host_inputs
        if s.raw_inputs:
            inputs = list(inputs)
            for x in s.raw_inputs:  # compiled forward passes: measured now
                if x.numel() > 0:
                    inputs.extend(hm.stats(x))
        if inputs:
            step.inputs = inputs
        act = s.act_staged
        if act is None and c.boundary.probes_due(first):
            act = hm.activations(c.probes, c.act_out)
        step.activations = act
        act_sampled = c.boundary.sampled(c.activation_every)
        weight_sampled = c.boundary.sampled(c.weight_every)
        measures: Optional[Dict[str, np.ndarray]] = None
        if c.params and (first or s.out_staged is not None or act_sampled or weight_sampled):
            measures = self._sampled_measures(step, first, act_sampled, weight_sampled)
        step.origin = s.origin
        step.checked = s.origin_checked
        step.ran = s.ran
        refs = c.refs
        if first:
            c.hooks.rehook(set(c.param_owner))
        c.sink.feed(step, step, refs, measures, facts or None, c.hooks.modules_armed, flags)

    def _sampled_measures(
        self, step: HostStep, first: bool, act_sampled: bool, weight_sampled: bool
    ) -> Optional[Dict[str, np.ndarray]]:
        """A sampled step: parameter norms and how far the step moved them, the largest output
        of each kept module call, and the shares of exactly-zero gradient rows and columns."""
        c = self.c
        hm = self.hm
        measures: Dict[str, np.ndarray] = {}
        if weight_sampled:
            step.weight_norms = hm.norms(c.params)
            before = c.cur.weights_before
            moved = c.measure.updates(c.params, before, c.cur.grads_before or (), c.maximized) if before else None
            if moved is not None:
                measures["update_ratio"] = per_parameter(len(c.params), moved.params, moved.ratio.numpy())
                if moved.direction is not None:
                    measures["update_direction"] = per_parameter(len(c.params), moved.params, moved.direction.numpy())
        outs = c.cur.out_staged
        if outs is None and first:
            outs = hm.absmax(c.refs, c.watched.rank)
        if outs is not None:
            measures["output_absmax"] = outs[0] if outs[1] is None else c.watched.module_table(outs[1], outs[0])
        if act_sampled:
            zeros = c.cur.zeros_read if c.cur.zeros_read is not None else hm.zero_shares(c.params)
            if zeros is not None:
                measures["grad_zero_rows"], measures["grad_zero_cols"] = zeros
        return measures or None

    def flush(self) -> None:
        """Nothing waits on the host path."""

    def drop(self) -> None:
        """The run ends: a step the extension's PlainStep was taking is handed over."""
        self.drop_plain()

    def stop(self) -> None:
        """Monitoring stops: no more plain steps (nothing handed over)."""
        self.plain = None


def lr_of(optimizer: Any) -> Optional[float]:
    """The first parameter group's learning rate (None when it is not a number)."""
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
