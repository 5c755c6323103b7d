"""Where a NaN/Inf first appeared: the module whose output went non-finite first in a step's
forward pass.

Only a step whose gradients or loss are not finite is searched: its kept module calls are
scanned in forward order (:meth:`OriginSearch.scan`), or their device summaries read, or, when
the step kept none (the host path's unhooked steps), its forward passes are computed again
while the parameters are unchanged (``WatchedModel.replay``). A healthy step costs nothing here.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any, List, Optional, Tuple

import numpy as np

from ._measure import read_summaries

if TYPE_CHECKING:  # pragma: no cover
    from ._collect import Collector


class OriginSearch:
    """The non-finite origin of one collector's steps."""

    def __init__(self, c: Collector) -> None:
        self.c = c

    def scan(self, refs: List[Tuple[int, Any, Any]]) -> Tuple[Optional[int], bool]:
        """The module where this step's forward first went non-finite, and whether that was
        known: from the summarized or kept module calls, or by computing the model's forward
        passes again (no call kept)."""
        c = self.c
        if c.summaries:  # summarized on the device (a host read: this is a failure step)
            vec = c.summaries.vector()
            summary = read_summaries(c.summaries.calls, vec.detach().cpu().numpy())
            return c.watched.first_nonfinite_summary(summary), True
        calls = c.cur.root_calls[c.cur.released :]
        kept = c.hooks.hold[0]
        if not calls or (c.hooks.modules_armed and (kept is True or kept is False)):
            return c.watched.first_nonfinite(refs), True
        replayed = c.watched.replay(c.model, calls)
        if replayed is None:
            return None, False
        return c.watched.first_nonfinite(replayed), True

    def on_device(self, vals: Any) -> Any:
        """The origin in the step's summary vector ``vals``, found on the device (distributed:
        each rank's origin goes into the exchange before any vector reaches a host)."""
        from ._distributed import _to_device

        c = self.c
        watched = c.watched

        def ranks_of(calls: List[Tuple[int, int, int]]) -> Tuple[np.ndarray, np.ndarray]:
            own = [watched.rank.get(i, -1) for i, _, _ in calls]
            enclosing = [watched.rank.get(i if i == 0 else watched._enclosing(i), -1) for i, _, _ in calls]
            return np.asarray(own, dtype=np.float32), np.asarray(enclosing, dtype=np.float32)

        torch = c.torch
        return c.summaries.origin(vals, ranks_of, lambda a, device: _to_device(torch, a, device))

    def unobserved_failed(self) -> bool:
        """Whether the forward pass not yet observed produced a NaN/Inf (read at exit only)."""
        c = self.c
        s = c.cur
        torch = c.torch
        try:
            with torch.no_grad():
                for t in [*s.losses, *s.auto_losses, *s.inputs, *s.raw_inputs]:
                    if isinstance(t, float):
                        if not math.isfinite(t):
                            return True
                    elif not bool(torch.isfinite(t).all()):
                        return True
                if not all(math.isfinite(v) for v in s.host_inputs):
                    return True
                vec = c.summaries.vector()
                if vec is not None and not bool(torch.isfinite(vec).all()):
                    return True
                return bool(c.refs) and c.watched.first_nonfinite(c.refs) is not None
        except Exception:  # pragma: no cover - exit must never raise
            return False
