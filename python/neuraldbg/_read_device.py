"""The device reader: how a step is read on an accelerator, under torch.distributed, or through
the CUDA path's CPU stand-in (``NEURALDBG_DEVICE_PATH``).

Every statistic of the step is a torch reduction on the tensors' device, concatenated into one
float32 vector (:meth:`DeviceReader.observe`: the one place a step's vector is assembled, its
layout recorded in a :class:`~._transfer.Layout`) and moved to the host once. On CUDA the copy
is asynchronous into pinned memory and the step reaches the engine when the next forward pass
starts (or at exit, or when results are read), so nothing in the step blocks the GPU. Under
torch.distributed the vector goes through the job's one collective per step
(:mod:`._distributed`). Module calls are summarized on the device as they return
(:class:`~._measure.Summaries`) instead of being kept, where device memory is at stake.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional

import numpy as np

from ._distributed import local_tensors
from ._measure import input_stats, read_summaries
from ._transfer import HostCopy, Layout, Pending, Unpacked, flatten, per_parameter

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector


class DeviceReader:
    """Reads the steps of a model on a device (or under torch.distributed) as one vector."""

    host = False

    def __init__(self, c: Collector, defer: Optional[bool]) -> None:
        self.c = c
        # Transfer: None until the first observation decides (True on CUDA: asynchronous copy
        # into pinned memory, handed to the engine a step later).
        self.defer = defer
        self.pending: Optional[Pending] = None
        # A second step on its way while the first is (the pinned copy is double-buffered: a
        # step is waited for only when a third would need its buffer).
        self.later: Optional[Pending] = None
        self.host_copy = HostCopy()
        # The extension's fast path is the host reader's only (see the methods below).
        self.plain: Any = None
        self.plain_optimizer: Any = None

    def make_plain(self) -> None:
        """(No fast path on the device.)"""

    def drop_plain(self) -> None:
        """(No fast path on the device.)"""

    def plain_next(self) -> bool:
        return False

    def plain_step(self, optimizer: Any) -> bool:
        return False

    def hold_outputs(self, autocast: bool = False) -> None:
        """Recorded layers keep no tensor once registered: each call is summarized on the device
        as it returns (outputs and inputs on the first step, which learns the model; and for a
        CPU job under torch.distributed, where reading every output again costs a CPU more
        than the memory it holds)."""
        c = self.c
        c.hooks.hold[0] = c.summaries if c.summarized() else True

    def clear_outputs(self) -> None:
        """(The host reader's sampled outputs; nothing here.)"""

    def forward_starts(self) -> None:
        """A forward pass starts: a step whose copy has arrived is handed to the engine."""
        c = self.c
        if self.pending is not None and self.pending.ready():
            self.consume()
            if self.pending is not None and self.pending.ready():
                self.consume()
            c.raise_halt()  # CUDA: the step was handed to the engine just now

    def input_stats(self, x: Any) -> None:
        self.c.cur.inputs.append(input_stats(x.detach()))

    def read_gradients(self) -> None:
        """The gradient norms, on the device (each rank measures what it holds: DTensors'
        local shards); they wait there until the step's vector is assembled."""
        c = self.c
        parts: List[Any] = []
        grads = [p.grad for p in c.params]
        if c.sharded:
            grads = local_tensors(grads)
        with c.torch.no_grad():
            c.cur.grad_order = c.measure.gradient_norms(grads, parts)
        c.cur.grad_parts = parts
        c.cur.grad_read = True

    def loss_nonfinite(self, loss: Any) -> Optional[bool]:
        """Whether the loss is NaN/Inf, when that costs no wait on a device (None: not known)."""
        if not self.defer and loss.device.type == "cpu":
            return not math.isfinite(float(loss.detach()))
        return None

    def check_after_backward(self) -> None:
        """(The host reader scans at the end of backward; here the step's vector says.)"""

    def stage_forward(self) -> None:
        """The forward is complete, on a sampled step: its activation statistics (and, unless
        the calls were summarized, their output scales), on the device."""
        c = self.c
        c.cur.act_staged = c.measure.activation_parts(c.probes, c.act_out)
        if not c.summaries:  # (summarized calls carry their output scale)
            c.cur.out_staged = c.measure.output_absmax(c.refs, c.watched.rank)

    def read_clipped(self) -> None:
        """The clipping check's gradient, read again as the optimizer received it (a device
        scalar)."""
        c = self.c
        if c.clip_index is None:
            return
        g = c.params[c.clip_index].grad
        if g is not None and c.sharded:
            g = local_tensors([g])[0]
        if g is None:  # cleared after the backward: the optimizer receives none
            c.cur.clip_after = c.torch.zeros((), device=c.params[c.clip_index].device)
        elif g.layout == c.torch.strided:
            with c.torch.no_grad():
                c.cur.clip_after = c.torch.linalg.vector_norm(g).float()

    def observe(self, lr: Optional[float], final: bool, first: bool, skipped: bool) -> None:
        """Assembles the step's vector (its layout in a :class:`Layout`), then moves it to the
        host: at once, deferred (CUDA), or through the job's exchange (distributed)."""
        c = self.c
        s = c.cur
        torch = c.torch
        layout = Layout(c.step, lr, final)
        layout.facts = c.loop.step_facts()
        with torch.no_grad():
            if not s.grad_read:
                self.read_gradients()  # at exit, or a step seen only at its boundary
            grad_parts = s.grad_parts
            scale = getattr(c.scaler, "_scale", None) if c.scaler is not None else None
            if isinstance(scale, torch.Tensor):
                # Read at the end of backward, the gradients were scaled: unscale the norms.
                inv = scale.double().reciprocal().float()
                grad_parts = [g * inv.to(g.device) for g in grad_parts]
                layout.skipped = skipped
            layout.add("grad", grad_parts, s.grad_order)
            weights = local_tensors(c.params) if c.sharded else c.params
            if c.params and c.boundary.sampled(c.weight_every):
                parts: List[Any] = []
                order = c.measure.weight_norms(weights, parts)
                layout.add("weight", parts, order)
                before = s.weights_before
                moved = c.measure.updates(weights, before, s.grads_before or (), c.maximized) if before else None
                if moved is not None:
                    layout.add("update_ratio", [moved.ratio], moved.params)
                    if moved.direction is not None:
                        layout.add("update_direction", [moved.direction], moved.params)
            staged = s.act_staged
            if staged is None and c.boundary.probes_due(first):
                staged = c.measure.activation_parts(c.probes, c.act_out)
            if staged is not None:
                layout.add("activation", staged[0], staged[1])
                layout.act_samples = staged[2]
            layout.origin = s.origin
            layout.checked = s.origin_checked
            layout.ran = s.ran
            pending = s.loss_pending()
            tensors = [t for t in pending if not isinstance(t, float)]
            if tensors:
                loss = tensors[0] if len(tensors) == 1 else torch.stack([t.reshape(()).float() for t in tensors]).mean()
                layout.add("loss", [loss.reshape(1).to(torch.float32)])
            if len(tensors) < len(pending):  # numbers given to record_loss: averaged in on the host
                floats = [t for t in pending if isinstance(t, float)]
                layout.loss_floats = (math.fsum(floats), len(floats), len(tensors))
            for x in s.raw_inputs:
                if x.numel() > 0:
                    s.inputs.append(input_stats(x.detach()))
            if s.inputs:
                layout.add("input", s.inputs)
            if s.clip_after is not None and c.clip_index is not None:
                layout.clip_index = c.clip_index
                layout.add("clip", [s.clip_after.reshape(1).float()])
            if isinstance(scale, torch.Tensor):
                layout.add("loss_scale", [scale.reshape(1).float()])
            outs = s.out_staged
            if outs is None and first and not c.summaries:
                outs = c.measure.output_absmax(c.refs, c.watched.rank)
            if outs is not None:
                layout.add("output_absmax", [outs[0]], outs[1])
            if c.params and c.boundary.sampled(c.activation_every):
                # Units that never fire behind functional activations (zero gradient rows).
                grads = [p.grad for p in c.params]
                zeros = c.measure.grad_zero_shares(local_tensors(grads) if c.sharded else grads)
                if zeros is not None:
                    layout.add("grad_zero", [zeros[0]], zeros[1])
            if c.summaries:
                # The summaries of the step's module calls (where a NaN/Inf first appeared; on
                # sampled steps, each module's output scale).
                vec = c.summaries.vector()
                if vec is not None:
                    layout.add("summary", [vec])
                    if c.dist is not None and layout.origin is None and not layout.checked:
                        # The exchange takes each rank's origin before the vector reaches a
                        # host: found on the device.
                        layout.origin_device = c.origin_search.on_device(vec)
                layout.summary_calls, _ = c.summaries.take()
                layout.summary_out = first or c.boundary.sampled(c.activation_every)
            flat = flatten(layout.parts)
            layout.parts = []
        refs = c.refs
        if first:
            c.hooks.rehook(set(c.param_owner))
        keep = list(refs) if c.forward_check != "off" or final else [(i, None, None) for i, _, _ in refs]
        if c.dist is not None and not final:
            # The job's one collective for this step; the job-wide step reaches the engine when
            # it has arrived (see _distributed.py). A crashed rank's last forward (final) is
            # observed alone: the other ranks are not there to exchange with.
            if self.pending is not None:
                self.consume()
            self.pending = Pending(layout, None, None, keep, c.dist.exchange(layout, flat))
            return
        if flat is None:
            self.ingest(layout, np.zeros(0, np.float32), refs)
            return
        if self.defer is None:
            self.defer = flat.device.type == "cuda"
        if not self.defer:
            # The one device-to-host transfer of the step (a view, no copy, on CPU).
            host = flat.numpy() if flat.device.type == "cpu" else flat.cpu().numpy()
            self.ingest(layout, host, refs)
            return
        # Asynchronous: copied into pinned memory behind the step's kernels, handed to the
        # engine at a later forward pass once the copy is done (see consume). Two steps may be
        # on their way (two buffers): the oldest is handed over first when a third comes.
        if self.later is not None:
            self.consume()
        host, event = self.host_copy.start(flat)
        p = Pending(layout, host, event, keep)
        if self.pending is None:
            self.pending = p
        else:
            self.later = p
        if final:
            self.flush()

    def consume(self) -> None:
        """Hands the oldest pending step to the engine: at a forward pass when its copy is done
        (``Pending.ready``), else when a third step needs its buffer, at exit, or when results
        are read."""
        c = self.c
        p = self.pending
        self.pending, self.later = self.later, None
        if p is None or c.disabled:
            return
        try:
            if p.exchange is not None:
                job = c.dist.receive(p.exchange, p.layout)
                facts = {**(p.layout.facts or {}), **job.facts} or None
                c.sink.feed(p.layout, job, p.refs, job.measures or None, facts)
                return
            if p.event is not None and not p.event.query():
                # The copy is two steps old then: this waits only when the device is more than
                # two steps behind the CPU, and never drains its queue.
                p.event.synchronize()
            assert p.host is not None
            self.ingest(p.layout, p.host, p.refs)
        except Exception as e:
            c.fail("observation", e)

    def flush(self) -> None:
        """Makes every observed step visible to the engine."""
        while self.pending is not None:
            self.consume()

    def drop(self) -> None:
        """Steps on their way are let go."""
        self.pending = self.later = None

    stop = drop

    def ingest(self, layout: Layout, flat: np.ndarray, refs: List[Any]) -> None:
        """Host side of one step: unpack the vector and feed the engine."""
        c = self.c
        u = Unpacked(layout, flat, c.no_grads, len(c.probes))
        c.sink.feed(layout, u, refs, self._measures(layout, flat), {**(layout.facts or {}), **u.facts} or None)

    def _measures(self, layout: Layout, flat: np.ndarray) -> Optional[Dict[str, np.ndarray]]:
        """The named per-module and per-parameter measures of the vector; the summaries of the
        module calls, read into ``layout.summary`` for the non-finite scan."""
        c = self.c
        watched = c.watched
        out: Dict[str, np.ndarray] = {}
        if layout.summary_calls is not None:
            vec = layout.read(flat, "summary")
            summary = read_summaries(layout.summary_calls, vec if vec is not None else flat[:0])
            layout.summary = summary
            if layout.summary_out:
                known = [(watched.rank[i], v) for i, v, _, _ in summary if i in watched.rank and v == v]
                if known:
                    out["output_absmax"] = watched.module_table(
                        np.asarray([r for r, _ in known], dtype=np.intp), np.asarray([v for _, v in known], np.float32)
                    )
        n = len(c.params)
        zeros = layout.read(flat, "grad_zero")
        index = layout.index("grad_zero")
        if zeros is not None and index is not None:
            k = index.size
            out["grad_zero_rows"] = per_parameter(n, index, zeros[:k])
            out["grad_zero_cols"] = per_parameter(n, index, zeros[k:])
        for name in ("update_ratio", "update_direction"):
            moved = layout.read(flat, name)
            index = layout.index(name)
            if moved is not None and index is not None:
                out[name] = per_parameter(n, index, moved)
        ranks = layout.index("output_absmax")
        values = layout.read(flat, "output_absmax")
        if ranks is not None and ranks.size and values is not None:
            out["output_absmax"] = watched.module_table(ranks, values)
        return out or None
