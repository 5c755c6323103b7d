"""Distributed training (gloo on CPU by default, NEURALDBG_TEST_BACKEND=nccl for the same jobs on
GPUs; launched with torchrun as users launch their jobs): exact
job-wide per-layer norms under DDP, FSDP2 and a 2-D mesh (HSDP), one extra collective per step,
per-rank signals named with their rank, a diverged replica, the same diagnosis as one process,
and a rank that raises without leaving the others blocked.

Two jobs run once per session (2 and 4 processes), each running several scenarios of
tests/distributed_job.py in one process group; the tests read what every rank wrote. Ground
truth comes from plain torch on one process (the concatenated global batch), never from us.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from typing import Any, Dict, List

import pytest

_torch = __import__("torch")
# NEURALDBG_TEST_BACKEND=nccl runs the same jobs on GPUs (one per process).
_BACKEND = os.environ.get("NEURALDBG_TEST_BACKEND", "gloo")
pytestmark = [
    pytest.mark.skipif(not _torch.distributed.is_available(), reason="torch built without distributed"),
    pytest.mark.skipif(
        _BACKEND == "nccl" and _torch.cuda.device_count() < 4,
        reason="NEURALDBG_TEST_BACKEND=nccl needs 4 GPUs",
    ),
]

HERE = os.path.dirname(os.path.abspath(__file__))
JOBS = {
    2: [
        "ddp",
        "fsdp",
        "fsdp_keep",
        "fsdp_bf16",
        "fsdp_rank",
        "nan_batch",
        "nan_forward",
        "lr_explosion",
        "fails_locally",
        "raises",
    ],
    4: ["hsdp", "fsdp", "diverged", "nan_batch"],
}


def _run_job(world: int, out: str, names: List[str], **env_extra: str) -> None:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore", **env_extra)
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        f"--nproc_per_node={world}",
        "--standalone",
        os.path.join(HERE, "distributed_job.py"),
        out,
        *names,
    ]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _job(world: int, tmp_path_factory: Any, names: Any = None, **env_extra: str) -> Dict[str, Any]:
    names = JOBS[world] if names is None else names
    out = str(tmp_path_factory.mktemp(f"job{world}"))
    _run_job(world, out, names, **env_extra)
    results: Dict[str, List[Dict[str, Any]]] = {}
    for name in names:
        per_rank = []
        for r in range(world):
            with open(os.path.join(out, f"{name}.rank{r}.json")) as f:
                d = json.load(f)
            assert "crash" not in d, f"rank {r} of {name}:\n{d['crash']}"
            per_rank.append(d)
        results[name] = per_rank
    return {"world": world, "out": out, "results": results}


@pytest.fixture(scope="module")
def job2(tmp_path_factory: Any) -> Dict[str, Any]:
    return _job(2, tmp_path_factory)


@pytest.fixture(scope="module")
def job4(tmp_path_factory: Any) -> Dict[str, Any]:
    return _job(4, tmp_path_factory)


@pytest.fixture(scope="module")
def job2_device(tmp_path_factory: Any) -> Dict[str, Any]:
    """The NaN jobs on the CUDA code path's CPU stand-in: each rank's origin is found on the
    device before the exchange (no host read), as under NCCL."""
    return _job(2, tmp_path_factory, ["nan_forward", "nan_batch"], NEURALDBG_DEVICE_PATH="deferred")


@pytest.fixture(params=[2, 4], ids=["2proc", "4proc"])
def job(request: Any) -> Dict[str, Any]:
    """Scenarios both jobs run (the 2- and the 4-process one)."""
    return request.getfixturevalue(f"job{request.param}")


def _in(world: int, kind: str) -> Any:
    return pytest.param(world, kind, id=f"{world}proc-{kind}")


def _close(a: float, b: float, rtol: float) -> bool:
    return math.isclose(a, b, rel_tol=rtol, abs_tol=1e-7)


@pytest.mark.parametrize(
    "world,kind",
    [_in(2, "ddp"), _in(2, "fsdp"), _in(2, "fsdp_keep"), _in(2, "fsdp_bf16"), _in(4, "fsdp"), _in(4, "hsdp")],
)
def test_layer_norms_are_the_single_process_norms(request: Any, world: int, kind: str) -> None:
    """Every rank's history holds, at every step, each layer's gradient and parameter norm of
    the single-process run on the global batch (bf16 compute: to bf16 tolerance), and the
    loss is the global batch's loss."""
    job = request.getfixturevalue(f"job{world}")
    rtol = 2e-2 if kind == "fsdp_bf16" else 1e-5
    for d in job["results"][kind]:
        ref = d["reference"]
        assert d["step"] == d["steps"] == len(ref)
        for step, r in enumerate(ref):
            for metric in ("grad", "weight"):
                for layer, want in r[metric].items():
                    got = d[metric][layer][str(step)]
                    assert _close(got, want, rtol), (kind, metric, layer, step, got, want)
            assert _close(d["loss"][str(step)], r["loss"], max(rtol, 1e-6))
        # Under sharding a layer's local norm is off by about sqrt(world): the check above
        # would fail on per-shard numbers.


def test_fsdp_watched_per_rank_sees_its_own_shards(job2: Dict[str, Any]) -> None:
    """``distributed="off"`` under FSDP2: no crash, every step observed, and each rank's layer
    norms are those of its local shards (plain torch on ``_local_tensor``)."""
    for d in job2["results"]["fsdp_rank"]:
        assert d["steps"] == 3 and d["warnings"] == []
        for layer, want in d["shard"].items():
            assert _close(d["last"][layer], want, 1e-5), (layer, d["last"][layer], want)


@pytest.mark.parametrize("world,kind", [_in(2, "ddp"), _in(2, "fsdp"), _in(4, "fsdp"), _in(4, "hsdp")])
def test_one_extra_collective_per_step(request: Any, world: int, kind: str) -> None:
    """Collectives issued through torch.distributed, watched minus unwatched, per step."""
    job = request.getfixturevalue(f"job{world}")
    for d in job["results"][kind]:
        assert d["collectives_watched"] - d["collectives_unwatched"] == d["steps"]


def test_one_trace_for_the_job(job: Dict[str, Any]) -> None:
    """Rank 0 alone wrote the trace, with every rank's signals: `neuraldbg explain` on it gives
    the live diagnosis, the bad batch's rank included."""
    names = sorted(f for f in os.listdir(job["out"]) if f.endswith(".ndbg"))
    assert "nan_batch.ndbg" in names and not [f for f in names if ".rank" in f]
    cli = os.path.join(os.path.dirname(sys.executable), "neuraldbg")
    proc = subprocess.run(
        [cli, "explain", os.path.join(job["out"], "nan_batch.ndbg"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr
    replayed = json.loads(proc.stdout)
    live = job["results"]["nan_batch"][0]["hypotheses"]
    assert [h["description"] for h in replayed] == [h["description"] for h in live]
    assert replayed[0]["evidence"][0]["metadata"]["rank"] == job["results"]["nan_batch"][0]["bad_rank"]


@pytest.mark.parametrize("device_path", [False, True], ids=["", "device_path"])
def test_nan_batch_is_named_with_its_rank_and_step(job: Dict[str, Any], device_path: bool, request: Any) -> None:
    if device_path:
        if job["world"] != 2:
            pytest.skip("the CUDA path's stand-in runs in the 2-process job")
        job = request.getfixturevalue("job2_device")
    for d in job["results"]["nan_batch"]:
        top = d["hypotheses"][0]
        assert (top["failure"], top["cause"], top["step"]) == ("data_anomaly", "bad_input_data", d["bad_step"])
        assert top["evidence"][0]["rank"] == d["bad_rank"]
        assert f"on rank {d['bad_rank']}" in top["description"]
        # The NaN that followed is a consequence of that batch, not a module's fault.
        nonfinite = [h for h in d["hypotheses"] if h["failure"] == "non_finite"]
        assert nonfinite and nonfinite[0]["cause"] == "bad_input_data"


@pytest.mark.parametrize("path", ["job2", "job2_device"])
def test_nan_made_by_a_module_names_the_module_and_the_rank(path: str, request: Any) -> None:
    for d in request.getfixturevalue(path)["results"]["nan_forward"]:
        top = d["hypotheses"][0]
        assert (top["failure"], top["cause"], top["layer"], top["step"]) == (
            "non_finite",
            "numerical_instability",
            "module.1",
            d["bad_step"],
        ), top
        assert f"on rank {d['bad_rank']}" in top["description"], top["description"]
        origin = [e for e in top["evidence"] if e["layer"] == "module.1"]
        assert origin and origin[0]["rank"] == d["bad_rank"]


def test_learning_rate_explosion_diagnosed_as_in_one_process(job2: Dict[str, Any]) -> None:
    for d in job2["results"]["lr_explosion"]:
        job_top = [
            (h["failure"], h["cause"], h["layer"].removeprefix("module.") if h["layer"] else None, h["step"])
            for h in d["job"][:3]
        ]
        single_top = [(h["failure"], h["cause"], h["layer"], h["step"]) for h in d["single"][:3]]
        assert job_top == single_top
        assert job_top[0][:2] == ("exploding_gradients", "learning_rate_too_high")


def test_diverged_replica_is_a_failure_of_its_own(job4: Dict[str, Any]) -> None:
    for d in job4["results"]["diverged"]:
        top = d["hypotheses"][0]
        assert top["failure"] == "replica_divergence"
        assert top["step"] == d["bad_step"]
        assert top["layer"] == "module.2"
        assert top["evidence"][0]["rank"] == d["bad_rank"]


def test_a_rank_that_raises_leaves_no_one_blocked(job2: Dict[str, Any]) -> None:
    for r, d in enumerate(job2["results"]["raises"]):
        if r == d["bad_rank"]:
            assert d["error"] == "KeyError('planted')"
            assert d["loop_steps"] == 3
        else:
            assert d["error"] is None and d["loop_steps"] == 8
            assert d["seconds"] < 30
            assert any("stopped observing" in w for w in d["warnings"]), d["warnings"]


def test_an_error_in_our_path_stops_every_rank_at_once(job2: Dict[str, Any]) -> None:
    """One rank's collection breaks: every rank warns and stops observing (the others told by
    that rank's last collective, well within the 60 s timeout), and every loop runs to its
    end."""
    for r, d in enumerate(job2["results"]["fails_locally"]):
        assert d["loop_steps"] == 8
        assert d["seconds"] < 30
        assert len(d["warnings"]) == 1 and "stopped observing" in d["warnings"][0]
        assert f"rank {r}" in d["warnings"][0]
        if r != d["bad_rank"]:
            assert f"rank {d['bad_rank']} stopped observing" in d["warnings"][0]
        else:
            assert "planted internal error" in d["warnings"][0]
