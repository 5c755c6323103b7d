"""Traces written by ``NeuralDbg(model, trace=...)`` and the ``neuraldbg`` command that reads them.

The CLI is run as users run it: the script ``pip install .`` puts next to the interpreter.
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import subprocess
import sys
import textwrap
import time
import warnings
from pathlib import Path
from typing import Any, List, Tuple

import numpy as np
import pytest
import torch
import torch.nn as nn

from neuraldbg import CausalHypothesis, ConfigError, NeuralDbg, NeuralDbgWarning, SemanticEvent

CLI = str(Path(sys.executable).parent / "neuraldbg")
REPO = Path(__file__).resolve().parent.parent


def neuraldbg(*args: Any, check: bool = True) -> subprocess.CompletedProcess:
    """Runs the installed ``neuraldbg`` script."""
    proc = subprocess.run([CLI, *map(str, args)], capture_output=True, text=True, timeout=120)
    if check:
        assert proc.returncode == 0, f"neuraldbg {args} exited {proc.returncode}: {proc.stderr}"
    return proc


def deep_tanh(depth: int = 12, width: int = 16) -> nn.Sequential:
    layers: List[nn.Module] = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.Tanh()]
    layers.append(nn.Linear(width, 4))
    return nn.Sequential(*layers)


def train(model: nn.Module, steps: int, lr: float, seed: int = 0) -> None:
    torch.manual_seed(seed)
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    crit = nn.CrossEntropyLoss()
    width = model[0].in_features
    for _ in range(steps):
        opt.zero_grad()
        x = torch.randn(32, width)
        crit(model(x), (x[:, :4]).argmax(dim=1)).backward()
        opt.step()


def vanishing_run(path: Path) -> NeuralDbg:
    """A deep tanh net with shrunken weights: gradients vanish from step 0."""
    torch.manual_seed(0)
    model = deep_tanh()
    with torch.no_grad():
        for m in model:
            if isinstance(m, nn.Linear):
                m.weight.mul_(0.3)
    with NeuralDbg(model, trace=path) as dbg:
        train(model, steps=40, lr=0.05)
    return dbg


def exploding_run(path: Path) -> NeuralDbg:
    """A learning rate so high that gradients explode and values turn NaN: the trace carries
    non-finite numbers, which must replay exactly too."""
    torch.manual_seed(1)
    layers: List[nn.Module] = []
    for _ in range(4):
        layers += [nn.Linear(16, 16), nn.ReLU()]
    model = nn.Sequential(*layers, nn.Linear(16, 4))
    opt = torch.optim.SGD(model.parameters(), lr=100.0)
    crit = nn.MSELoss()
    with NeuralDbg(model, trace=path, activation_every=3) as dbg:
        for _ in range(30):
            opt.zero_grad()
            crit(model(torch.randn(32, 16) * 3), torch.randn(32, 4) * 10).backward()
            opt.step()
    assert any(e.to_state == "NON_FINITE" for e in dbg.events)
    return dbg


RUNS = {"vanishing": vanishing_run, "exploding": exploding_run}


def same(a: Any, b: Any) -> bool:
    """Equality where NaN equals NaN (an exact replay reproduces NaN values)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or a == b
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    return bool(a == b)


@pytest.fixture(scope="module", params=sorted(RUNS))
def run(request: Any, tmp_path_factory: Any) -> Tuple[NeuralDbg, Path]:
    path = tmp_path_factory.mktemp(request.param) / "nested" / "dir" / "run.ndbg"
    dbg = RUNS[request.param](path)
    assert dbg.explain_failure(), "the run must fail for the comparison to mean something"
    return dbg, path


def test_explain_replays_exactly_the_live_diagnosis(run: Tuple[NeuralDbg, Path]) -> None:
    dbg, path = run
    live = dbg.explain_failure()
    cli = json.loads(neuraldbg("explain", path, "--json").stdout)
    # Byte for byte the engine's JSON...
    assert cli == json.loads(dbg._engine.explain_json())
    # ...and field by field the objects the Python API returns.
    assert len(cli) == len(live)
    for d, h in zip(cli, live):
        replayed = CausalHypothesis._from_json(d)
        for field in dataclasses.fields(CausalHypothesis):
            assert same(dataclasses.asdict(replayed)[field.name], dataclasses.asdict(h)[field.name]), field.name
    # The text is what print(h) shows.
    text = neuraldbg("explain", path).stdout.splitlines()
    assert text == [str(h) for h in live]
    failure = live[0].failure
    only = json.loads(neuraldbg("explain", path, "--json", "--failure", failure).stdout)
    assert only == json.loads(dbg._engine.explain_json(str(failure)))


def test_events_replay_exactly_and_filter(run: Tuple[NeuralDbg, Path]) -> None:
    dbg, path = run
    events = dbg.events
    cli = json.loads(neuraldbg("events", path, "--json").stdout)
    assert cli == json.loads(dbg._engine.events_json())
    assert [SemanticEvent._from_json(e).step for e in cli] == [e.step for e in events]
    assert neuraldbg("events", path).stdout.splitlines() == [str(e) for e in events]

    first = events[0]
    by_layer = json.loads(neuraldbg("events", path, "--json", "--layer", first.layer_name or "<model>").stdout)
    assert by_layer and all(e["layer_name"] == first.layer_name for e in by_layer)
    assert len(by_layer) == sum(e.layer_name == first.layer_name for e in events)
    by_type = json.loads(neuraldbg("events", path, "--json", "--kind", "gradient_health").stdout)
    assert len(by_type) == sum(e.event_type == "gradient_health" for e in events)
    state = first.to_state
    by_state = json.loads(neuraldbg("events", path, "--json", "--kind", state).stdout)
    assert by_state and len(by_state) == sum(e.to_state == state for e in events)

    bad = neuraldbg("events", path, "--layer", "no.such.layer", check=False)
    assert bad.returncode == 2 and "no.such.layer" in bad.stderr
    # A kind in any case is the same kind; an unknown one lists them.
    lower = json.loads(neuraldbg("events", path, "--json", "--kind", state.lower()).stdout)
    assert lower == by_state
    bad = neuraldbg("events", path, "--kind", "vanishin", check=False)
    assert bad.returncode == 2 and "VANISHING" in bad.stderr


def test_export_json_and_mermaid_match_the_live_run(run: Tuple[NeuralDbg, Path], tmp_path: Path) -> None:
    dbg, path = run
    out = tmp_path / "export" / "run.json"
    neuraldbg("export", path, "--format", "json", "-o", out)
    doc = json.loads(out.read_text())
    assert doc["events"] == json.loads(dbg._engine.events_json())
    assert doc["hypotheses"] == json.loads(dbg._engine.explain_json())
    assert doc["trace"]["steps"] == dbg.step and doc["trace"]["closed"] is True
    layer = next(iter(doc["history"]["layers"]))
    steps, values = dbg.history(layer, "grad_norm")
    series = doc["history"]["layers"][layer]["grad_norm"]
    assert series["steps"] == list(steps)
    exported = [float(v) if isinstance(v, str) else v for v in series["values"]]
    np.testing.assert_array_equal(np.array(exported), values)
    loss = doc["history"]["run"]["loss"]
    assert len(loss["steps"]) == len(dbg.history(None, "loss")[0])

    mermaid = neuraldbg("export", path, "--format", "mermaid").stdout
    assert mermaid.rstrip("\n") == dbg.export_mermaid_causal_graph()


def test_report_from_the_trace_is_the_live_report(run: Tuple[NeuralDbg, Path], tmp_path: Path) -> None:
    """`neuraldbg report` replays the trace into the same engine state, so the page is the very
    page `dbg.save_report` writes from the live run (same title)."""
    dbg, path = run
    live, replayed = tmp_path / "live.html", tmp_path / "out" / "replayed.html"
    dbg.save_report(live, title="run")
    neuraldbg("report", path, "-o", replayed, "--title", "run")
    assert replayed.read_text() == live.read_text()
    top = dbg.explain_failure()[0]
    html = replayed.read_text()
    assert f"<code>{top.failure}</code>" in html and f"<code>{top.cause}</code>" in html


def test_export_tensorboard_is_read_by_tensorboard(run: Tuple[NeuralDbg, Path], tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.util import tensor_util

    dbg, path = run
    out = tmp_path / "tb"
    proc = neuraldbg("export", path, "--format", "tensorboard", "-o", out)
    assert "tensorboard --logdir" in proc.stderr
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        acc = EventAccumulator(str(out), size_guidance={"scalars": 0, "tensors": 0})
        acc.Reload()
    tags = acc.Tags()
    layers = [n for n, m in dbg.model.named_modules() if isinstance(m, nn.Linear)]
    for layer in layers:
        steps, values = dbg.history(layer, "grad_norm")
        finite = ~np.isnan(values)
        points = acc.Scalars(f"grad_norm/{layer}")
        assert [p.step for p in points] == list(steps[finite])
        np.testing.assert_allclose([p.value for p in points], values[finite].astype(np.float32), rtol=1e-6)
    assert "run/loss" in tags["scalars"]
    texts = acc.Tensors("events")
    lines = [line for t in texts for line in tensor_util.make_ndarray(t.tensor_proto).item().decode().splitlines()]
    assert len(lines) == len(dbg.events)
    assert lines[0] == f"- `{dbg.events[0]}`"
    diagnosis = tensor_util.make_ndarray(acc.Tensors("diagnosis")[0].tensor_proto).item().decode()
    assert str(dbg.explain_failure()[0]) in diagnosis


def test_info_reports_the_trace(run: Tuple[NeuralDbg, Path]) -> None:
    dbg, path = run
    info = json.loads(neuraldbg("info", path, "--json").stdout)
    assert info["steps"] == dbg.step
    assert info["closed"] is True and info["damage"] is None
    assert info["bytes"] == path.stat().st_size
    assert info["meta"]["producer"].startswith("neuraldbg")
    assert info["model"]["layers"] == sum(isinstance(m, nn.Linear) for m in dbg.model.modules())
    assert 0 < info["bytes_per_step"] < info["bytes"] / max(dbg.step, 1) + 1
    assert "steps" in neuraldbg("info", path).stdout


def test_trace_is_closed_when_the_loop_raises(tmp_path: Path) -> None:
    path = tmp_path / "raised.ndbg"
    model = deep_tanh(depth=3)

    class Boom(RuntimeError):
        pass

    with pytest.raises(Boom), NeuralDbg(model, trace=path) as dbg:
        train(model, steps=5, lr=0.01)
        model(torch.randn(2, 16)).sum().backward()  # a step that never reaches optimizer.step()
        raise Boom()
    info = json.loads(neuraldbg("info", path, "--json").stdout)
    assert info["closed"] is True
    # The crashed iteration is observed on exit and recorded too.
    assert info["steps"] == 6 == len(dbg.history("0")[0])
    assert json.loads(neuraldbg("explain", path, "--json").stdout) == json.loads(dbg._engine.explain_json())


def test_a_run_without_steps_and_unwritable_paths(tmp_path: Path) -> None:
    model = deep_tanh(depth=2)
    empty = tmp_path / "empty.ndbg"
    with pytest.warns(NeuralDbgWarning, match="no model header"), NeuralDbg(model, trace=empty):
        pass
    proc = neuraldbg("explain", empty, check=False)
    assert proc.returncode == 3
    assert "no model header" in proc.stderr and proc.stdout == ""

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    hooks = sum(len(m._forward_hooks) for m in model.modules())
    with pytest.raises(ConfigError, match="a-file"), NeuralDbg(model, trace=blocker / "run.ndbg"):
        pass
    assert sum(len(m._forward_hooks) for m in model.modules()) == hooks
    with pytest.raises(ConfigError, match="trace"):
        NeuralDbg(model, trace=42)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="trace"):
        NeuralDbg(model, trace="")


def test_cli_errors_and_damaged_traces(run: Tuple[NeuralDbg, Path], tmp_path: Path) -> None:
    dbg, path = run
    missing = neuraldbg("explain", tmp_path / "missing.ndbg", check=False)
    assert missing.returncode == 3 and "missing.ndbg" in missing.stderr
    foreign = tmp_path / "notes.txt"
    foreign.write_text("hello")
    proc = neuraldbg("explain", foreign, check=False)
    assert proc.returncode == 3 and "not a NeuralDBG trace" in proc.stderr

    # Corrupt one byte in the middle: the steps before it are used, with a warning that says
    # where; --strict turns the damage into exit code 5.
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    damaged = tmp_path / "damaged.ndbg"
    damaged.write_bytes(bytes(data))
    proc = neuraldbg("info", damaged, "--json")
    info = json.loads(proc.stdout)
    assert "warning" in proc.stderr and "record" in proc.stderr and "at byte" in proc.stderr
    assert 0 < info["steps"] < dbg.step
    assert info["damage"]["offset"] <= len(data) // 2
    strict = neuraldbg("--strict", "explain", damaged, check=False)
    assert strict.returncode == 5

    truncated = tmp_path / "truncated.ndbg"
    truncated.write_bytes(path.read_bytes()[: path.stat().st_size - 7])
    proc = neuraldbg("explain", truncated)
    assert "the file ends" in proc.stderr


def test_python_m_neuraldbg_is_the_same_command() -> None:
    proc = subprocess.run([sys.executable, "-m", "neuraldbg", "--help"], capture_output=True, text=True)
    assert proc.returncode == 0
    assert proc.stdout == neuraldbg("--help").stdout
    assert "Usage: neuraldbg" in proc.stdout and "Exit codes" in proc.stdout


CHILD = textwrap.dedent(
    """
    import resource, signal, sys, warnings
    import torch, torch.nn as nn
    from neuraldbg import NeuralDbg

    path, mode = sys.argv[1], sys.argv[2]
    if mode == "fsize":
        # Writes past 8 kB fail (EFBIG) instead of killing the process (SIGXFSZ).
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (8_000, 8_000))
    torch.manual_seed(0)
    layers = []
    for _ in range(6):
        layers += [nn.Linear(16, 16), nn.Tanh()]
    model = nn.Sequential(*layers)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with NeuralDbg(model, trace=path) as dbg:
            step = 0
            while mode == "forever" or step < 60:
                opt.zero_grad()
                model(torch.randn(8, 16)).square().mean().backward()
                opt.step()
                step += 1
                print(step, flush=True)
    print("steps", dbg.step, "history", len(dbg.history("0")[0]))
    print("warning", [str(w.message) for w in caught if "trace" in str(w.message)])
    """
)


def test_sigkill_mid_run_leaves_every_finished_step_readable(tmp_path: Path) -> None:
    path = tmp_path / "killed.ndbg"
    child = subprocess.Popen([sys.executable, "-c", CHILD, str(path), "forever"], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    deadline = time.monotonic() + 120
    done = 0
    while done < 25:
        line = child.stdout.readline()
        assert line, "the training child died"
        done = int(line)
        assert time.monotonic() < deadline
    child.send_signal(signal.SIGKILL)
    child.wait()
    rest = child.stdout.read().split()
    finished = int(rest[-1]) if rest else done

    proc = neuraldbg("info", path, "--json")
    info = json.loads(proc.stdout)
    # Each printed step had its record written before optimizer.step() returned.
    assert info["steps"] >= finished
    assert info["first_step"] == 0 and info["last_step"] == info["steps"] - 1
    assert info["closed"] is False
    assert "was not closed" in proc.stderr or "damaged" in proc.stderr
    assert neuraldbg("explain", path, "--json").returncode == 0


def test_a_failing_disk_stops_the_trace_not_the_diagnosis(tmp_path: Path) -> None:
    path = tmp_path / "full.ndbg"
    proc = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), "fsize"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert "steps 60 history 60" in lines  # the live engine saw every step
    warning = lines[-1]
    assert "stopped writing the trace" in warning and "File too large" in warning
    info = json.loads(neuraldbg("info", path, "--json").stdout)
    assert 0 < info["steps"] < 60
    assert path.stat().st_size <= 8_000
    # The failing write left at most a partial record, which the reader leaves out.
    assert info["damage"] is None or "the file ends" in info["damage"]["message"]


def test_native_engine_traces_after_registration_and_checks_sync(tmp_path: Path) -> None:
    """Opening a trace on an engine whose model is already registered writes the header at
    once; bad sync intervals are configuration errors."""
    from neuraldbg import _native

    engine = _native.Engine("{}")
    spec = {
        "modules": [{"name": "fc", "kind": "Linear"}, {"name": "", "kind": "Net"}],
        "params": [{"module": 0, "name": "fc.weight", "numel": 4, "role": "weight", "fan_in": 2}],
    }
    engine.register_model(json.dumps(spec))
    with pytest.raises(ConfigError, match="sync_interval"):
        engine.open_trace(str(tmp_path / "bad.ndbg"), sync_interval=-1.0)
    engine.open_trace(tmp_path / "late.ndbg", '{"who": "test"}', sync_interval=0.0)
    for step in range(5):
        engine.observe(step, np.array([1e-9], np.float32))
    assert engine.close_trace() == (str(tmp_path / "late.ndbg"), 5, (tmp_path / "late.ndbg").stat().st_size, True)
    assert engine.close_trace() is None
    info = json.loads(neuraldbg("info", tmp_path / "late.ndbg", "--json").stdout)
    assert info["steps"] == 5 and info["meta"] == {"who": "test"}
    assert json.loads(neuraldbg("events", tmp_path / "late.ndbg", "--json").stdout) == json.loads(engine.events_json())


def test_native_engine_takes_named_facts_and_measures(tmp_path: Path) -> None:
    """Facts and measures are checked by name and length, and traced steps that carry them
    replay to the same events."""
    from neuraldbg import _native
    from neuraldbg.errors import EngineError, UnknownNameError

    engine = _native.Engine("{}")
    spec = {
        "modules": [{"name": "fc", "kind": "Linear"}, {"name": "", "kind": "Net"}],
        "params": [{"module": 0, "name": "fc.weight", "numel": 4, "role": "weight", "fan_in": 2}],
    }
    engine.register_model(json.dumps(spec))
    engine.open_trace(tmp_path / "facts.ndbg", "{}", sync_interval=0.0)
    grads = np.array([0.5], np.float32)
    with pytest.raises(UnknownNameError, match='"no_such_fact".*training'):
        engine.observe(0, grads, facts={"no_such_fact": 1.0})
    with pytest.raises(UnknownNameError, match="measure"):
        engine.observe(0, grads, measures={"no_such_measure": np.zeros(2, np.float32)})
    with pytest.raises(EngineError, match="output_absmax has 3 values, expected 2"):
        engine.observe(0, grads, measures={"output_absmax": np.zeros(3, np.float32)})
    for step in range(4):
        engine.observe(
            step,
            grads * (10.0 ** (4 * step)),
            facts={"training": 1.0, "optimizer_skipped": float(step == 2)},
            measures={"output_absmax": np.array([1.0, float(step)], np.float32)},
        )
    engine.close_trace()
    replayed = json.loads(neuraldbg("events", tmp_path / "facts.ndbg", "--json").stdout)
    assert replayed == json.loads(engine.events_json()) and replayed
