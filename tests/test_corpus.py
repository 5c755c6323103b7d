"""The mutation corpus (bench/corpus): operators plant what they say, labels follow the runs,
the features are the engine's own, and the fit recovers a known model."""

from __future__ import annotations

import os
import sys
import warnings

import numpy as np
import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.corpus import fit
from bench.corpus.bases import BASES, Knobs, base
from bench.corpus.labels import label
from bench.corpus.mutations import MUTATIONS, knobs_for, pairs, singles
from bench.corpus.run import one

from neuraldbg.types import Cause


def test_every_operator_plants_a_cause_of_the_vocabulary_and_applies_somewhere() -> None:
    names = {c.value for c in Cause}
    for m in MUTATIONS:
        assert m.cause in names and set(m.also) <= names, m
        assert any(m.applies_to(b) for b in BASES), m.name
    # Pairs combine different causes and never turn the same knob twice.
    for _, (a, b) in pairs(BASES, 200, seed=0):
        assert a.cause != b.cause and not set(a.knobs()) & set(b.knobs())
        # Operators added after the pairs were first drawn stay out of them (the same pairs).
        assert a.paired and b.paired
    assert len({(b.name, ms) for b, ms in singles(BASES)}) == len(singles(BASES))


def test_a_mutant_is_labelled_by_what_it_did_to_the_run() -> None:
    rec = {"ops": ["lr_x10"], "causes": ["learning_rate_too_high"], "chance": 0.1, "finite": True, "error": None}
    base = {"score": 0.9, "loss_first": 2.0, "loss_tail": 0.02}
    label(r := dict(rec, score=0.30), base)  # lost 0.6 of the base's 0.8 gain
    assert r["manifests"] and r["label"] == ["learning_rate_too_high"]
    label(r := dict(rec, score=0.85), base)  # trains as well as its base
    assert not r["manifests"] and r["label"] == ["healthy"]
    label(r := dict(rec, score=0.85, finite=False), base)  # the loss went NaN
    assert r["manifests"]
    label(r := dict(rec, ops=[], causes=[], score=0.9), base)
    assert r["label"] == ["healthy"]
    # The second criterion: the accuracy held, but the training loss kept only half of its
    # base's gain (log scale: 2.0 -> 0.2 against 2.0 -> 0.02).
    held_above = dict(rec, score=0.85, loss_tail=0.2)
    label(r := dict(held_above), base)
    assert not r["manifests"]
    label(r := dict(held_above), base, "quality+loss")
    assert r["manifests"] and r["label"] == ["learning_rate_too_high"]
    label(r := dict(held_above, loss_tail=0.03), base, "quality+loss")  # kept 91% of it
    assert not r["manifests"]
    # Not compared where the mutation changes the loss's floor.
    label(r := dict(held_above, ops=["label_noise"], causes=["bad_input_data"]), base, "quality+loss")
    assert not r["manifests"]
    # A mistake written in the program is labelled whatever the outcome; alone in a pair that
    # kept its quality, it is the label.
    pair = dict(rec, ops=["lr_x10", "out_softmax"], causes=["learning_rate_too_high", "output_loss_mismatch"])
    label(r := dict(pair, score=0.85), base)
    assert r["manifests"] and r["label"] == ["output_loss_mismatch"]
    label(r := dict(pair, score=0.30), base)
    assert r["label"] == ["learning_rate_too_high", "output_loss_mismatch"]
    label(r := dict(pair, score=0.85), base, "quality-only")
    assert not r["manifests"] and r["label"] == ["healthy"]


def test_a_run_carries_the_engines_evidence_and_the_features_are_read_from_it() -> None:
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    healthy = one("mlp_regression", (), 0)
    broken = one("mlp_regression", ("lr_x1000",), 0)
    label(broken, healthy)
    # Adam at lr 3 destroys the regression: it manifests, and the engine confirms a failure.
    assert broken["manifests"], (broken["score"], healthy["score"])
    assert broken["hypotheses"] and broken["hypotheses"][0]["confidence"] >= 0.5
    x = fit.features(broken["evidence"], broken["hypotheses"])
    assert x.shape == (len(fit.FEATURE_NAMES),)
    ep = fit.primary_episode(broken["evidence"], broken["hypotheses"])
    assert ep is not None and ep["failure"] == broken["hypotheses"][0]["failure"]
    top = ep["causes"][0]
    assert x[fit.FEATURE_NAMES.index(f"score:{top['cause']}")] == top["score"]
    assert x[fit.FEATURE_NAMES.index(f"failure:{ep['failure']}")] == 1.0
    # The engine's learning rate reaches the features as it was set (Adam, 3e-3 x 1000).
    assert abs(x[fit.FEATURE_NAMES.index("log10_lr")] - np.log10(3.0)) < 1e-6


def test_the_fit_recovers_a_known_multinomial_model() -> None:
    g = np.random.default_rng(0)
    w = np.array([[3.0, -3.0, 0.0], [0.0, 3.0, -3.0]])
    x = g.normal(size=(3000, 2))
    logits = x @ w
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    y_idx = np.array([g.choice(3, p=row) for row in p])
    y = np.eye(3)[y_idx]
    m = fit.Softmax(["a", "b", "c"], l2=1e-4).fit(x, y, np.ones(len(x)), iters=3000, lr=0.5)
    # Same predicted distribution as the generating model, on fresh points.
    xt = g.normal(size=(500, 2))
    lt = xt @ w
    pt = np.exp(lt - lt.max(1, keepdims=True))
    pt /= pt.sum(1, keepdims=True)
    assert np.abs(m.predict(xt) - pt).mean() < 0.03


def test_every_base_builds_with_default_knobs() -> None:
    for b in BASES:
        p = b.build(Knobs(), 0)
        x, y = p.batch(0)
        out = p.model(x)
        assert torch.isfinite(p.loss(out, y)), b.name
    assert base("lora").kind == "lora-fine-tuning"


def test_a_recurrent_regression_that_learned_nothing_under_a_tiny_lr_is_a_confirmed_plateau() -> None:
    """The GRU regression of the corpus at 1/100 of its learning rate: its held-out R^2 stays
    near 0 (its base reaches 0.97), its noisy loss ends a little below its first value but at
    the variance of its targets. A loss at its chance level is as stuck as one that never
    moved: the plateau is confirmed and the learning rate named at 0.5 or more."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    base = one("gru_regression", (), 0)
    slow = one("gru_regression", ("lr_div100",), 0)
    assert base["score"] > 0.9 and slow["score"] < 0.2, (base["score"], slow["score"])
    top = slow["hypotheses"][0]
    assert top["failure"] == "loss_plateau" and top["cause"] == "learning_rate_too_low", slow["hypotheses"]
    assert top["confidence"] >= 0.5, top


def test_a_layer_half_dead_from_initialization_that_dies_under_a_huge_lr_blames_the_lr() -> None:
    """The LSTM classifier of the corpus at 100x its learning rate (Adam at 0.5): its head's
    ReLU layer has half its units zero for the whole batch at the first step, as the base has
    (a forward hook counts them), then nearly all of them from step 20 (on the Intel Xeon VMs at
    least 31 of its 32 units at every step to 150; on an AMD EPYC, whose float kernels round
    differently, at least 30, all 32 at 72% of those steps), and the run learns
    nothing (held-out accuracy at chance; the base reaches 0.97 and keeps 70% of the units).
    The first measurement already counts the layer dead, so "alive at first" does not hold;
    the share that died after updates, with the measured step size, names the learning rate."""
    from bench.corpus.dead_units import dead_shares

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    shares, score, _ = dead_shares("lstm_classifier", "lr_x100", "head.1")
    base_shares, base_score, _ = dead_shares("lstm_classifier", "-", "head.1")
    assert shares[0] >= 0.5 and base_shares[0] >= 0.5, (shares[0], base_shares[0])
    assert min(shares[20:150]) > 0.9 and max(base_shares[20:150]) < 0.5, (min(shares[20:150]), max(base_shares[20:150]))
    assert score < 0.6 and base_score > 0.9, (score, base_score)
    run = one("lstm_classifier", ("lr_x100",), 0)
    top = run["hypotheses"][0]
    assert top["failure"] == "dead_neurons" and top["cause"] == "learning_rate_too_high", run["hypotheses"]
    assert top["confidence"] >= 0.5, top
    dead = next(e for e in run["evidence"]["episodes"] if e["failure"] == "dead_neurons")
    reasons = dead["causes"][0]["reasons"]
    assert any("were dead at first and 100% after updates" in r for r in reasons), reasons


def test_units_killed_by_the_sgd_steps_of_weights_ten_times_too_large_blame_the_initialization() -> None:
    """The corpus CNN with its weights 10x their default scale, under its own SGD (lr 0.05):
    its second ReLU layer is alive at the first step and entirely dead from the tenth on (a
    forward hook counts them), and the run learns nothing (held-out accuracy 0.09), while the
    default initialization under the same learning rate reaches 0.97 with that layer alive. A
    plain gradient step grows with the gradient, which grows with the weights around it: the
    large measured steps are the initialization's, not the learning rate's."""
    from bench.corpus.dead_units import dead_shares

    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    shares, score, _ = dead_shares("cnn", "init_x10", "features.3")
    base_shares, base_score, _ = dead_shares("cnn", "-", "features.3")
    assert shares[0] < 0.5 and min(shares[10:]) == 1.0, shares[:12]
    assert score < 0.2 and base_score > 0.9 and max(base_shares) < 0.5, (score, base_score)
    run = one("cnn", ("init_x10",), 0)
    top = run["hypotheses"][0]
    assert top["failure"] == "dead_neurons" and top["cause"] == "poor_initialization", run["hypotheses"]
    assert top["confidence"] >= 0.5, top
    dead = next(e for e in run["evidence"]["episodes"] if e["failure"] == "dead_neurons")
    reasons = next(c for c in dead["causes"] if c["cause"] == "poor_initialization")["reasons"]
    assert any("under a plain gradient step" in r for r in reasons), reasons


def test_tanh_units_saturated_by_raw_inputs_from_the_first_step_blame_the_data() -> None:
    """The corpus's binary classifier (Linear-Tanh layers, SGD) on inputs left on their raw
    scale (up to ~5,700): before any update, 99% of its first Tanh's outputs are within 0.01
    of +-1 (a forward hook on the first batch; none on the normalized inputs), and its held-out
    accuracy falls from 0.94 to near chance. The gradients that vanish behind that saturation
    are the data's fault, not the activation's: the same Tanh trains the base to 0.94."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)

    def first_tanh_saturation(ops: tuple) -> float:
        torch.manual_seed(0)
        p = base("mlp_binary").build(knobs_for(ops), 0)
        tanh = next(m for m in p.model.modules() if isinstance(m, torch.nn.Tanh))
        shares: list = []
        hook = tanh.register_forward_hook(lambda _m, _i, out: shares.append(float((out.abs() > 0.99).float().mean())))
        with torch.no_grad():
            p.model(p.batch(0)[0])
        hook.remove()
        return shares[0]

    assert first_tanh_saturation(("raw_inputs",)) > 0.95 and first_tanh_saturation(()) < 0.05
    plain, raw = one("mlp_binary", (), 0), one("mlp_binary", ("raw_inputs",), 0)
    assert plain["score"] > 0.9 and raw["score"] < 0.7, (plain["score"], raw["score"])
    top = raw["hypotheses"][0]
    assert top["failure"] == "vanishing_gradients" and top["cause"] == "bad_input_data", raw["hypotheses"]
    assert top["confidence"] >= 0.5, top
    vanishing = next(e for e in raw["evidence"]["episodes"] if e["failure"] == "vanishing_gradients")
    assert any("(not normalized)" in r for r in vanishing["causes"][0]["reasons"]), vanishing["causes"][0]


def test_an_autoencoder_fed_raw_pixels_blames_the_data_not_its_sigmoid_output() -> None:
    """The corpus autoencoder on inputs left on their raw scale: its inputs and reconstruction
    targets reach 255 while its output stays in [0, 1] (read off the first batch), and its
    held-out quality falls far below its base's, which the same sigmoid output trains well on
    normalized data. The cause is the data; the output that cannot reach the targets is its
    evidence."""
    warnings.simplefilter("ignore")
    torch.set_num_threads(1)
    torch.manual_seed(0)
    p = base("autoencoder").build(knobs_for(("raw_inputs",)), 0)
    x, y = p.batch(0)[:2]
    with torch.no_grad():
        out = p.model(x)
    assert float(x.abs().max()) > 100 and float(y.max()) > 100, (float(x.abs().max()), float(y.max()))
    assert float(out.min()) >= 0.0 and float(out.max()) <= 1.0
    plain, raw = one("autoencoder", (), 0), one("autoencoder", ("raw_inputs",), 0)
    assert raw["score"] < plain["score"] - 0.5, (plain["score"], raw["score"])
    top = raw["hypotheses"][0]
    assert top["cause"] == "bad_input_data" and top["confidence"] >= 0.5, raw["hypotheses"]
    episode = next(
        e for e in raw["evidence"]["episodes"] if e["failure"] == top["failure"] and e["onset"] == top["step"]
    )
    assert episode["causes"][0]["cause"] == "bad_input_data"
    assert any("the data is not normalized" in r for r in episode["causes"][0]["reasons"]), episode["causes"][0]


def test_the_engines_own_form_recovers_a_known_scale_and_offset() -> None:
    # Runs whose planted cause was drawn from the engine's softmax with learning_rate_too_low's
    # evidence counting twice and 0.5 more: the fit finds those numbers and leaves the others.
    g = np.random.default_rng(0)
    true = {"dying_relu": (1.0, 0.0), "learning_rate_too_low": (2.0, 0.5)}
    records = []
    for _ in range(2000):
        evidence = {c: float(g.uniform(0.0, 3.0)) for c in true}
        scores = {c: a * evidence[c] - 1.5 + b for c, (a, b) in true.items()} | {"unknown": 0.0}
        z = np.array([1.5 * v for v in scores.values()])
        p = np.exp(z - z.max())
        planted = list(scores)[g.choice(3, p=p / p.sum())]
        causes = [{"cause": c, "score": evidence[c] - 1.5} for c in true] + [{"cause": "unknown", "score": 0.0}]
        episode = {"failure": "loss_plateau", "onset": 0, "layer": "fc", "explained_by": None, "p_failure": 1.0}
        records.append(
            {"label": [planted], "hypotheses": [], "evidence": {"episodes": [{**episode, "causes": causes}]}}
        )
    m = fit.CauseScales(l2=1e-5).fit(records, iters=4000)
    fitted = {c: (float(np.exp(a)), float(b)) for c, a, b in zip(m.named, m.log_scale, m.offset)}
    assert abs(fitted["learning_rate_too_low"][0] - 2.0) < 0.25 and abs(fitted["learning_rate_too_low"][1] - 0.5) < 0.3
    assert abs(fitted["dying_relu"][0] - 1.0) < 0.15 and abs(fitted["dying_relu"][1]) < 0.3
    assert fitted["poor_initialization"] == (1.0, 0.0)  # never a candidate: not moved


def test_two_corpus_runs_are_compared_by_the_runs_whose_verdict_changed() -> None:
    def run(ops, label, cause, confidence):
        hyp = {"failure": "loss_plateau", "cause": cause, "confidence": confidence}
        return {"base": "mlp", "ops": ops, "seed": 0, "label": label, "hypotheses": [hyp]}

    old = [run(["lr_div10"], ["learning_rate_too_low"], "unknown", 0.49), run([], ["healthy"], "unknown", 0.2)]
    new = [
        run(["lr_div10"], ["learning_rate_too_low"], "learning_rate_too_low", 0.7),
        run([], ["healthy"], "dying_relu", 0.6),
    ]
    changed = fit.changed_verdicts(old, new)
    assert len(changed) == 2, changed
    assert changed[0].startswith("wrong -> right: mlp lr_div10") and changed[1].startswith("right -> wrong: mlp -")
    assert fit.changed_verdicts(old, old) == []
