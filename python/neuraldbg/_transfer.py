"""How a step's numbers reach the host: where each statistic sits in the step's one flat
float32 vector (:class:`Layout`), the single device-to-host transfer of that vector, and its
unpacking into the arrays the engine takes.

On CPU the transfer is ``.numpy()`` of the vector (no copy). On CUDA it is a ``non_blocking``
copy into pinned memory with an event recorded after it (:class:`HostCopy`); the step waits as a
:class:`Pending` until the next forward pass starts, when the GPU has long finished the copy.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

import numpy as np

if TYPE_CHECKING:  # pragma: no cover
    import torch

class Layout:
    """Where each statistic of one step sits in the step's flat vector (host-side metadata)."""

    __slots__ = ("step", "lr", "grad_order", "weight_order", "act_index", "act_samples", "n_act",
                 "loss", "n_inputs", "final", "origin", "checked", "ran", "clip_index", "loss_scale",
                 "skipped", "facts", "out_ranks", "zero_index", "loss_floats", "summary_calls", "summary_n",
                 "summary_out", "summary", "origin_device")

    def __init__(self, step: int, lr: Optional[float], final: bool) -> None:
        self.step = step
        self.lr = lr
        self.final = final
        self.grad_order: Optional[np.ndarray] = None
        self.weight_order: Optional[np.ndarray] = None
        self.act_index: Optional[np.ndarray] = None
        self.act_samples: Optional[np.ndarray] = None
        self.n_act = 0
        self.loss = False
        # Losses given as numbers (record_loss): (their sum, how many, how many tensors).
        self.loss_floats: Optional[Tuple[float, int, int]] = None
        self.n_inputs = 0
        # Found when the loss appeared (CPU): the non-finite origin (and whether the outputs were
        # scanned at all), and which modules ran.
        self.origin: Optional[int] = None
        self.checked = False
        self.ran: Optional[List[int]] = None
        # Facts measured on the device, after the inputs: the norm of one parameter's gradient
        # as the optimizer received it (which parameter; None: not read), then the loss scale.
        self.clip_index: Optional[int] = None
        self.loss_scale = False
        # Under a GradScaler: whether its step skipped the optimizer (None: no scaler).
        self.skipped: Optional[bool] = None
        # Facts about the loop in this step (training mode, gradient accumulation).
        self.facts: Optional[Dict[str, float]] = None
        # Engine module index of each module-output scale at the end of the vector.
        self.out_ranks: Optional[np.ndarray] = None
        # Parameter index of each gradient's zero-row/zero-column share, after the output scales.
        self.zero_index: Optional[np.ndarray] = None
        # Last: the summaries of the step's module calls (see _measure.Summaries): their calls
        # and values, whether they give the output scales, and (on the host) what they say.
        self.summary_calls: Optional[List[Tuple[int, int, int]]] = None
        self.summary_n = 0
        self.summary_out = False
        self.summary: Optional[List[Tuple[int, float, bool, bool]]] = None
        # Distributed, the origin not known on the host yet: found on the device (a 0-d tensor,
        # -1 for none), for the exchange's header.
        self.origin_device: Any = None


class Pending:
    """A step whose statistics are on their way to the host (CUDA), or to and from the other
    ranks (distributed: ``exchange``, see :mod:`._distributed`)."""

    __slots__ = ("layout", "host", "event", "refs", "exchange")

    def __init__(
        self, layout: Layout, host: Optional[np.ndarray], event: Any, refs: List[Tuple[int, Any, Any]],
        exchange: Any = None,
    ) -> None:
        self.layout = layout
        self.host = host
        self.event = event
        self.refs = refs
        self.exchange = exchange

    def ready(self) -> bool:
        """Whether handing it over now costs no wait: a copy the device has not finished (the
        GPU is behind the CPU, the normal state of a GPU-bound loop), or a collective still in
        flight, is left for later (the next step's observation, the end of the run, or a read of
        the results), never waited for on the step's critical path."""
        if self.exchange is not None:
            return bool(self.exchange.done())
        return self.event is None or bool(self.event.query())




def flatten(parts: "List[torch.Tensor]") -> "Optional[torch.Tensor]":
    """One float32 vector of every part, on the first part's device."""
    if not parts:
        return None
    import torch

    device = parts[0].device
    if any(p.device != device for p in parts):
        parts = [p.to(device) for p in parts]
    if len(parts) == 1:
        return parts[0].reshape(-1)
    # One call: the parts are viewed flat and concatenated in C++ (a Python reshape per part
    # costs microseconds on a fast step). Parts of any shape, 0-d included.
    return torch._C._nn.flatten_dense_tensors(parts)


def clip_ratio(before: float, after: float) -> Optional[float]:
    """The ``clip_ratio`` fact: one gradient's norm as the optimizer received it over its norm
    when the backward produced it (None when that says nothing: no gradient, NaN/Inf)."""
    if before > 0.0 and math.isfinite(before) and math.isfinite(after):
        return after / before
    return None


class HostCopy:
    """Asynchronous copies of step vectors into two reused pinned buffers, in turn (CUDA): a
    step's buffer is written again two steps later, when the collector has handed it over."""

    def __init__(self) -> None:
        self.pinned: List[Any] = [None, None]
        self.turn = 0

    def start(self, flat: "torch.Tensor") -> Tuple[np.ndarray, Any]:
        import torch

        n = int(flat.numel())
        if flat.device.type != "cuda":
            # The deferred path without a GPU (tests): a plain copy, consumed later alike.
            return flat.detach().clone().numpy(), None
        k = self.turn
        self.turn ^= 1
        if self.pinned[k] is None or self.pinned[k].numel() < n:
            self.pinned[k] = torch.empty(max(n, 256) * 2, dtype=torch.float32, pin_memory=True)
        dst = self.pinned[k][:n]
        dst.copy_(flat, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(flat.device))
        return dst.numpy(), event


class HostStep:
    """One step computed on the host (a CPU model): its statistics, and what :class:`Layout`
    says of a device step (no vector, no transfer)."""

    __slots__ = ("step", "lr", "final", "origin", "checked", "ran",
                 "grad_norms", "weight_norms", "activations", "loss", "inputs")

    def __init__(self, step: int, lr: Optional[float], final: bool, grad_norms: np.ndarray) -> None:
        self.step = step
        self.lr = lr
        self.final = final
        self.origin: Optional[int] = None
        self.checked = False
        self.ran: Optional[List[int]] = None
        self.grad_norms = grad_norms
        self.weight_norms: Optional[np.ndarray] = None
        self.activations: Optional[np.ndarray] = None
        self.loss: Optional[float] = None
        self.inputs: Optional[List[float]] = None  # 4 statistics per forward pass, in a row


class Unpacked:
    """One step's statistics as the engine takes them (host arrays)."""

    __slots__ = ("grad_norms", "weight_norms", "activations", "loss", "inputs", "facts")

    def __init__(self, layout: Layout, flat: np.ndarray, no_grads: np.ndarray, n_probes: int) -> None:
        off = 0
        grad_norms = no_grads.copy()
        order = layout.grad_order
        if order is not None:
            grad_norms[order] = flat[: order.size]
            off = order.size
        self.grad_norms = grad_norms
        self.weight_norms: Optional[np.ndarray] = None
        if layout.weight_order is not None:
            k = layout.weight_order.size
            weight_norms = no_grads.copy()
            weight_norms[layout.weight_order] = flat[off : off + k]
            off += k
            self.weight_norms = weight_norms
        self.activations: Optional[np.ndarray] = None
        if layout.act_index is not None:
            table = np.full(n_probes * 5, np.nan, dtype=np.float32)
            table[layout.act_index] = flat[off : off + layout.n_act]
            off += layout.n_act
            table[4::5] = layout.act_samples
            self.activations = table
        self.loss: Optional[float] = None
        if layout.loss:
            self.loss = float(flat[off])
            off += 1
        if layout.loss_floats is not None:
            total, n, k = layout.loss_floats
            self.loss = ((self.loss or 0.0) * k + total) / (k + n)
        self.inputs: Optional[np.ndarray] = None
        if layout.n_inputs:
            self.inputs = np.ascontiguousarray(flat[off : off + 4 * layout.n_inputs])
            off += 4 * layout.n_inputs
        self.facts: Dict[str, float] = {}
        if layout.clip_index is not None:
            ratio = clip_ratio(float(grad_norms[layout.clip_index]), float(flat[off]))
            off += 1
            if ratio is not None:
                self.facts["clip_ratio"] = ratio
        if layout.loss_scale:
            self.facts["loss_scale"] = float(flat[off])
            off += 1
        if layout.skipped is not None:
            self.facts["optimizer_skipped"] = 1.0 if layout.skipped else 0.0
