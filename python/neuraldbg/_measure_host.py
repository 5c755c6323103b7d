"""What is measured on the host: the statistics of :class:`~._measure.Measurer` as host arrays,
for a CPU model, read by the extension's ``TensorReader`` straight from the tensors' memory (no
torch operation), or by the torch path where it cannot read a tensor."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import numpy as np

from ._measure import Measurer, Probe, input_stats, kept_outputs, torch_module
from ._step import UNKNOWN


def reader() -> Any:
    """The extension's tensor reader (one per process), or None when it is unavailable."""
    global _READER
    if _READER is None:
        torch = torch_module()
        try:
            from . import _native

            # torch's DLPack exporter tells a tensor's dtype, device, shape, strides and address
            # in one call (the reader falls back to asking each when torch has none); DLPack
            # 1.3's exchange API (torch >= 2.10) does it without a capsule, for torch.Tensor.
            _READER = _native.TensorReader(
                (torch.Tensor, torch.nn.Parameter),
                torch.float32,
                torch.float64,
                torch.float16,
                torch.bfloat16,
                getattr(torch._C, "_to_dlpack", None),
                getattr(torch.Tensor, "__dlpack_c_exchange_api__", None),
            )
        except (ImportError, AttributeError):  # pragma: no cover - an extension built without it
            _READER = False
    return _READER or None


_READER: Any = None


def _host(t: Any) -> np.ndarray:
    """A float32 host array of a torch tensor (no copy on CPU)."""
    return t.detach().to("cpu", torch_module().float32).reshape(-1).numpy()


class HostMeasurer:
    """The statistics of :class:`Measurer`, as host arrays, for a model on the CPU: read by the
    extension from the tensors' memory, or by the torch path where it cannot."""

    def __init__(self, measure: Measurer, n_params: int) -> None:
        self.measure = measure
        self.reader = reader()
        self.torch = torch_module()
        self.n_params = n_params
        self.one: List[Any] = [None]
        # The probes last measured and their specs (the same list every sampled step).
        self.specs: Optional[Tuple[Sequence[Probe], List[Any]]] = None

    def norms(self, items: Sequence[Any], attr: Optional[str] = None) -> np.ndarray:
        """L2 norm of each tensor (``getattr(item, attr)`` when ``attr`` is given; -1 where
        that is None)."""
        out = np.empty(len(items), dtype=np.float32)
        r = self.reader
        if r is not None and r.norms(items, out, attr):
            return out
        tensors = [getattr(x, attr) for x in items] if attr else list(items)
        parts: List[Any] = []
        with self.torch.no_grad():
            if len(items) != self.n_params:  # not the model's parameters: no plan
                present = [k for k, t in enumerate(tensors) if t is not None]
                order = np.asarray(present, dtype=np.intp) if present else None
                if present:
                    self.measure.generic_norms([tensors[k] for k in present], parts)
            elif attr:
                order = self.measure.gradient_norms(tensors, parts)
            else:
                order = self.measure.weight_norms(tensors, parts)
        out.fill(-1.0)
        if order is not None and parts:
            out[order] = np.concatenate([_host(p) for p in parts])
        return out

    def grad_norms(
        self, params: Sequence[Any], out: np.ndarray, zeros: Optional[Tuple[np.ndarray, np.ndarray]] = None
    ) -> int:
        """L2 norm of each parameter's gradient into ``out`` (-1 where None), and what they
        hold (``TensorReader.grad_norms``'s flags; 8 when read by torch: not said, and
        ``zeros`` not filled). With ``zeros`` (rows, cols), the gradients' zero shares (see
        :meth:`zero_shares`) are read in the same pass."""
        r = self.reader
        if r is not None:
            flags = r.grad_norms(params, out, -1.0, *(zeros or (None, None)))
            if flags >= 0:
                return flags  # type: ignore[no-any-return]
        out[:] = self.norms(params, "grad")
        return UNKNOWN

    def norm(self, item: Any, attr: str) -> float:
        """L2 norm of ``getattr(item, attr)`` (-1 when None)."""
        r = self.reader
        v = r.norm(item, attr) if r is not None else None
        if v is not None:
            return v  # type: ignore[no-any-return]
        one = self.one
        one[0] = item
        return float(self.norms(one, attr)[0])

    def scalar(self, t: Any) -> float:
        r = self.reader
        v = r.scalar(t) if r is not None else None
        return float(t.detach().item()) if v is None else v

    def stats(self, x: Any) -> Tuple[float, float, float, float]:
        """``min, max, mean, std`` of one input batch."""
        r = self.reader
        v = r.stats(x) if r is not None else None
        if v is None:
            with self.torch.no_grad():
                a = _host(input_stats(x.detach()))
            return (float(a[0]), float(a[1]), float(a[2]), float(a[3]))
        return v

    def absmax(
        self, refs: Sequence[Tuple[int, Any, Any]], rank: Dict[int, int]
    ) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Largest magnitude of each kept module output: (values, engine module indices)."""
        rd = self.reader
        if rd is not None:
            # Outputs that are plain tensors (every recorded layer's) go to the extension as
            # they are; an empty one reads NaN, i.e. not measured, as kept_outputs leaves it.
            tensor = self.torch.Tensor
            outs: List[Any] = []
            ranks: List[int] = []
            for i, out, _ in refs:
                r = rank.get(i)
                if out is not None and r is not None:
                    outs.append(out)
                    ranks.append(r)
            if outs and all(type(out) is tensor for out in outs):
                values = np.empty(len(outs), dtype=np.float32)
                if rd.absmax(outs, values, np.nan):
                    return values, np.asarray(ranks, dtype=np.intp)
        tensors, ranks = kept_outputs(refs, rank)
        if not tensors:
            return None
        out = np.empty(len(tensors), dtype=np.float32)
        rd = self.reader
        if rd is None or not rd.absmax(tensors, out):
            staged = self.measure.output_absmax(
                [(i, t, None) for i, t in enumerate(tensors)], {i: i for i in range(len(tensors))}
            )
            assert staged is not None
            out = _host(staged[0])
        return out, np.asarray(ranks, dtype=np.intp)

    def zero_shares(self, params: Sequence[Any]) -> Optional[Tuple[np.ndarray, np.ndarray]]:
        """Per parameter, the share of its gradient's rows and of its columns that are exactly
        zero (NaN where not measured: no gradient, or fewer than 2 dimensions)."""
        n = len(params)
        rows = np.empty(n, dtype=np.float32)
        cols = np.empty(n, dtype=np.float32)
        r = self.reader
        if r is None or not r.zero_shares(params, rows, cols, "grad"):
            rows.fill(np.nan)
            cols.fill(np.nan)
            staged = self.measure.grad_zero_shares([p.grad for p in params])
            if staged is None:
                return None
            vec, index = _host(staged[0]), staged[1]
            rows[index] = vec[: index.size]
            cols[index] = vec[index.size :]
        return rows, cols

    def activations(self, probes: Sequence[Probe], outs: Sequence[Any]) -> Optional[np.ndarray]:
        """The engine's activation table (5 values per probe row; NaN where not measured)."""
        table = np.full(len(probes) * 5, np.nan, dtype=np.float32)
        r = self.reader
        specs = self.specs
        if specs is None or specs[0] is not probes or len(specs[1]) != len(probes):
            specs = self.specs = (probes, [p.spec for p in probes])
        if r is not None and r.activations(outs, specs[1], table):
            return table
        staged = self.measure.activation_parts(probes, outs)
        if staged is None:
            return None
        parts, index, samples = staged
        table.fill(np.nan)
        table[index] = np.concatenate([_host(p) for p in parts])
        table[4::5] = samples
        return table
