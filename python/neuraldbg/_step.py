"""One optimizer step as the collector sees it while it happens: where the step is
(:class:`Stage`) and what it has gathered so far (:class:`StepState`).

The collector holds one :class:`StepState` and replaces it with a fresh one when the step has
been observed: nothing of a step survives into the next by accident, and "what does a step
start with" has one answer, this class's ``__init__``.
"""

from __future__ import annotations

from enum import IntEnum
from typing import Any, List, Optional, Tuple

import numpy as np

from ._native import GRAD_NONFINITE as NONFINITE  # noqa: F401 (re-exported)
from ._native import GRAD_ZERO as ZERO  # noqa: F401 (re-exported)

# What a step's gradient norms hold: the bits of ``TensorReader.grad_norms``'s answer
# (NONFINITE a NaN/Inf, ZERO an exact zero, 4 a missing gradient), or UNKNOWN: not said (the
# arrays are checked).
UNKNOWN = 8


class Stage(IntEnum):
    """Where the current forward pass of the step is."""

    IDLE = 0
    """No forward pass of the model yet in this step."""
    FORWARD = 1
    """A forward pass ran; its kept module outputs are held."""
    RELEASED = 2
    """Its loss appeared: the forward's statistics are staged and its outputs let go."""


class StepState:
    """What one step has gathered until it is observed (then replaced by a fresh one)."""

    __slots__ = (
        "act_staged",
        "auto_losses",
        "clip_after",
        "clip_seen",
        "forwards",
        "grad_flags",
        "grad_host",
        "grad_order",
        "grad_parts",
        "grad_read",
        "grads_before",
        "host_inputs",
        "inputs",
        "loss_read",
        "losses",
        "origin",
        "origin_checked",
        "out_staged",
        "output_fns",
        "ran",
        "raw_inputs",
        "released",
        "root_calls",
        "root_seen",
        "stage",
        "tap_product",
        "tap_taken",
        "weights_before",
        "zeros_read",
    )

    def __init__(self) -> None:
        self.stage = Stage.IDLE
        # Forward passes of the model seen in this step (several: gradient accumulation).
        self.forwards = 0
        # Gradients: read at the end of a backward (or at the boundary). Host mode: their
        # norms (``grad_host``), what they hold (``grad_flags``) and, on a sampled step, the
        # zero-gradient shares (rows, cols); device path: the norms' parts on the device and
        # the parameter index of each.
        self.grad_read = False
        self.grad_host: Optional[np.ndarray] = None
        self.grad_flags = UNKNOWN
        self.zeros_read: Optional[Tuple[np.ndarray, np.ndarray]] = None
        self.grad_parts: List[Any] = []
        self.grad_order: Optional[np.ndarray] = None
        # A step whose update is measured: samples of weights as the backward left them, before
        # the optimizer moved them (how far it moved them; see Measurer.update_ratios).
        self.weights_before: Optional[List[Any]] = None
        # Before the first step: the gradients at those samples (whether the loop moved the
        # weights down them by hand; see StepBoundary.updated_by_hand).
        self.grads_before: Optional[List[Any]] = None
        # Inputs: host statistics (4 floats per forward, in a row), device statistics (one
        # tensor per forward), and compiled forwards' inputs (references, measured at the end).
        self.host_inputs: List[float] = []
        self.inputs: List[Any] = []
        self.raw_inputs: List[Any] = []
        # Losses: given (criterion hook, record_loss) or taken from backward (averaged over
        # micro-batches); host mode: the loss read before its backward, with its value.
        self.losses: List[Any] = []
        self.auto_losses: List[Any] = []
        self.loss_read: Optional[Tuple[Any, float]] = None
        # grad_fn of the model's outputs: a backward whose graph reaches one is the model's loss.
        self.output_fns: List[Any] = []
        # The loss the backward tap took before its backward ran, and (host mode) a product
        # loss with its unscaled value (a GradScaler's scaled loss).
        self.tap_taken: Any = None
        self.tap_product: Optional[Tuple[Any, Any]] = None
        # The clipping check: one gradient's norm as the optimizer received it (a device tensor;
        # host mode: a float), and host mode's reading of it at the end of backward (tensor,
        # version).
        self.clip_after: Any = None
        self.clip_seen: Optional[Tuple[Any, Any]] = None
        # What the release of the forward measured (activation statistics; per-module output
        # scales as (values, module ranks) or (table, None)).
        self.act_staged: Any = None
        self.out_staged: Optional[Tuple[Any, Optional[np.ndarray]]] = None
        # The module where the forward first went non-finite, whether the outputs were checked,
        # and which modules ran (known once the forward was released).
        self.origin: Optional[int] = None
        self.origin_checked = False
        self.ran: Optional[List[int]] = None
        # Host mode: the model's own calls (args, kwargs), replayed when a step that hooked no
        # module goes non-finite; those before ``released`` belong to released forwards.
        self.root_calls: List[Tuple[Any, Any]] = []
        self.released = 0
        # Whether the model itself was called (not only its submodules).
        self.root_seen = False

    def take_loss(self, t: Any, criterion_given: bool) -> None:
        """A backward of ``t`` gave the model gradients: ``t`` is the step's loss when no
        criterion gives it (unless the tap took it before the backward started)."""
        taken, self.tap_taken = self.tap_taken, None
        product, self.tap_product = self.tap_product, None
        if criterion_given or t is None or t is taken:
            return
        if product is not None and t is product[0]:
            self.auto_losses.append(product[1])  # host mode: unscaled before its backward
            return
        seen = self.loss_read
        if seen is not None and t is seen[0]:
            self.auto_losses.append(t)  # host mode: the loss read before its backward
            return
        from torch import Tensor

        from ._loop import unscaled_loss

        if isinstance(t, Tensor) and t.numel() == 1 and t.grad_fn is not None:
            self.auto_losses.append(unscaled_loss(t))

    def loss_pending(self) -> List[Any]:
        """The losses of the step: those given, else those taken from backward."""
        return self.losses or self.auto_losses
