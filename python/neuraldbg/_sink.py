"""Where an observed step goes: the engine (which also writes the trace) and the debugger's
per-step callback (``halt_on``, ``on_failure``, the notebook display).

Every reader ends a step here, with the step's host arrays, measures and facts. What is still
the collector's to say (which zero gradients mean "no gradient", where a non-finite value
first appeared) is settled here, once, before the engine sees the step.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple, Union

import numpy as np

from ._step import NONFINITE, UNKNOWN, ZERO

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector
    from ._distributed import JobStep
    from ._transfer import HostStep, Layout, Unpacked

# Steps that record which modules ran after exact-zero gradients were seen on a step that did
# not (host mode): while zeros keep coming, they are told apart from "no gradient".
NEED_RAN_STEPS = 32


class Sink:
    """Feeds one collector's observed steps to the engine and the per-step callback."""

    def __init__(self, c: Collector) -> None:
        self.c = c

    def feed(
        self,
        layout: Union[Layout, HostStep],
        u: Union[Unpacked, JobStep, HostStep],
        refs: List[Tuple[int, Any, Any]],
        measures: Optional[Dict[str, np.ndarray]],
        facts: Optional[Dict[str, float]],
        recorded: bool = True,
        flags: int = UNKNOWN,
    ) -> None:
        """Feeds the engine one step: ``layout`` says what is known of it (a
        :class:`~._transfer.Layout` or :class:`~._transfer.HostStep`), ``u`` holds its host
        arrays (``Unpacked``, a distributed ``JobStep``, or the ``HostStep``)."""
        c = self.c
        grad_norms = u.grad_norms
        loss_value = u.loss
        # An exactly-zero gradient of a module that ran before but not in this step is "no
        # gradient" (zero_grad(set_to_none=False) leaves zeros), not a vanishing one. When each
        # step's gradients are made anew (set_to_none=True), a module that sat out has none at
        # all and every zero is a real one.
        kept = c.loop.grads_kept is not False
        if kept and flags & (ZERO | UNKNOWN) and c.order and not grad_norms.all():
            owners = c.param_owner
            left = [p for p in np.flatnonzero(grad_norms == 0.0) if owners[p] in c.order_set]
            if recorded:
                ran_now = set(layout.ran) if layout.ran is not None else {i for i, _, _ in refs}
            else:
                # Not recorded in this step: unknown, read as "no gradient" (one zero would
                # confirm a vanishing gradient; a layer that really died is seen from the next
                # step on, which records which modules ran).
                ran_now = set()
            if left and c.reader.host and (c.loop.grads_kept or not recorded):
                c.need_ran = NEED_RAN_STEPS  # the coming steps record which modules ran
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
        if suspicious and c.forward_check != "off":
            summary = getattr(layout, "summary", None)
            if layout.origin is not None or layout.checked:
                nonfinite, checked = layout.origin, True
            elif summary is not None:
                nonfinite, checked = c.watched.first_nonfinite_summary(summary), True
            elif refs:
                nonfinite, checked = c.origin_search.scan(refs)

        c.act_pending = c.engine.observe(
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
        if c.on_observed is not None:
            c.on_observed(layout.step)
