"""What a run's diagnosis offers, live (``NeuralDbg``) or from a trace (``neuraldbg.load``).

Everything here reads the engine: no torch, no diagnosis logic. The HTML shown in notebooks is
the report's own page (``neuraldbg_core::report``), embedded in an ``<iframe srcdoc>`` so its
style and script cannot touch the notebook's, and it loads nothing from the network.
"""

from __future__ import annotations

import json
import os
from typing import Any, Dict, List, Optional, Set, Tuple, Union

import numpy as np

from .errors import ConfigError, NeuralDbgError, UnknownNameError
from .types import CausalHypothesis, CoupledFailure, Failure, RootCause, SemanticEvent

__all__ = ["Hypotheses", "Results", "newly_confirmed"]

_TABLES = ("history", "events", "hypotheses")


def _frame_html(page: str, height: int) -> str:
    """A report page as a self-contained notebook output: an iframe holding the page, resized
    to its content once drawn (where the notebook lets scripts run; else ``height`` pixels)."""
    fit = "try{var d=this.contentDocument;if(d){this.style.height=(d.documentElement.scrollHeight+8)+'px';}}catch(e){}"
    # Single-quoted, so that only `&` and `'` need escaping: the page's JSON is full of `"`,
    # and escaping those (and `<`, `>`) made the notebook's copy half again the report's size.
    srcdoc = page.replace("&", "&amp;").replace("'", "&#39;")
    return (
        f"<iframe class=\"neuraldbg-report\" srcdoc='{srcdoc}' "
        f'style="width:100%;height:{height}px;border:1px solid #dde1e8;border-radius:6px" '
        f'onload="{fit}" title="NeuralDBG report"></iframe>'
    )


def newly_confirmed(
    engine: Any, seen: Set[Tuple[str, Optional[str]]]
) -> Tuple[List[CausalHypothesis], List[CausalHypothesis]]:
    """The hypotheses confirmed so far (confidence >= 0.5), and those of them not yet in
    ``seen`` (added to it): each failure and layer is new once, for ``on_failure``/``halt_on``."""
    hyps = [CausalHypothesis._from_json(h) for h in json.loads(engine.explain_json(None))]
    confirmed = [h for h in hyps if h.confidence >= 0.5]
    new = []
    for h in confirmed:
        key = (str(h.failure), h.layer)
        if key not in seen:
            seen.add(key)
            new.append(h)
    return confirmed, new


class Hypotheses(List[CausalHypothesis]):
    """The ranked hypotheses of :meth:`~neuraldbg.NeuralDbg.explain_failure`: a plain ``list``
    that notebooks display as the report's verdict."""

    _engine: Any = None
    _failure: Optional[str] = None

    def __str__(self) -> str:
        # One line per hypothesis (``print(dbg.explain_failure())``), not the dataclasses.
        return "\n".join(str(h) for h in self) if self else "[]"

    __repr__ = __str__

    def _repr_html_(self) -> Optional[str]:
        if self._engine is None:
            return None
        page = self._engine.report_html("NeuralDBG verdict", "verdict", self._failure)
        return _frame_html(page, 140 + 170 * min(len(self), 3))


class Results:
    """The members a diagnosis has, whoever fed the engine. Subclasses set ``_engine`` and may
    override ``_sync`` and ``_title``."""

    _engine: Any

    def _sync(self) -> None:
        """Makes sure the engine has seen every completed step (live runs)."""

    def _title(self) -> str:
        return "NeuralDBG report"

    @property
    def events(self) -> List[SemanticEvent]:
        """Semantic events (confirmed health transitions), in step order."""
        self._sync()
        return [SemanticEvent._from_json(e) for e in json.loads(self._engine.events_json())]

    def explain_failure(self, failure_type: Union[str, Failure, None] = None) -> Hypotheses:
        """Ranked causal hypotheses, most likely first (a ``list``).

        With no argument, explains whatever went wrong; with a failure name (see
        :class:`~neuraldbg.Failure`) only that failure. A healthy run returns no hypothesis with
        confidence >= 0.5. In a notebook the list displays as the report's verdict.
        """
        self._sync()
        name = None if failure_type is None else str(failure_type)
        out = Hypotheses(CausalHypothesis._from_json(h) for h in json.loads(self._engine.explain_json(name)))
        out._engine = self._engine
        out._failure = name
        return out

    def get_root_causes(self) -> List[RootCause]:
        """The root of each failure that no other failure explains, in step order."""
        self._sync()
        return [RootCause._from_json(r) for r in json.loads(self._engine.root_causes_json())]

    def detect_coupled_failures(self, window: int = 5) -> List[CoupledFailure]:
        """Pairs of failure events within ``window`` steps: ``structural`` when they are in
        adjacent layers (N and N-1 in forward order), ``temporal`` otherwise."""
        if isinstance(window, bool) or not isinstance(window, int) or window < 0:
            raise ConfigError(f"window must be a non-negative integer, got {window!r}")
        self._sync()
        return [CoupledFailure._from_json(c) for c in json.loads(self._engine.couplings_json(window))]

    def trace_causal_chain(self, kind: Union[str, Failure]) -> List[SemanticEvent]:
        """The events of the most significant ``kind`` failure, from its root cause through its
        consequences."""
        self._sync()
        return [SemanticEvent._from_json(e) for e in json.loads(self._engine.causal_chain_json(str(kind)))]

    def export_mermaid_causal_graph(self) -> str:
        """The causal graph (causes -> failures -> consequences) as a Mermaid flowchart."""
        self._sync()
        return str(self._engine.mermaid())

    def report_html(self, title: Optional[str] = None) -> str:
        """The self-contained HTML report of the run as a string (see :meth:`save_report`)."""
        self._sync()
        return str(self._engine.report_html(self._title() if title is None else str(title)))

    def save_report(self, path: Union[str, os.PathLike[str]], title: Optional[str] = None) -> None:
        """Writes a self-contained HTML report of the run to ``path`` (UTF-8).

        Open it in any browser, offline: it loads nothing from the network. It shows the
        verdict first (the ranked hypotheses with their remedies), a layers x steps heatmap of
        gradient norms (log colour scale, thresholds marked, the root-cause layer and onset
        step highlighted), the gradient-norm curves of the implicated layers, the event
        timeline and the causal graph. Long or wide runs are downsampled keeping each bucket's
        minimum and maximum, so a NaN or a spike always shows; the file stays a few MB at most.

        Can be called during training (a snapshot so far) or after it.
        """
        page = self.report_html(title)
        directory = os.path.dirname(os.fspath(path))
        if directory:  # as `report=` and `neuraldbg report -o` do
            os.makedirs(directory, exist_ok=True)
        with open(os.fspath(path), "w", encoding="utf-8") as f:
            f.write(page)

    def history(
        self, layer: Optional[str], metric: str = "grad_norm", reduce: str = "last"
    ) -> Tuple[np.ndarray, np.ndarray]:
        """``(steps, values)`` of one series, for plotting.

        ``layer`` is a qualified module name (``model.named_modules()``), or None for run-wide
        series. Layer metrics: ``grad_norm``, ``weight_norm``; activation modules:
        ``saturated_fraction``, ``dead_fraction``, ``activation_absmax``; run-wide: ``loss``,
        ``lr``, ``grad_norm`` (total), ``input_scale``. Memory is bounded: long runs are
        downsampled into buckets (``reduce``: ``last``, ``min`` or ``max`` of each bucket;
        ``max`` is NaN for a bucket that held a NaN/Inf).
        """
        if layer is not None and not isinstance(layer, str):
            raise ConfigError(
                f"layer must be a qualified module name (a str such as {self._example_layer()!r}) "
                f"or None for run-wide series, got {type(layer).__qualname__} {layer!r}"
            )
        if not isinstance(metric, str) or not isinstance(reduce, str):
            bad = ("metric", metric) if not isinstance(metric, str) else ("reduce", reduce)
            raise ConfigError(f"{bad[0]} must be a str, got {type(bad[1]).__qualname__} {bad[1]!r}")
        self._sync()
        if layer is not None and not self._engine.registered:
            raise UnknownNameError(f"no layer {layer!r} has a history: no training step was observed")
        steps, values = self._engine.history(layer, metric, reduce)
        return np.asarray(steps), np.asarray(values)

    def _example_layer(self) -> str:
        """A layer name of this run, for error messages."""
        try:
            keys = self._engine.history_table()[0]
        except Exception:  # no model registered yet
            return "encoder.layer.3"
        names = [k[1] for k in keys if k[0] == "layer" and k[1]]
        return names[0] if names else "encoder.layer.3"

    # ------------------------------------------------------------ data frames

    def _columns(self, table: str) -> Dict[str, Any]:
        """The columns of ``table`` as numpy arrays and lists (what both data-frame libraries
        take)."""
        if table not in _TABLES:
            raise ConfigError(f"table must be one of {', '.join(_TABLES)}, got {table!r}")
        self._sync()
        if table == "history":
            keys, series, first, step, value, lo, hi = self._engine.history_table()
            index = np.asarray(series, dtype=np.int64)
            pick = lambda i: np.asarray([k[i] for k in keys], dtype=object)[index]  # noqa: E731
            return {
                "step": np.asarray(step),
                "first_step": np.asarray(first),
                "group": pick(0),
                "layer": pick(1),
                "metric": pick(2),
                "value": np.asarray(value),
                "min": np.asarray(lo),
                "max": np.asarray(hi),
            }
        if table == "events":
            events = json.loads(self._engine.events_json())
            return {
                "step": np.asarray([e["step"] for e in events], dtype=np.uint64),
                "layer": [e["layer_name"] for e in events],
                "event_type": [e["event_type"] for e in events],
                "from_state": [e["from_state"] for e in events],
                "to_state": [e["to_state"] for e in events],
                "confidence": np.asarray([e["confidence"] for e in events], dtype=np.float64),
                "value": np.asarray([_number(e["metadata"]["value"]) for e in events]),
                "threshold": np.asarray([_number(e["metadata"]["threshold"]) for e in events]),
                "confirmed_step": np.asarray([e["metadata"]["confirmed_step"] for e in events], dtype=np.uint64),
            }
        hyps = json.loads(self._engine.explain_json(None))
        return {
            "rank": np.arange(1, len(hyps) + 1, dtype=np.int64),
            "failure": [h["failure"] for h in hyps],
            "cause": [h["cause"] for h in hyps],
            "layer": [h["layer"] for h in hyps],
            "step": [h["step"] for h in hyps],
            "confidence": np.asarray([h["confidence"] for h in hyps], dtype=np.float64),
            "description": [h["description"] for h in hyps],
            "remedies": [list(h["remedies"]) for h in hyps],
        }

    def to_pandas(self, table: str = "history") -> Any:
        """The run's data as a ``pandas.DataFrame`` (pandas is an optional dependency).

        ``table="history"`` (default): every per-layer, per-activation and run-wide series in
        long form, one row per series and history bucket that holds a value: ``step``
        (the bucket's last step), ``first_step``, ``group`` (``layer``, ``activation`` or
        ``run``), ``layer`` (qualified module name; None for run-wide series), ``metric``
        (as :meth:`history` names it), ``value`` (the last value; NaN/Inf kept), ``min`` and
        ``max`` (the bucket's extremes; ``max`` is NaN when it held a NaN/Inf). Until a run
        outgrows the history (``history_capacity`` buckets), each bucket is one step. The same
        rows as ``neuraldbg export --format parquet``. Pivot for a step x layer grid::

            df = dbg.to_pandas()
            layers = df[(df.group == "layer") & (df.metric == "grad_norm")]
            grid = layers.pivot(index="step", columns="layer", values="value")

        ``table="events"``: one row per semantic event; ``table="hypotheses"``: the ranking.
        """
        try:
            import pandas as pd
        except ImportError as e:
            raise NeuralDbgError("to_pandas() needs pandas: pip install pandas") from e
        cols = self._columns(table)
        df = pd.DataFrame(cols)
        for name in ("group", "layer", "metric", "event_type", "from_state", "to_state"):
            if name in df and table != "hypotheses":
                df[name] = df[name].astype("category")
        return df

    def to_polars(self, table: str = "history") -> Any:
        """:meth:`to_pandas` as a ``polars.DataFrame`` (polars is an optional dependency)."""
        try:
            import polars as pl
        except ImportError as e:
            raise NeuralDbgError("to_polars() needs polars: pip install polars") from e
        cols = self._columns(table)
        return pl.DataFrame(
            {k: list(v) if isinstance(v, np.ndarray) and v.dtype == object else v for k, v in cols.items()}
        )

    # ------------------------------------------------------------ notebooks

    def _repr_html_(self) -> str:
        """The report's verdict and heatmap, for Jupyter (the same page as the report)."""
        self._sync()
        page = self._engine.report_html(self._title(), "verdict_heatmap", None)
        return _frame_html(page, 640)


def _number(v: Any) -> float:
    """A JSON number, or the name JSON gives a non-finite one (``NaN``, ``Infinity``)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return float("nan")
