"""Where a step ends: the part of the collector that counts steps, observes them, and arms
what the next one needs.

A step ends at the optimizer step of the model's parameters (``step_on="optimizer"``, the
default; a closure's forward and backward run inside it), at each optimizer's step
(``"each_optimizer"``: Lightning's manual optimization), or at the end of each backward
(``"backward"``). A GradScaler's skipped step is still a step, marked skipped. The first step
registers the model with the engine (its structure, probes, loss facts). Every step is then
observed by the collector's reader and its per-step state replaced; the sampling schedule
(dense first steps, activation and weight periods, dense while the engine confirms a change)
decides what the coming step measures.
"""

from __future__ import annotations

import json
import sys
import warnings
from types import FrameType
from typing import TYPE_CHECKING, Any, Optional, Sequence

from ._loop import live_optimizers
from ._measure import Probe
from ._model import learn_order
from ._read_host import lr_of
from ._step import StepState
from ._taps import BACKWARD_TAP
from .errors import NeuralDbgWarning

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector


def _optimizer_stepping() -> bool:
    """Whether a torch optimizer's step is running on this thread (the forward of its closure:
    LBFGS moves the weights between the closure's evaluations). Walks the stack: called only
    when the weights moved with no step seen."""
    from torch.optim import Optimizer

    frame: Optional[FrameType] = sys._getframe(1)
    while frame is not None:
        if isinstance(frame.f_locals.get("self"), Optimizer):
            return True
        frame = frame.f_back
    return False


def _optimizer_holds(params: Sequence[Any]) -> bool:
    """Whether a torch optimizer that exists now holds one of ``params`` (one that has not
    stepped yet, such as sharpness-aware minimization's before its first step). Scans every
    live object: called only when the weights moved up their gradients before any step."""
    want = {id(p) for p in params}
    return any(any(id(p) in want for g in o.param_groups for p in g["params"]) for o in live_optimizers())


class StepBoundary:
    """Where one collector's steps end, and what the next one measures."""

    def __init__(self, c: Collector) -> None:
        self.c = c

    def arm_probes(self, on: bool) -> None:
        """Activation probes are hooked only on steps whose activations are measured."""
        on = on and not self.c.disabled
        if on != self.c.hooks.probes_armed:
            self.c.hooks.arm_probes(on, self.c.probes, self.c.act_out)
        if self.c.registered:
            self.c.hooks.arm_modules(self.modules_wanted(on))
        self.c.reader.hold_outputs()

    def modules_wanted(self, sampled: bool) -> bool:
        """Whether the coming step needs the calls of the model's modules seen: always on the
        device path (a NaN is known only after the step, when the parameters have changed);
        on the host only on sampled steps (their outputs are measured), while exact-zero
        gradients need to know which modules ran, or when a forward cannot be replayed."""
        return not self.c.reader.host or sampled or not self.c.replay_ok or self.c.need_ran > 0 or self.c.disabled

    def backward_step(self, halt: bool = True) -> None:
        """``step_on="backward"``: the backward pass that just ended is a step."""
        self._observe(lr=None)
        self._count_step()
        self.arm_probes(self.activations_next())
        if halt:
            self.c.raise_halt()

    def run_due(self, halt: bool = True) -> None:
        """On the training thread: the step of a backward that ended on another thread
        (``halt``: raise a halt it confirms into the loop)."""
        if self.c.backward_due:
            self.c.backward_due = False
            self.backward_step(halt)

    def _is_relevant(self, optimizer: Any) -> bool:
        key = id(optimizer)
        hit = self.c.relevant.get(key)
        if hit is None:
            hit = any(id(p) in self.c.param_ids for g in optimizer.param_groups for p in g["params"])
            self.c.relevant[key] = hit
            if hit:
                if self.c.optimizer_name is None:
                    self.c.optimizer_name = type(optimizer).__name__
                self.c.maximized |= self.c.loop.maximized(optimizer)
                self._new_optimizer(optimizer)
        return hit

    def _new_optimizer(self, optimizer: Any) -> None:
        """An optimizer of the model's parameters steps for the first time (its id was not
        seen): which parameters it holds, at its groups' lrs, reach the engine, once. Before
        registration, at registration (see :meth:`_register`)."""
        loop = self.c.loop
        if self.c.disabled:
            return
        if not self.c.registered:
            loop.waiting.append(optimizer)
        else:
            self._amend_lrs(optimizer)

    def _amend_lrs(self, optimizer: Any) -> None:
        """Merges ``optimizer``'s lrs into the engine's (None: they cannot be read, and the
        engine stops taking the parameters it does not know of for held by none; lrs it does
        not know stay unknown)."""
        self.c.engine.amend_param_lr(self.c.loop.param_lrs(optimizer))

    def on_optimizer_step(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        """The step boundary: the optimizer step of the model's parameters ran (a closure's
        forward and backward ran inside it)."""
        reader = self.c.reader
        plain = reader.plain
        if plain is not None and plain.step(optimizer):
            self.c.raise_halt()
            return
        self._count_interrupted()
        s = self.c.cur
        if optimizer is reader.plain_optimizer and s.grad_read and reader.plain_step(optimizer):
            self.c.raise_halt()
            return
        if self.c.disabled:
            if self.c.step_on != "backward" and self._is_relevant(optimizer):
                self.c.step += 1  # still a step of the run: the trace records it as not observed
            return
        if self.c.by_hand and self._is_relevant(optimizer):
            # An optimizer steps the weights after all (SAM moves them by hand before it does):
            # its steps are the run's from now on.
            self.c.step_on, self.c.by_hand = "optimizer", False
        if self.c.step_on == "backward" or not self._is_relevant(optimizer):
            return
        if not s.grad_read and not s.forwards:
            if self.c.step_on != "each_optimizer":
                if self.c.step == 0:
                    self.c.idle_steps += 1
                return  # a second optimizer of the same iteration: one step
            reader.read_gradients()  # a step of its own: the gradients it used, as they are
        if not s.grad_read:
            # Gradients no backward pass accumulated (set by hand), or one that reached no
            # sentinel: read as they are, and sentinels chosen among those that have one.
            # Read at the tap, sentinels that stay the same had gradients from a backward the
            # tap did not see: from now on their hooks say where a backward ends.
            moved = self.c.hooks.hook_grads(self.c, self.c.params)
            if self.c.hooks.tap_reads and not moved:
                self.c.hooks.read_at_tap(self.c, self.c.params, False)
                self.c.loop.hook_probe()
            if reader.plain is not None:
                reader.make_plain()  # (new sentinels, or none read at the tap any more)
            reader.read_gradients()
        reader.read_clipped()
        self._step_boundary(optimizer, skipped=False)
        self.c.raise_halt()

    def _step_boundary(self, optimizer: Any, skipped: bool) -> None:
        """One optimizer iteration ended (``skipped``: a GradScaler skipped its step): observe
        it, count it, and prepare the next one."""
        if not self.c.registered:
            self.c.loop.optimizer = optimizer  # the loop facts' optimizer, read at registration
        self._observe(lr=lr_of(optimizer), skipped=skipped)
        reader = self.c.reader
        # The optimizer whose steps may take the short path (host mode, the step boundary of
        # the optimizer: the one optimizer of the model seen stepping).
        reader.plain_optimizer = (
            optimizer
            if reader.host and self.c.registered and self.c.step_on == "optimizer" and not self.c.disabled
            else None
        )
        self._count_step()
        self.arm_probes(self.activations_next())
        if reader.plain is not None:
            reader.plain.arm(reader.plain_next())

    def _count_step(self) -> None:
        """A step was observed: count it, and let the loop facts' probe see the gradient the
        optimizer used."""
        self.c.step += 1
        try:
            self.c.loop.after_optimizer_step()
        except Exception as e:  # pragma: no cover - defensive
            self.c.fail("observation", e)

    def next_step(self) -> bool:
        """The host reader's short paths observed a step: count it and arm what the coming step
        needs. True when something was armed (or disarmed)."""
        self._count_step()
        sampled = self.activations_next()
        if sampled or self.c.hooks.modules_armed or self.modules_wanted(sampled):
            self.arm_probes(sampled)
            return True
        return False  # (nothing to arm or disarm, nothing held)

    def on_scaler_step(self, scaler: Any, optimizer: Any) -> None:
        """``scaler.step(optimizer)`` starts: the gradients read were scaled by its scale."""
        if self.c.disabled or self.c.step_on == "backward" or not self._is_relevant(optimizer):
            return
        if scaler.is_enabled():
            self.c.scaler = scaler

    def on_scaler_step_done(self, scaler: Any, optimizer: Any) -> None:
        """``scaler.step`` returned. If the optimizer step did not run (an overflow), the
        iteration is still a step, marked skipped."""
        if self.c.scaler is not scaler:
            return
        try:
            if self.c.cur.grad_read and not self.c.disabled:
                self._step_boundary(optimizer, skipped=True)
        finally:
            self.c.scaler = None

    def _register(self) -> None:
        if self.c.order is None:
            # The model itself was not called: its submodules were.
            self.c.order, self.c.order_set = learn_order(self.c.refs)
        executed = self.c.order or []
        if executed and executed[0] != 0:
            self.c.hooks.first[0] = executed[0]
        if self.c.params:
            # The gradient read again after the step to detect clipping (or gradients cleared
            # before it): the largest parameter up to 64k elements (clip_grad_norm_ scales every
            # gradient alike, so any one shows it, and a small one is cheap to read), among
            # those whose first gradient, where already on the host, was not zero (a LoRA
            # adapter's A matrix gets exactly zero while B is zero: it would show nothing).
            sizes = [int(p.numel()) for p in self.c.params]
            small = [k for k, n in enumerate(sizes) if n <= 1 << 16]
            pool = small or list(range(len(sizes)))
            first = self.c.cur.grad_host
            if first is not None:
                pool = [k for k in pool if first[k] > 0] or pool
            self.c.clip_index = max(pool, key=lambda k: sizes[k])
        spec = self.c.watched.spec(executed, self.c.optimizer_name)
        spec["param_lr"] = self.c.loop.param_lrs(self.c.loop.optimizer)
        spec["base_lr"] = self.c.loop.base_lr(self.c.loop.optimizer)
        spec["param_weight_decay"] = self.c.loop.param_weight_decays(self.c.loop.optimizer)
        spec["loss"] = self.c.loop.loss_facts()
        spec["unregistered_params"] = self.c.loop.unregistered_params()
        spec["sequence_first_inputs"] = self.c.loop.sequence_first_inputs()
        spec["sequence_readouts"] = self.c.loop.sequence_readouts()
        self.c.hooks.unhook_sequences()
        spec["input_feature_scales"] = self.c.loop.input_feature_scales()
        # A CPU model whose loss is taken at the backward tap has its gradients read there
        # too, when the backward returns, instead of by hooks that fire inside it.
        tap = self.c.reader.host and self.c in BACKWARD_TAP.collectors and not self.c.hooks.frozen
        self.c.hooks.read_at_tap(self.c, self.c.params, tap)
        self.c.loop.install_probe(hook=not tap, by_hand=self.c.by_hand)
        self.c.reader.make_plain()
        registering = self.c.loop.optimizer
        self.c.loop.optimizer = None
        probes = json.loads(self.c.engine.register_model(json.dumps(spec)))
        # The other optimizers seen stepping so far add the parameters they hold.
        waiting, self.c.loop.waiting = self.c.loop.waiting, []
        for opt in waiting:
            if opt is not registering:
                self._amend_lrs(opt)
        axes = self.c.watched.unit_axes(executed)
        self.c.probes = []
        for row, d in enumerate(probes):
            module = self.c.watched.spec_order[d["module"]]
            d = dict(d, module=module)
            self.c.probes.append(Probe(row, d, axes.get(module, -1)))
        self.c.act_none = [None] * len(self.c.probes)
        if self.c.dist is not None:
            self.c.dist.setup(len(self.c.params), len(self.c.probes))
        # This first step ran with every module hooked: its probe outputs are in refs.
        self._fill_act_out()
        self.c.registered = True
        self.c.hooks.probes_armed = False

    def _fill_act_out(self) -> None:
        """Each probe's latest output from the kept module outputs."""
        self.c.act_out[:] = self.c.act_none
        row_of = {p.module: p.row for p in self.c.probes}
        for i, out, _ in self.c.refs:
            r = row_of.get(i)
            if r is not None:
                self.c.act_out[r] = out

    def probes_due(self, first: bool) -> bool:
        """At observation, no activation staged: whether the probes' outputs are measured now
        (the first step; a sampled step; compiled, where the probes are the kept outputs)."""
        if not self.c.probes:
            return False
        if self.c.hooks.frozen and self.activations_next():
            self._fill_act_out()
            return True
        return first or self.c.hooks.probes_armed

    def _check_seen(self) -> None:
        """Gradients without any forward pass seen: the forward ran where module hooks are not
        called. Said once; gradients, loss and steps are still observed."""
        s = self.c.cur
        if self.c.blind_warned or self.c.refs or s.raw_inputs or s.ran:
            return
        if s.forwards or self.c.hooks.frozen or (self.c.joined_in_backward and self.c.step == 0):
            return  # (the step a debugger joined after its forward: that forward was before it)
        self.c.blind_warned = True
        warnings.warn(
            "NeuralDBG sees this model's gradients but none of its forward passes: the forward "
            "ran where module hooks are not called (a graph torch.compile traced before "
            "`with NeuralDbg(...)` was entered and that NeuralDBG could not have traced again: "
            "a compiled function that calls a submodule rather than the model, or a model whose "
            "`forward` was replaced on the instance; or "
            "torch.func). Inputs, activations and the module where a NaN/Inf first appears are "
            "not observed; enter NeuralDbg before the first compiled call to get them.",
            NeuralDbgWarning,
            stacklevel=4,
        )

    def sampled(self, every: int) -> bool:
        return self.c.step < self.c.dense_steps or (every > 0 and self.c.step % every == 0)

    def updated_by_hand(self) -> bool:
        """Before the first step of a loop counted at its optimizer's steps, as a forward pass
        of the model begins (or a backward ends, in a loop that calls only the model's modules):
        whether the weights moved since the last backward pass gave them gradients, with no
        optimizer step since and none running now. Then the loop updates
        them down those gradients itself (``with torch.no_grad(): p -= lr * p.grad``,
        ``p.data.add_(...)``, an optimizer that is not a torch one), and would otherwise never be
        observed. A move up the gradients is an update only when no torch optimizer holds the
        weights (then it is the loop's own, its sign flipped); else it is an ascent before the
        optimizer steps (sharpness-aware minimization's). Read on the sample of the weights taken for the
        step size (:meth:`update_due`)."""
        c = self.c
        s = c.cur
        if c.step_on != "optimizer" or not s.grad_read or not s.weights_before or not s.grads_before:
            return False
        if c.dist is not None or c.disabled:
            return False
        moved = c.measure.updates(c.params, s.weights_before, s.grads_before)
        if moved is None or moved.direction is None:
            return False
        climb = float(moved.direction.nan_to_num().sum())
        if climb == 0.0 or _optimizer_stepping():
            return False
        # Up the gradients: an update only when no optimizer could be about to step (a loop's
        # own update with its sign flipped, ``p += lr * p.grad``); else an ascent before the step.
        return climb < 0.0 or not _optimizer_holds(c.params)

    def update_due(self) -> bool:
        """Measure how far this step's optimizer update moves the weights: on the dense first
        steps, then on every tenth step whose weights are measured."""
        c = self.c
        return c.step < c.dense_steps or (c.weight_every > 0 and c.step % (10 * c.weight_every) == 0)

    def unsampled(self) -> bool:
        """The current step is past the dense ones and measures neither activations nor
        weights (by its number; an unconfirmed activation change is ``act_pending``)."""
        s = self.c.step
        return s >= self.c.dense_steps and s % self.c.activation_every != 0 and s % self.c.weight_every != 0

    def activations_next(self) -> bool:
        """Measure activations in the coming step: on its sample period, or densely while the
        engine has an unconfirmed activation change (so it is confirmed within `persistence`
        steps, not `persistence` samples)."""
        return self.sampled(self.c.activation_every) or self.c.act_pending

    def _count_interrupted(self) -> None:
        """A Ctrl-C that lands after a step reached the engine and before it was counted (its
        KeyboardInterrupt raised at any line of the step's hook) must not leave the trace one
        step ahead of dbg.step: the optimizer step completed, so it counts. Checked at exit and
        before each step the fast path does not take (a loop may catch the KeyboardInterrupt
        and train on)."""
        last = self.c.engine.last_step
        if last is not None and last >= self.c.step:
            self.c.step = last + 1

    def _observe(self, lr: Optional[float], final: bool = False, skipped: bool = False) -> None:
        try:
            first = not self.c.registered
            if first:
                self._register()
            self._check_seen()
            self.c._entry_inputs()
            self.c.reader.observe(lr, final, first, skipped)
        except Exception as e:
            self.c.fail("observation", e)
        finally:
            self.c.act_out[:] = self.c.act_none
            self.c.reader.clear_outputs()
            self.c.summaries.clear()
            self.end_step(final)

    def end_step(self, final: bool) -> None:
        """The step was observed: a fresh per-step state for the next one."""
        if not final:
            if not self.c.cur.root_seen:
                self.c.replay_ok = False  # gradients without a call of the model itself
            if self.c.need_ran > 0:
                self.c.need_ran -= 1
            self.c.refs.clear()
        self.c.cur = StepState()

    def flush(self) -> None:
        """Makes every observed step visible to the engine (before results are read)."""
        if self.c.backward_due:
            self.run_due(halt=False)
        self.c.reader.flush()

    def finish(self, crashed: bool) -> None:
        """Called on exit. A step still on its way to the host is handed to the engine. A
        forward pass that never reached ``optimizer.step()`` is observed too (gradients if any,
        inputs, loss, and the forward outputs scanned for NaN/Inf) when the loop raised, or when
        it stopped on its own after that forward went non-finite (``if not
        torch.isfinite(loss): break``), so a run that ended in a failure still leaves its
        diagnosis. A final healthy forward (an evaluation pass, or one cut short by Ctrl-C,
        which the debugger does not count as a crash) is not a step."""
        self.c.reader.drop_plain()
        if self.c.disabled:
            return
        self.flush()
        self._count_interrupted()
        s = self.c.cur
        unobserved = s.forwards > 0 or s.grad_read or bool(s.raw_inputs)
        if unobserved and (crashed or self.c.origin_search.unobserved_failed()):
            self._observe(lr=None, final=True)
            self.flush()
