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
    """One step's statistics on their way to the host: the parts of its flat float32 vector,
    each under its name (:meth:`add`; the vector is their concatenation, in the order added),
    and where each part sits once flattened (:meth:`read`), with what is known on the host.

    The names: ``grad`` and ``weight`` (norms, indexed by parameter), ``activation`` (cells
    of the engine's activation table), ``loss``, ``input`` (4 statistics per forward pass),
    ``clip`` (the clipping check's gradient norm), ``loss_scale``, ``output_absmax``
    (indexed by engine module), ``grad_zero`` (zero-row then zero-column shares, indexed by
    parameter), ``update_ratio`` and ``update_direction`` (how far, and along or against the
    gradient, the optimizer step moved each sampled parameter, indexed by parameter),
    ``summary`` (the step's module-call summaries).
    """

    __slots__ = (
        "act_samples",
        "checked",
        "clip_index",
        "facts",
        "final",
        "loss_floats",
        "lr",
        "origin",
        "origin_device",
        "parts",
        "ran",
        "size",
        "skipped",
        "slots",
        "step",
        "summary",
        "summary_calls",
        "summary_out",
    )

    def __init__(self, step: int, lr: Optional[float], final: bool) -> None:
        self.step = step
        self.lr = lr
        self.final = final
        # The device tensors added, until flattened; name -> (offset, size, index).
        self.parts: List[Any] = []
        self.slots: Dict[str, Tuple[int, int, Optional[np.ndarray]]] = {}
        self.size = 0
        # Samples per unit of each activation module (known on the host).
        self.act_samples: Optional[np.ndarray] = None
        # Losses given as numbers (record_loss): (their sum, how many, how many tensors).
        self.loss_floats: Optional[Tuple[float, int, int]] = None
        # Found when the loss appeared (CPU): the non-finite origin (and whether the outputs were
        # scanned at all), and which modules ran.
        self.origin: Optional[int] = None
        self.checked = False
        self.ran: Optional[List[int]] = None
        # The parameter whose gradient norm the ``clip`` part holds, as the optimizer received it.
        self.clip_index: Optional[int] = None
        # Under a GradScaler: whether its step skipped the optimizer (None: no scaler).
        self.skipped: Optional[bool] = None
        # Facts about the loop in this step (training mode, gradient accumulation).
        self.facts: Optional[Dict[str, float]] = None
        # The summaries' calls, whether they give the output scales, and (on the host) what
        # they say (see _measure.Summaries).
        self.summary_calls: Optional[List[Tuple[int, int, int]]] = None
        self.summary_out = False
        self.summary: Optional[List[Tuple[int, float, bool, bool]]] = None
        # Distributed, the origin not known on the host yet: found on the device (a 0-d tensor,
        # -1 for none), for the exchange's header.
        self.origin_device: Any = None

    def add(self, name: str, parts: List[torch.Tensor], index: Optional[np.ndarray] = None) -> None:
        """Adds the step's ``parts`` (device tensors, concatenated flat) under ``name``;
        ``index``: what each of their values is an entry of (parameter, cell, module)."""
        n = 0
        for t in parts:
            n += t.numel()
        self.slots[name] = (self.size, n, index)
        self.size += n
        self.parts.extend(parts)

    def has(self, name: str) -> bool:
        return name in self.slots

    def index(self, name: str) -> Optional[np.ndarray]:
        slot = self.slots.get(name)
        return None if slot is None else slot[2]

    def count(self, name: str) -> int:
        slot = self.slots.get(name)
        return 0 if slot is None else slot[1]

    def read(self, flat: Any, name: str) -> Any:
        """The values of part ``name`` in the step's flattened vector (host or device), or None."""
        slot = self.slots.get(name)
        if slot is None or flat.shape[0] < slot[0] + slot[1]:
            return None
        return flat[slot[0] : slot[0] + slot[1]]


class Pending:
    """A step whose statistics are on their way to the host (CUDA), or to and from the other
    ranks (distributed: ``exchange``, see :mod:`._distributed`)."""

    __slots__ = ("event", "exchange", "host", "layout", "refs")

    def __init__(
        self,
        layout: Layout,
        host: Optional[np.ndarray],
        event: Any,
        refs: List[Tuple[int, Any, Any]],
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


def flatten(parts: List[torch.Tensor]) -> Optional[torch.Tensor]:
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
    when the backward produced it (None when that says nothing: no gradient from the backward,
    NaN/Inf). 0 when the optimizer received none (``after`` < 0: ``.grad`` was set to None in
    between, as ``zero_grad()`` between ``backward()`` and ``step()`` does)."""
    if before > 0.0 and math.isfinite(before) and math.isfinite(after):
        return max(after, 0.0) / before
    return None


class HostCopy:
    """Asynchronous copies of step vectors into two reused pinned buffers, in turn (CUDA): a
    step's buffer is written again two steps later, when the collector has handed it over."""

    def __init__(self) -> None:
        self.pinned: List[Any] = [None, None]
        self.turn = 0

    def start(self, flat: torch.Tensor) -> Tuple[np.ndarray, Any]:
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

    __slots__ = (
        "activations",
        "checked",
        "final",
        "grad_norms",
        "inputs",
        "loss",
        "lr",
        "origin",
        "ran",
        "step",
        "weight_norms",
    )

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
    """One step's statistics as the engine takes them (host arrays), read from its vector."""

    __slots__ = ("activations", "facts", "grad_norms", "inputs", "loss", "weight_norms")

    def __init__(self, layout: Layout, flat: np.ndarray, no_grads: np.ndarray, n_probes: int) -> None:
        grad_norms = no_grads.copy()
        order = layout.index("grad")
        if order is not None:
            grad_norms[order] = layout.read(flat, "grad")
        self.grad_norms = grad_norms
        self.weight_norms: Optional[np.ndarray] = None
        order = layout.index("weight")
        if order is not None:
            weight_norms = no_grads.copy()
            weight_norms[order] = layout.read(flat, "weight")
            self.weight_norms = weight_norms
        self.activations: Optional[np.ndarray] = None
        cells = layout.index("activation")
        if cells is not None:
            table = np.full(n_probes * 5, np.nan, dtype=np.float32)
            table[cells] = layout.read(flat, "activation")
            table[4::5] = layout.act_samples
            self.activations = table
        self.loss: Optional[float] = None
        if layout.has("loss"):
            self.loss = float(layout.read(flat, "loss")[0])
        if layout.loss_floats is not None:
            total, n, k = layout.loss_floats
            self.loss = ((self.loss or 0.0) * k + total) / (k + n)
        self.inputs: Optional[np.ndarray] = None
        if layout.has("input"):
            self.inputs = np.ascontiguousarray(layout.read(flat, "input"))
        self.facts: Dict[str, float] = {}
        if layout.clip_index is not None and layout.has("clip"):
            ratio = clip_ratio(float(grad_norms[layout.clip_index]), float(layout.read(flat, "clip")[0]))
            if ratio is not None:
                self.facts["clip_ratio"] = ratio
        if layout.has("loss_scale"):
            self.facts["loss_scale"] = float(layout.read(flat, "loss_scale")[0])
        if layout.skipped is not None:
            self.facts["optimizer_skipped"] = 1.0 if layout.skipped else 0.0


def per_parameter(n: int, index: np.ndarray, values: np.ndarray) -> np.ndarray:
    """A per-parameter measure's table: ``values`` at ``index``, NaN (not measured) elsewhere."""
    table = np.full(n, np.nan, dtype=np.float32)
    table[index] = values
    return table
