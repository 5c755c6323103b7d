"""The scenario suite: each planted failure is diagnosed correctly by the top hypothesis, and no
healthy run gets a hypothesis with confidence >= 0.5. Ground truth is proven first, from the
independent plain-PyTorch record of the same run (and a counterfactual run where the cause is
an intervention)."""

from __future__ import annotations

import pytest
import torch
from bench import scenarios as S
from bench import suite

from neuraldbg.testing import read_path

SCENARIOS = suite.all_scenarios()


def test_suite_is_broad_enough():
    failures = [s for s in SCENARIOS if s.truth.failure is not None]
    healthy = [s for s in SCENARIOS if s.truth.failure is None]
    assert len(failures) >= 16 and len(healthy) >= 6
    kinds = {s.truth.failure for s in failures}
    # Every failure PyTorch produces on CPU (saturated_gradients is a warning, never the failure).
    assert kinds >= {
        "vanishing_gradients",
        "exploding_gradients",
        "saturated_activations",
        "dead_neurons",
        "non_finite",
        "data_anomaly",
        "loss_divergence",
        "loss_plateau",
    }


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_scenario(scenario):
    torch.set_num_threads(1)
    outcome = S.evaluate(scenario)
    S.verify_truth(scenario, outcome.record)
    tops = "\n".join(str(h) for h in outcome.hypotheses[:3])
    if scenario.truth.failure is None:
        assert outcome.score["healthy"], f"healthy run got a confident hypothesis:\n{tops}"
    else:
        assert S.passed(outcome), f"truth {scenario.truth}, score {outcome.score}, top:\n{tops}"


@pytest.mark.parametrize("scenario", SCENARIOS, ids=[s.name for s in SCENARIOS])
def test_the_cuda_path_stand_in_diagnoses_as_the_host_path(scenario, monkeypatch):
    """The CUDA code path, run on the CPU (``NEURALDBG_DEVICE_PATH=deferred``: one vector of
    torch reductions a step, handed to the engine a step later, module calls summarized on the
    device), gives the diagnosis of the host path on every scenario: same steps, same top
    hypothesis (failure, cause, layer, step)."""
    torch.set_num_threads(1)
    host = S.evaluate(scenario)
    monkeypatch.setenv("NEURALDBG_DEVICE_PATH", "deferred")
    device = S.evaluate(scenario)
    assert read_path(device.dbg) == "deferred"
    assert device.dbg.step == host.dbg.step
    assert len(device.dbg.history(None, "grad_norm")[0]) == len(host.dbg.history(None, "grad_norm")[0])

    def top(o):
        return [(str(h.failure), str(h.cause), h.layer, h.step) for h in o.hypotheses[:1] if h.confidence >= 0.5]

    assert top(device) == top(host), f"host {host.hypotheses[:1]}\ndevice {device.hypotheses[:1]}"


def test_the_gpu_harness_runs_a_scenario_as_the_suite_does():
    """`bench/gpu_scenarios.py` (the scenarios on a CUDA device against the CPU) runs a
    scenario's loop itself: on the CPU it gives the suite's steps and top hypothesis."""
    from bench import gpu_scenarios

    torch.set_num_threads(1)
    scenario = next(s for s in SCENARIOS if s.name == "deep_sigmoid_mlp")
    steps, top, error = gpu_scenarios.diagnose(scenario, "cpu")
    suite_run = S.evaluate(scenario)
    h = suite_run.hypotheses[0]
    assert error is None
    assert steps == suite_run.dbg.step == 40
    assert (
        top
        == (str(h.failure), str(h.cause), h.layer, h.step)
        == ("vanishing_gradients", "saturating_activation", "10", 0)
    )
