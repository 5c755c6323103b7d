"""neuraldbg.keras on the backends other than JAX: TensorFlow (its traced step, and compiled by
XLA as ``jit_compile=True`` does, TensorFlow's default on a GPU) and PyTorch. Keras fixes its
backend at import, so each runs ``tests/keras_backend_job.py`` in a subprocess; the ground truth
comes from the backend itself there (its own gradients) and from numpy."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest

JOB = Path(__file__).with_name("keras_backend_job.py")

if importlib.util.find_spec("keras") is None:  # pragma: no cover - depends on the environment
    pytest.skip("Keras is not installed", allow_module_level=True)


def run(backend: str, *args: str) -> Dict[str, Any]:
    if importlib.util.find_spec(backend) is None:
        pytest.skip(f"{backend} is not installed")
    env = dict(os.environ, KERAS_BACKEND=backend, TF_CPP_MIN_LOG_LEVEL="2")
    r = subprocess.run(
        [sys.executable, str(JOB), *args], capture_output=True, text=True, env=env, timeout=600, check=False
    )
    assert r.returncode == 0, r.stderr[-4000:]
    assert "NeuralDbgWarning" not in r.stderr, r.stderr[-4000:]  # nothing we measure was given up
    out: Dict[str, Any] = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["backend"] == backend
    return out


def assert_interrupted(out: Dict[str, Any]) -> None:
    """What ``keras_backend_job.interrupted`` must find: the user's exception itself, the steps
    trained until it, the trace closed and readable, the model and its optimizer as before,
    later fits unobserved unless watched again (before, on every backend: the wrappers stayed,
    the next unwatched fit was observed, no trace was closed)."""
    for name, steps in (("callback", 3), ("ctrl_c", 5)):
        got = out[name]
        assert got["same_error"], got
        assert got["steps"] == got["trace_steps"] == steps and not got["active"], got
        assert got["printed"][0].startswith(f"NeuralDBG: {steps} steps observed before fit raised"), got
        assert got["wrapped"] == [], got
        assert got["variables"][0] == got["variables"][1], got
        assert got["optimizer_variables"][0] == got["optimizer_variables"][1], got
    assert out["after"]["steps"] == 5
    assert out["watched_again"]["steps"] == 20
    # The first step raised: the fit's own error, the watch ended and undone, an empty trace
    # said as such (before, on JAX: "could not end the watch", the layers left wrapped).
    first = out["first_step"]
    assert "fails in training" in first["raised"] and not first["active"] and first["wrapped"] == [], first
    assert first["trace_steps"] == 0, first
    assert [m for m in first["said"] if "could not" in m] == [], first


@pytest.mark.parametrize(
    ("backend", "args"),
    [("tensorflow", ()), ("tensorflow", ("jit",)), ("torch", ())],
    ids=["tensorflow", "tensorflow-xla", "torch"],
)
def test_the_same_diagnosis_on_every_backend(backend: str, args: Any) -> None:
    """The callback's numbers are the backend's own on each: gradient norms of the first batch
    as its autodiff computes them, one step per batch, each input batch's scale. A deep sigmoid
    stack's vanishing gradients are named at the right layer; a NaN batch is named bad input
    data at its step and ``halt_on`` stops fit after the next batch; a sigmoid output
    regressing targets around 3 is named from the first batch's facts (the same model on
    scaled targets is quiet). Under XLA, where no host call can be compiled, the step hands its
    numbers over in variables: before, fit itself failed. Then the fit loops Keras users write:
    several steps per call (TensorFlow), gradient accumulation, a loss-scaling optimizer (its
    gradients unscaled), an embedding of token ids (before, on TensorFlow, no update was
    observed: its gradient is sparse rows), a subclassed model with its own train step that fit builds itself
    (before, on TensorFlow, the callback raised at the start of fit). On TensorFlow, two
    replicas of ``MirroredStrategy``: the update's gradient is their sum, the batch's (before,
    each replica's own half, written by both). On PyTorch the step reads nothing on the host
    (each read waits for a GPU)."""
    out = run(backend, *args)

    deep = out["deep_sigmoid"]
    assert deep["steps"] == deep["iterations"] == 40  # every batch is one step
    assert deep["layers"] == deep["order"]
    truth = deep["truth"]
    for name in deep["order"]:
        np.testing.assert_allclose(deep["first_grad_norm"][name], truth[name], rtol=1e-3, err_msg=name)
    np.testing.assert_allclose(deep["input_scale"], deep["input_truth"], rtol=1e-6)
    vanished = [n for n in reversed(deep["order"]) if truth[n] < 1e-6]
    assert len(vanished) >= 3
    top = deep["top"]
    assert top["failure"] == "vanishing_gradients" and top["confidence"] >= 0.5, top
    assert top["layer"] == vanished[0] and top["step"] == 0
    assert top["cause"] == "saturating_activation"

    nan = out["nan_batch"]
    assert nan["step"] == 5 and nan["confidence"] >= 0.5
    assert nan["cause"] == "bad_input_data"  # the forward pass measured the NaN in batch 5
    assert nan["halted"] and nan["epochs"] == 1
    assert nan["steps"] == nan["iterations"] == 7

    bounded = out["bounded_output"]
    assert bounded["loss"][-1] < bounded["loss"][0]  # still falling
    assert bounded["target_max"] > 4  # far beyond what a sigmoid reaches
    assert bounded["top"]["cause"] == "output_loss_mismatch" and bounded["top"]["confidence"] >= 0.5, bounded
    assert out["bounded_output_scaled"]["confirmed"] == []

    loops = out["loops"]
    per_call = loops["per_call"]
    assert per_call["steps"] == per_call["iterations"] == per_call["losses"] == per_call["inputs"] == 40
    for name, norm in per_call["truth"].items():
        np.testing.assert_allclose(per_call["first"][name], norm, rtol=1e-4, err_msg=name)
    accumulated = loops["accumulation"]
    assert accumulated["steps"] == accumulated["iterations"] == 10  # 20 batches, 2 each
    # The update's gradient, and its two micro-batches' inputs together (before: the first
    # micro-batch's half gradient went to the engine, and its inputs to another step).
    for name, norm in accumulated["truth"].items():
        np.testing.assert_allclose(accumulated["first"][name], norm, rtol=1e-4, err_msg=name)
    np.testing.assert_allclose(accumulated["input_scale"], accumulated["input_truth"], rtol=1e-6)
    # Named at its update, and fit stopped there (before: every step waited for the end of fit).
    nan = loops["accumulated_nan"]
    assert nan["halted"] == ["data_anomaly", "bad_input_data", 1] and nan["batches"] <= 6, nan
    scaled = loops["loss_scale"]
    assert scaled["scale"] > 1000.0  # the loss was scaled
    for name, norm in scaled["truth"].items():
        np.testing.assert_allclose(scaled["first"][name], norm, rtol=1e-4, err_msg=name)
    embedding = loops["embedding"]  # on TensorFlow its gradient is rows (IndexedSlices), repeated ids among them
    assert embedding["steps"] == 10
    for name, norm in embedding["truth"].items():
        np.testing.assert_allclose(embedding["first"][name], norm, rtol=1e-4, err_msg=name)
    sub = loops["subclassed"]
    assert not sub["built_before"] and not sub["wrapped"]
    assert sub["steps"] == 40 and sub["layers"] == sub["names"]
    # Keras logs each epoch's mean batch loss: the per-batch losses recovered average to it.
    np.testing.assert_allclose(np.reshape(sub["losses"], (2, 20)).mean(axis=1), sub["loss"], rtol=1e-5)

    assert_interrupted(out["interrupted"])

    if "mirrored" in out:
        mirrored = out["mirrored"]
        assert mirrored["replicas"] == 2 and mirrored["steps"] == 20
        for name, norm in mirrored["truth"].items():
            np.testing.assert_allclose(mirrored["first"][name], norm, rtol=1e-4, err_msg=name)
        rows = dict(mirrored["rows"])
        assert rows.pop("_receive_first_batch") == 1  # the first batch's facts: written once, then skipped
        assert set(rows.values()) == {20}  # one row a step: the first replica's

    if "host_reads" in out:
        # PyTorch: the watched step reads no tensor on the host beyond what the plain one does
        # (its numbers are kept on the device and read between batches); before, ~6 a step.
        # Counted on the step's thread: Keras reads the logs on a worker thread meanwhile.
        reads = out["host_reads"]
        assert reads["watched"] <= reads["plain"], reads
