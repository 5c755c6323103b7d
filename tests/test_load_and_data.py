"""A trace opened from Python (``neuraldbg.load``), the run's data as data frames
(``to_pandas``) and as Parquet (``neuraldbg export --format parquet``)."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path
from typing import List, Tuple

import numpy as np
import pytest
import torch
import torch.nn as nn

import neuraldbg
from neuraldbg import NeuralDbg, NeuralDbgWarning, TraceError, TraceRun

CLI = str(Path(sys.executable).parent / "neuraldbg")


def exploding_run(path: Path) -> Tuple[NeuralDbg, nn.Module, List[float]]:
    """A small ReLU net with a learning rate so high that it blows up; returns the debugger, the
    model and the first layer's gradient norms measured directly with torch."""
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=50.0)
    crit = nn.MSELoss()
    norms: List[float] = []
    with NeuralDbg(model, trace=path, criterion=crit) as dbg:
        for _ in range(25):
            opt.zero_grad()
            crit(model(torch.randn(16, 8) * 3), torch.randn(16, 2) * 10).backward()
            g = [p.grad for p in model[0].parameters() if p.grad is not None]
            norms.append(float(torch.sqrt(sum((x.double() ** 2).sum() for x in g))))
            opt.step()
    return dbg, model, norms


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Tuple[NeuralDbg, Path, List[float]]:
    path = tmp_path_factory.mktemp("load") / "run.ndbg"
    dbg, _, norms = exploding_run(path)
    assert dbg.explain_failure() and dbg.events, "the run must fail for comparisons to mean something"
    return dbg, path, norms


def same_nan(a: np.ndarray, b: np.ndarray) -> bool:
    return bool(np.array_equal(np.asarray(a, dtype=float), np.asarray(b, dtype=float), equal_nan=True))


def test_load_has_the_members_of_a_live_dbg(run) -> None:
    dbg, path, _ = run
    loaded = neuraldbg.load(path)
    assert isinstance(loaded, TraceRun) and loaded.closed and loaded.damage is None
    assert loaded.step == dbg.step  # completed steps, as the live debugger counts them
    assert loaded.meta["model"] == "Sequential" and isinstance(loaded.meta["pid"], int)
    assert [str(e) for e in loaded.events] == [str(e) for e in dbg.events]
    assert [str(h) for h in loaded.explain_failure()] == [str(h) for h in dbg.explain_failure()]
    top = dbg.explain_failure()[0].failure
    assert [str(h) for h in loaded.explain_failure(top)] == [str(h) for h in dbg.explain_failure(top)]
    assert [str(r) for r in loaded.get_root_causes()] == [str(r) for r in dbg.get_root_causes()]
    assert loaded.export_mermaid_causal_graph() == dbg.export_mermaid_causal_graph()
    for layer, metric in [("0", "grad_norm"), ("1", "dead_fraction"), (None, "loss")]:
        s1, v1 = loaded.history(layer, metric)
        s2, v2 = dbg.history(layer, metric)
        assert np.array_equal(s1, s2) and same_nan(v1, v2)
    assert loaded.report_html("t") == dbg.report_html("t")
    assert "TraceRun(" in repr(loaded) and "closed" in repr(loaded)


def test_load_errors_and_damage(tmp_path: Path, run) -> None:
    _, path, _ = run
    with pytest.raises(TraceError, match="No such file"):
        neuraldbg.load(tmp_path / "missing.ndbg")
    (tmp_path / "x.txt").write_text("hello")
    with pytest.raises(TraceError, match="not a NeuralDBG trace"):
        neuraldbg.load(tmp_path / "x.txt")
    with pytest.raises(neuraldbg.ConfigError):
        neuraldbg.load(3)  # type: ignore[arg-type]
    # A copy cut short in its last records, as a killed run leaves it: read up to the cut.
    data = path.read_bytes()
    cut = tmp_path / "cut.ndbg"
    cut.write_bytes(data[: len(data) - 40])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        loaded = neuraldbg.load(cut)
    assert not loaded.closed and loaded.damage is not None
    assert any(issubclass(w.category, NeuralDbgWarning) and "damaged" in str(w.message) for w in caught)
    assert 0 < loaded.steps_observed < 25


def test_to_pandas_history_is_the_measured_gradient_norms(run) -> None:
    dbg, _, norms = run
    df = dbg.to_pandas()
    assert list(df.columns) == ["step", "first_step", "group", "layer", "metric", "value", "min", "max"]
    first = df[(df.layer == "0") & (df.metric == "grad_norm")].sort_values("step")
    assert list(first.step) == list(range(len(norms)))
    # Independent ground truth: the norms torch computed in the loop (float32 in the engine).
    for got, want in zip(first.value, norms):
        assert (
            (math.isnan(got) and not math.isfinite(want))
            or math.isclose(got, want, rel_tol=1e-5)
            or (math.isinf(got) and math.isinf(want))
        )
    assert set(df.group.cat.categories) == {"layer", "activation", "run"}
    assert df[df.group == "run"].layer.isna().all()
    # Same rows as history() per series.
    steps, values = dbg.history(None, "loss")
    loss = df[(df.group == "run") & (df.metric == "loss")]
    assert np.array_equal(loss.step.to_numpy(), steps) and same_nan(loss.value.to_numpy(), values)
    layers = df[(df.group == "layer") & (df.metric == "grad_norm")]
    grid = layers.pivot(index="step", columns="layer", values="value")
    assert set(grid.columns) == {"0", "2", "4"}


def test_to_pandas_events_and_hypotheses(run) -> None:
    dbg, _, _ = run
    ev = dbg.to_pandas("events")
    assert len(ev) == len(dbg.events)
    assert list(ev.step) == [e.step for e in dbg.events]
    assert list(ev.layer) == [e.layer_name for e in dbg.events]
    assert list(ev.to_state) == [e.to_state for e in dbg.events]
    hy = dbg.to_pandas("hypotheses")
    assert list(hy.failure) == [h.failure for h in dbg.explain_failure()]
    assert list(hy["rank"]) == list(range(1, len(hy) + 1))
    with pytest.raises(neuraldbg.ConfigError, match="history, events, hypotheses"):
        dbg.to_pandas("nope")


def test_parquet_export_round_trips_with_pyarrow(run, tmp_path: Path) -> None:
    pq = pytest.importorskip("pyarrow.parquet")
    dbg, path, _ = run
    out = tmp_path / "pq"
    proc = subprocess.run(
        [CLI, "export", str(path), "--format", "parquet", "-o", str(out)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    history = pq.read_table(out / "history.parquet")
    assert str(history.schema.field("step").type) == "uint64"
    assert str(history.schema.field("layer").type) == "string"
    got = history.to_pandas()
    want = dbg.to_pandas()
    assert len(got) == len(want) > 0
    for col in ["step", "first_step"]:
        assert np.array_equal(got[col].to_numpy(), want[col].to_numpy())
    for col in ["group", "layer", "metric"]:
        text = lambda xs: [x if isinstance(x, str) else None for x in xs]  # noqa: E731
        assert text(got[col].astype(object)) == text(want[col].astype(object))
    for col in ["value", "min", "max"]:
        assert same_nan(got[col].to_numpy(), want[col].to_numpy())
    events = pq.read_table(out / "events.parquet").to_pandas()
    assert list(events.step) == [e.step for e in dbg.events]
    assert list(events.event_type) == [str(e.event_type) for e in dbg.events]
    hyps = pq.read_table(out / "hypotheses.parquet").to_pylist()
    live = dbg.explain_failure()
    assert [h["failure"] for h in hyps] == [str(h.failure) for h in live]
    assert [h["step"] for h in hyps] == [h.step for h in live]
    assert [list(h["remedies"] or []) for h in hyps] == [h.remedies for h in live]
    # Without -o there is nowhere to put three files.
    proc = subprocess.run([CLI, "export", str(path), "--format", "parquet"], capture_output=True, text=True)
    assert proc.returncode == 2 and "-o DIR" in proc.stderr


def test_to_polars_has_the_same_rows(run) -> None:
    pl = pytest.importorskip("polars")  # optional: not installed by make test
    dbg, _, _ = run
    got = dbg.to_polars()
    want = dbg.to_pandas()
    assert isinstance(got, pl.DataFrame) and got.height == len(want)
    assert got["step"].to_list() == list(want.step)
