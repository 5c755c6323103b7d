"""The scenarios. Each function returns a :class:`Scenario` whose ``check`` proves its ground
truth from the independent record of the same run."""

from __future__ import annotations

import math
from typing import List

import torch
import torch.nn as nn
import torch.nn.functional as F

from .recorder import EXPLODING, VANISHING, Record
from .scenarios import (
    Batch,
    ConvNet,
    LSTMClassifier,
    NormalizedMLP,
    PaddedEncoder,
    ResNetMLP,
    Scenario,
    Setup,
    TinyTransformer,
    Truth,
    corrupt,
    expect,
    float_sequences,
    healthy_check,
    image_data,
    init_weights,
    learns,
    lr_at,
    mlp,
    sequence_data,
    teacher_data,
)

CE = nn.CrossEntropyLoss


def vanishing(v: float) -> bool:
    return v < VANISHING


def exploding(v: float) -> bool:
    return v > EXPLODING


def first_vanishing(r: Record):
    step = r.first_step(lambda s: r.any_layer(s, vanishing), 3)
    return step, (None if step is None else r.gradient_root(step, vanishing))


def first_exploding(r: Record):
    step = r.first_step(lambda s: r.any_layer(s, exploding), 1)
    return step, (None if step is None else r.gradient_root(step, exploding))


def first_nonfinite_step(r: Record):
    return next((s for s in range(r.steps) if not r.all_finite(s) or r.first_nonfinite[s]), None)


# ============================================================================ failures


def deep_sigmoid() -> Scenario:
    truth = Truth("vanishing_gradients", "saturating_activation", "10", 0)

    def build() -> Setup:
        model = mlp([16] + [32] * 12 + [4], nn.Sigmoid)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.1), CE(), teacher_data(16, 4, 64), 40)

    def check(r: Record) -> None:
        step, root = first_vanishing(r)
        expect(truth, "step", step)
        expect(truth, "layer", root)
        slopes = [v[0] for v in r.slope.values()]
        assert max(slopes) <= 0.25 + 1e-6, "sigmoid slopes never exceed 1/4: each layer cuts the gradient 4x"

    def counterfactual() -> Setup:
        model = mlp([16] + [32] * 12 + [4], nn.ReLU)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.1), CE(), teacher_data(16, 4, 64), 40)

    def counter_check(r: Record) -> None:
        assert first_vanishing(r)[0] is None, "the same depth with ReLU must not vanish"

    return Scenario(
        "deep_sigmoid_mlp",
        "MLP 12x Sigmoid",
        "12 sigmoid layers: sigmoid's slope is at most 1/4, so the gradient shrinks ~4x per layer "
        "and the first layers' gradients vanish from step 0",
        build,
        truth,
        check,
        counterfactual,
        counter_check,
    )


def deep_tanh_depth() -> Scenario:
    truth = Truth("vanishing_gradients", "network_depth", None, 0)

    def make(depth: int) -> Setup:
        model = mlp([16] + [32] * depth + [4], nn.Tanh)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), teacher_data(16, 4, 64), 40)

    def check(r: Record) -> None:
        step, _root = first_vanishing(r)
        expect(truth, "step", step)
        slopes = [v[0] for v in r.slope.values()]
        assert min(slopes) > 0.7, "tanh runs in its linear region: the activation is not what shrinks the gradient"
        norms = [math.log10(r.grad[n][0]) for n in r.layer_names]
        assert all(b >= a - 0.3 for a, b in zip(norms, norms[1:])), "gradient shrinks layer by layer towards the input"
        assert norms[-1] - norms[0] > 4, "over many decades"

    def counter_check(r: Record) -> None:
        assert first_vanishing(r)[0] is None, "the same layers, 6 deep, must not vanish"

    return Scenario(
        "deep_tanh_mlp",
        "MLP 48x Tanh",
        "48 tanh layers with PyTorch's default init: each layer passes back ~0.5x of the gradient, "
        "so after 48 layers it has vanished, though no unit is saturated",
        lambda: make(48),
        truth,
        check,
        lambda: make(6),
        counter_check,
    )


def dead_relu_bias() -> Scenario:
    truth = Truth("dead_neurons", "dying_relu", "7", 0)

    def build() -> Setup:
        model = mlp([16, 32, 32, 32, 32, 32, 4], nn.ReLU)
        with torch.no_grad():
            model[6].bias.fill_(-20.0)  # the 4th Linear: every unit of the ReLU after it is off
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), teacher_data(16, 4, 64), 40)

    def check(r: Record) -> None:
        dead_at_0 = [n for n in r.module_order if n in r.dead and r.dead[n][0] >= 0.99]
        expect(truth, "layer", dead_at_0[0])
        expect(truth, "step", 0)
        before = r.layer_names[: r.layer_names.index("6") + 1]
        assert all(r.grad[n][0] == 0.0 for n in before), "every layer before the dead ReLU gets exactly zero gradient"

    return Scenario(
        "dead_relu_bias_init",
        "MLP 5x ReLU",
        "a bias of -20 switches off every unit of the 4th ReLU: no gradient reaches the layers "
        "below it; the dead layer, not the layers whose gradients vanished, is the root",
        build,
        truth,
        check,
    )


def relu_dies_adam() -> Scenario:
    # The cause is the step size, not the activation: the counter-run differs only in the
    # learning rate (0.2 -> 1e-3), and no unit dies there.
    truth = Truth("dead_neurons", "learning_rate_too_high", "3", 3)

    def make(lr: float) -> Setup:
        model = mlp([16, 64, 64, 64, 4], nn.ReLU)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=lr), CE(), teacher_data(16, 4, 64), 80)

    def check(r: Record) -> None:
        # The root: the first ReLU in forward order that goes (nearly) completely dead; its
        # failure begins when at least half its units are silent for 3 steps running.
        layer = next(n for n in r.module_order if n in r.dead and max(r.dead[n]) >= 0.9)
        expect(truth, "layer", layer)
        expect(truth, "step", r.first_step(lambda s: r.dead[layer][s] >= 0.5, 3))
        assert all(v[0] < 0.1 for v in r.dead.values()), "alive at the start"
        assert max(r.dead[layer]) >= 0.99, "the layer ends up completely dead"
        below = r.layer_names[: r.layer_names.index("2") + 1]
        assert r.first_step(lambda s: all(r.grad[n][s] == 0.0 for n in below), 3) is not None, (
            "later, nothing flows back through it"
        )

    def counter_check(r: Record) -> None:
        assert r.first_step(lambda s: any(v[s] >= 0.5 for v in r.dead.values()), 3) is None

    return Scenario(
        "relu_dies_adam_lr",
        "MLP 3x ReLU",
        "Adam at lr=0.2 kicks pre-activations negative: the second ReLU layer goes silent within "
        "a few steps and later blocks every gradient below it",
        lambda: make(0.2),
        truth,
        check,
        lambda: make(1e-3),
        counter_check,
    )


def lr_spike_explosion() -> Scenario:
    truth = Truth("exploding_gradients", "learning_rate_too_high", None, 36)

    def make(spike: float) -> Setup:
        model = ConvNet([3, 8, 16, 16], 5, norm=False)
        return Setup(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9),
            CE(),
            image_data(3, 12, 5, 32),
            60,
            before_step=lr_at(lambda s: 0.01 * (spike if s >= 30 else 1.0)),
        )

    def check(r: Record) -> None:
        expect(truth, "step", first_exploding(r)[0])
        assert all(r.max_grad(s) < 10 for s in range(30)), "healthy before the lr change"

    def counter_check(r: Record) -> None:
        assert first_exploding(r)[0] is None and all(r.all_finite(s) for s in range(r.steps))

    return Scenario(
        "cnn_lr_schedule_explosion",
        "CNN (no norm)",
        "a learning-rate schedule multiplies the lr by 1000 at step 30: weights blow up and the "
        "gradients explode a few steps later",
        lambda: make(1000.0),
        truth,
        check,
        lambda: make(1.0),
        counter_check,
    )


def nan_batch() -> Scenario:
    truth = Truth("data_anomaly", "bad_input_data", None, 25)

    def build() -> Setup:
        model = ConvNet([3, 8, 16], 5, norm=True)
        data = corrupt(image_data(3, 12, 5, 32), 25, lambda x: x.index_fill_(0, torch.tensor([3]), float("nan")))
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), CE(), data, 40)

    def check(r: Record) -> None:
        expect(truth, "step", next(s for s in range(r.steps) if not r.input_finite[s]))
        assert all(r.all_finite(s) for s in range(25)), "healthy before the bad batch"
        assert not r.all_finite(25), "the bad batch poisons the step"

    return Scenario(
        "cnn_bn_nan_batch",
        "CNN + BatchNorm",
        "one sample of the batch at step 25 is all NaN (a corrupt image): loss, gradients and then every weight go NaN",
        build,
        truth,
        check,
    )


def ood_batch() -> Scenario:
    truth = Truth("data_anomaly", "bad_input_data", None, 40)

    def build() -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        data = corrupt(teacher_data(16, 4, 64), 40, lambda x: x * 1e4)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), data, 60)

    def check(r: Record) -> None:
        scale = r.input_scale
        usual = sorted(scale[:40])[20]
        jumps = [s for s in range(r.steps) if scale[s] > 100 * usual]
        expect(truth, "step", jumps[0])
        assert r.max_grad(40) > 30 * max(r.max_grad(s) for s in range(40)), "the batch hits the gradients"

    return Scenario(
        "mlp_unnormalized_batch",
        "MLP 2x ReLU",
        "the batch at step 40 arrives un-normalized, 10^4 times the usual scale: a gradient spike "
        "that wrecks the weights",
        build,
        truth,
        check,
    )


def normalize_nan() -> Scenario:
    truth = Truth("non_finite", "numerical_instability", "normalize", 30)

    def build() -> Setup:
        model = NormalizedMLP(16, 32, 4)
        data = corrupt(teacher_data(16, 4, 32), 30, lambda x: x.index_fill_(0, torch.tensor([5]), 0.0))
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), data, 45)

    def check(r: Record) -> None:
        step = first_nonfinite_step(r)
        expect(truth, "step", step)
        expect(truth, "layer", r.first_nonfinite[step])
        assert r.input_finite[step], "the input batch itself is finite"

    return Scenario(
        "custom_l2_normalize_nan",
        "custom module (MLP)",
        "a custom L2-normalize layer divides by the sample norm without an epsilon; an all-zero "
        "(but perfectly finite) sample at step 30 gives 0/0",
        build,
        truth,
        check,
    )


def masked_attention_nan() -> Scenario:
    truth = Truth("non_finite", "numerical_instability", "attn", 20)

    def build() -> Setup:
        torch.manual_seed(0)
        model = PaddedEncoder(50, 32, 4)
        base = sequence_data(50, 12, 4, 32)

        def data(i: int):
            x, y = base(i)
            x = x.clamp(min=1)
            if i == 20:
                x[7] = 0  # an empty (all padding) sequence
            return x, y

        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), data, 30)

    def check(r: Record) -> None:
        step = first_nonfinite_step(r)
        expect(truth, "step", step)
        expect(truth, "layer", r.first_nonfinite[step])

    return Scenario(
        "attention_all_masked_nan",
        "custom attention",
        "hand-written attention masks padding with -inf; an all-padding sequence at step 20 "
        "makes softmax compute 0/0 in the attention module",
        build,
        truth,
        check,
    )


def lr_too_low() -> Scenario:
    truth = Truth("loss_plateau", "learning_rate_too_low", None, 0)

    def make(lr: float) -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=lr), CE(), teacher_data(16, 4, 64), 150)

    def check(r: Record) -> None:
        start, end = sum(r.loss[:5]) / 5, sum(r.loss[-5:]) / 5
        assert abs(start - end) < 0.01 * start, "the loss does not move"
        assert first_vanishing(r)[0] is None and first_exploding(r)[0] is None, "gradients are healthy"

    return Scenario(
        "mlp_lr_too_low",
        "MLP 2x ReLU",
        "SGD at lr=1e-6: healthy gradients, but the weights barely move and the loss stays flat",
        lambda: make(1e-6),
        truth,
        check,
        lambda: make(0.1),
        learns(0.3),
    )


def adam_divergence() -> Scenario:
    truth = Truth("loss_divergence", "learning_rate_too_high", None, None)

    def make(lr: float) -> Setup:
        model = TinyTransformer(50, 32, 4, 2, 4)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=lr), CE(), sequence_data(50, 16, 4, 32), 60)

    def check(r: Record) -> None:
        best = min(r.loss[:10])
        assert max(r.loss[10:]) > 3 * best and max(r.loss[10:]) > r.loss[0], "the loss rises far above its best"
        assert first_exploding(r)[0] is None, "the gradients themselves never pass 1e3"

    return Scenario(
        "transformer_adam_lr_too_high",
        "Transformer",
        "a 2-layer transformer with Adam at lr=0.5: the loss climbs above where it started",
        lambda: make(0.5),
        truth,
        check,
        lambda: make(1e-3),
        learns(0.15),
    )


def tiny_init() -> Scenario:
    truth = Truth("vanishing_gradients", "poor_initialization", None, 0)

    def make(std) -> Setup:
        model = mlp([16, 32, 32, 32, 32, 32, 4], nn.ReLU)
        if std is not None:
            init_weights(model, std, bias=0.0)
        else:  # the counterfactual: He initialization
            for m in model.modules():
                if isinstance(m, nn.Linear):
                    nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                    nn.init.zeros_(m.bias)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.1), CE(), teacher_data(16, 4, 64), 40)

    def check(r: Record) -> None:
        expect(truth, "step", first_vanishing(r)[0])

    return Scenario(
        "mlp_tiny_init",
        "MLP 5x ReLU",
        "weights initialised with std 1e-3 (100x too small): the signal, and with it every "
        "gradient, shrinks ~200x per layer",
        lambda: make(1e-3),
        truth,
        check,
        lambda: make(None),
        learns(0.2),
    )


def huge_init() -> Scenario:
    truth = Truth("exploding_gradients", "poor_initialization", None, 0)

    def make(std) -> Setup:
        model = mlp([16, 64, 64, 64, 4], nn.ReLU)
        if std is not None:
            init_weights(model, std)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=1e-4), CE(), teacher_data(16, 4, 64), 30)

    def check(r: Record) -> None:
        expect(truth, "step", first_exploding(r)[0])

    def counter_check(r: Record) -> None:
        assert first_exploding(r)[0] is None

    return Scenario(
        "mlp_huge_init",
        "MLP 3x ReLU",
        "weights initialised with std 3 (~25x a He init): activations and gradients are huge from the first step",
        lambda: make(3.0),
        truth,
        check,
        lambda: make(None),
        counter_check,
    )


def cnn_dead_channels() -> Scenario:
    truth = Truth("dead_neurons", "dying_relu", "blocks.1.2", 0)

    def build() -> Setup:
        model = ConvNet([3, 8, 16, 16], 5, norm=True)
        with torch.no_grad():
            model.blocks[1][1].bias.fill_(-30.0)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), image_data(3, 12, 5, 32), 30)

    def check(r: Record) -> None:
        dead_at_0 = [n for n in r.module_order if n in r.dead and r.dead[n][0] >= 0.99]
        expect(truth, "layer", dead_at_0[0])
        assert r.grad["blocks.0.0"][0] == 0.0, "no gradient reaches the first convolution"

    return Scenario(
        "cnn_bn_dead_channels",
        "CNN + BatchNorm",
        "BatchNorm's shift of the second block starts at -30: every channel of its ReLU is off "
        "and nothing flows back to the first block",
        build,
        truth,
        check,
    )


def lstm_divergence() -> Scenario:
    truth = Truth("loss_divergence", "learning_rate_too_high", None, None)

    def make(lr: float) -> Setup:
        model = LSTMClassifier(8, 32, 4)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=lr), CE(), float_sequences(8, 30, 4, 32), 60)

    def check(r: Record) -> None:
        assert max(r.loss) > 10 * r.loss[0], "the loss climbs far above where it started"
        assert first_exploding(r)[0] is None, "the LSTM's gates keep the gradient norms below 1e3"

    def counter_check(r: Record) -> None:
        assert max(r.loss) < 1.5 * r.loss[0]

    return Scenario(
        "lstm_lr_too_high",
        "LSTM",
        "an LSTM trained with plain SGD at lr=50: the loss blows up to ~100x its start while "
        "the gated recurrence keeps gradient norms moderate",
        lambda: make(50.0),
        truth,
        check,
        lambda: make(0.5),
        counter_check,
    )


def accumulation_explosion() -> Scenario:
    truth = Truth("exploding_gradients", "learning_rate_too_high", None, 22)

    def make(spike: float) -> Setup:
        model = ResNetMLP(16, 32, 3, 4)
        for b in model.blocks:
            b.norm = nn.Identity()  # a residual net without normalization
        return Setup(
            model,
            torch.optim.SGD(model.parameters(), lr=0.02),
            CE(),
            teacher_data(16, 4, 16),
            40,
            before_step=lr_at(lambda s: 0.02 * (spike if s >= 20 else 1.0)),
            accumulate=4,
        )

    def check(r: Record) -> None:
        expect(truth, "step", first_exploding(r)[0])
        assert all(r.max_grad(s) < 100 for s in range(20)), "healthy before the lr change"

    def counter_check(r: Record) -> None:
        assert first_exploding(r)[0] is None

    return Scenario(
        "resnet_accumulation_lr_explosion",
        "residual MLP, grad accumulation x4",
        "gradient accumulation over 4 micro-batches per step; the lr jumps 500x at step 20 and "
        "the gradients explode; steps are optimizer steps, not micro-batches",
        lambda: make(500.0),
        truth,
        check,
        lambda: make(1.0),
        counter_check,
    )


def tanh_saturated() -> Scenario:
    truth = Truth("saturated_activations", "poor_initialization", "1", 0)

    def make(std) -> Setup:
        model = mlp([16, 64, 64, 4], nn.Tanh)
        if std is not None:
            init_weights(model, std)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.01), CE(), teacher_data(16, 4, 64), 40)

    def check(r: Record) -> None:
        first = [n for n in r.module_order if n in r.saturated and r.saturated[n][0] >= 0.5]
        expect(truth, "layer", first[0])
        assert first_vanishing(r)[0] is None, "gradients do not vanish: the saturation itself is the failure"

    def counter_check(r: Record) -> None:
        assert all(v[0] < 0.5 for v in r.saturated.values())

    return Scenario(
        "tanh_saturated_large_init",
        "MLP 2x Tanh",
        "weights with std 2 (16x Xavier): pre-activations of ±10, most tanh outputs pinned at ±1",
        lambda: make(2.0),
        truth,
        check,
        lambda: make(None),
        counter_check,
    )


def lstm_nan_input() -> Scenario:
    truth = Truth("data_anomaly", "bad_input_data", None, 15)

    def build() -> Setup:
        model = LSTMClassifier(8, 32, 4)
        data = corrupt(
            float_sequences(8, 20, 4, 32),
            15,
            lambda x: x.index_put_((torch.tensor([2]), torch.tensor([7])), torch.tensor(float("inf"))),
        )
        return Setup(model, torch.optim.Adam(model.parameters(), lr=3e-3), CE(), data, 30)

    def check(r: Record) -> None:
        expect(truth, "step", next(s for s in range(r.steps) if not r.input_finite[s]))
        assert not r.all_finite(15), "one Inf feature poisons the recurrence"

    return Scenario(
        "lstm_inf_in_sequence",
        "LSTM",
        "one time step of one sequence at step 15 holds an Inf (a sensor glitch): the LSTM state and "
        "every gradient go NaN",
        build,
        truth,
        check,
    )


class NaiveSoftmaxPool(nn.Module):
    """Attention pooling with a hand-written softmax (no max subtraction) and a sharp temperature."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.score = nn.Linear(d, 1)
        self.temperature = 0.002

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        w = torch.exp(self.score(h) / self.temperature)
        w = w / w.sum(dim=1, keepdim=True)
        return (w * h).sum(dim=1)


class PooledClassifier(nn.Module):
    def __init__(self, features: int, d: int, classes: int) -> None:
        super().__init__()
        self.proj = nn.Linear(features, d)
        self.act = nn.GELU()
        self.pool = NaiveSoftmaxPool(d)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.act(self.proj(x))))


def softmax_overflow() -> Scenario:
    truth = Truth("non_finite", "numerical_instability", "pool", 0)

    def build() -> Setup:
        model = PooledClassifier(8, 32, 4)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), float_sequences(8, 16, 4, 32), 20)

    def check(r: Record) -> None:
        step = first_nonfinite_step(r)
        expect(truth, "step", step)
        expect(truth, "layer", r.first_nonfinite[step])
        assert all(r.input_finite), "inputs are finite"

    return Scenario(
        "custom_softmax_overflow",
        "custom attention pooling",
        "a hand-written softmax exp(s / 0.002) without subtracting the max overflows float32 "
        "(exp(>88) = inf, inf/inf = NaN) on the very first batch",
        build,
        truth,
        check,
    )


def unscaled_targets() -> Scenario:
    truth = Truth("exploding_gradients", "bad_input_data", None, 0)

    def make(scale: float, shift: float) -> Setup:
        model = mlp([16, 64, 64, 1], nn.ReLU)
        g = torch.Generator().manual_seed(5)
        w = torch.randn(16, 1, generator=g)

        def data(i: int):
            gi = torch.Generator().manual_seed(i)
            x = torch.randn(64, 16, generator=gi)
            return x, (x @ w) * scale + shift

        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), nn.MSELoss(), data, 60)

    def check(r: Record) -> None:
        expect(truth, "step", first_exploding(r)[0])
        assert r.loss[0] > 1e4, "the loss starts huge"

    def counter_check(r: Record) -> None:
        assert first_exploding(r)[0] is None, "the same model on standardized targets is fine"

    return Scenario(
        "regression_unscaled_targets",
        "MLP 2x ReLU, MSE",
        "regression targets around 500 with spread 100 (not standardized): an MSE of ~4e5 and "
        "gradients above 1e3 from the first step, with ordinarily initialized weights",
        lambda: make(100.0, 500.0),
        truth,
        check,
        lambda: make(1.0, 0.0),
        counter_check,
    )


# Four classes, one of them 70% of the targets: H = -(0.7 ln 0.7 + 3 x 0.1 ln 0.1) = 0.94 nats.
UNBALANCED = (0.7, 0.1, 0.1, 0.1)


def unbalanced_entropy() -> float:
    return -sum(p * math.log(p) for p in UNBALANCED)


def majority_class_only() -> Scenario:
    truth = Truth("loss_plateau", "bad_input_data", None, None)

    def make(related: bool) -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        g = torch.Generator().manual_seed(6)
        w = torch.randn(16, 4, generator=g)
        # A teacher whose bias makes class 0 about as common as in UNBALANCED.
        bias = torch.tensor([5.5, 0.0, 0.0, 0.0])

        def data(i: int) -> Batch:
            gi = torch.Generator().manual_seed(6 * 100_003 + i)
            x = torch.randn(256, 16, generator=gi)
            if related:
                return x, (x @ w + bias).argmax(1)
            return x, torch.multinomial(torch.tensor(UNBALANCED), 256, replacement=True, generator=gi)

        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), data, 150)

    def check(r: Record) -> None:
        end = sum(r.loss[-20:]) / 20
        level = unbalanced_entropy()
        assert abs(end - level) < 0.05 * level, f"the loss ends at the classes' entropy: {end:.3f} vs {level:.3f}"
        assert end < 0.75 * math.log(4), "far below ln 4: the loss fell, to the frequencies"

    def counter_check(r: Record) -> None:
        learns(0.3)(r)
        freq = torch.bincount(make(True).batch(0)[1], minlength=4).float() / 256
        assert freq.max() > 0.6, "the counterfactual's classes are as unbalanced"
        assert sum(r.loss[-5:]) / 5 < 0.6 * unbalanced_entropy(), "it learns beyond the frequencies"

    return Scenario(
        "mlp_majority_class_only",
        "MLP 2x ReLU",
        "four classes, one 70% of them, drawn apart from the inputs: the loss falls from ln 4 to the "
        "classes' entropy (0.94) and stays: the model learned how often each class occurs and "
        "nothing of its input",
        lambda: make(False),
        truth,
        check,
        lambda: make(True),
        counter_check,
    )


def lstm_first_step_readout() -> Scenario:
    truth = Truth("loss_plateau", "sequence_start_readout", None, None)

    def make(read: int) -> Setup:
        model = LSTMClassifier(8, 32, 4, read=read)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=3e-3), CE(), float_sequences(8, 20, 4, 64), 150)

    def check(r: Record) -> None:
        end = sum(r.loss[-20:]) / 20
        assert end > 0.9 * math.log(4), f"the loss stays near ln 4: {end:.3f}"

    return Scenario(
        "lstm_first_step_readout",
        "LSTM",
        "the head reads the LSTM's output at the first step (out[:, 0]) where the last was meant: "
        "a one-way LSTM has seen one of the 20 steps there, and the class depends on all of them: "
        "the loss stays near ln 4",
        lambda: make(0),
        truth,
        check,
        lambda: make(-1),
        learns(0.3),
    )


def double_he_init() -> Scenario:
    truth = Truth("exploding_gradients", "poor_initialization", None, 0)

    def make(factor: float) -> Setup:
        model = mlp([16] + [64] * 10 + [4], nn.ReLU)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                m.weight.data.mul_(factor)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=1e-3), CE(), teacher_data(16, 4, 64), 30)

    def check(r: Record) -> None:
        expect(truth, "step", first_exploding(r)[0])
        # The forward signal grows 2x per layer and the backward signal 2x per layer back, so
        # every layer's weight gradient (their product) is huge, not just the first.
        assert r.loss[0] > 100, "the logits, and the loss, are huge from the first step"
        assert all(r.grad[n][0] > 100 for n in r.layer_names), "every layer's gradient is huge"

    def counter_check(r: Record) -> None:
        assert first_exploding(r)[0] is None, "He init itself (factor 1) is stable"

    return Scenario(
        "mlp_double_he_init",
        "MLP 10x ReLU",
        "He initialization scaled by 2: every layer doubles the signal, 2^10 over ten layers: "
        "huge logits, a huge loss, and gradients above 1e3 in every layer from the first step",
        lambda: make(2.0),
        truth,
        check,
        lambda: make(1.0),
        counter_check,
    )


def unnormalized_pixels() -> Scenario:
    truth = Truth("saturated_activations", "bad_input_data", "1", 0)

    def make(raw: bool) -> Setup:
        base = image_data(3, 8, 5, 32)

        def data(i: int):
            x, y = base(i)
            x = (x * 40 + 128).clamp(0, 255).flatten(1)  # 8-bit pixel values
            return (x if raw else (x - 128) / 40), y

        model = nn.Sequential(nn.Linear(192, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(), nn.Linear(64, 5))
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.01), CE(), data, 40)

    def check(r: Record) -> None:
        first = [n for n in r.module_order if n in r.saturated and r.saturated[n][0] >= 0.5]
        expect(truth, "layer", first[0])
        assert max(r.input_scale) > 200, "8-bit pixels straight into the model"

    def counter_check(r: Record) -> None:
        assert all(v[0] < 0.5 for v in r.saturated.values()), "normalized inputs do not saturate"

    return Scenario(
        "mlp_unnormalized_pixels",
        "MLP 2x Tanh",
        "raw 0..255 pixel values fed to a tanh MLP with ordinary init: the first tanh is pinned "
        "at +-1 from the first step",
        lambda: make(True),
        truth,
        check,
        lambda: make(False),
        counter_check,
    )


def zero_batch() -> Scenario:
    truth = Truth("data_anomaly", "bad_input_data", None, 30)

    def build() -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        data = corrupt(teacher_data(16, 4, 64), 30, lambda x: x * 0.0)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), data, 45)

    def check(r: Record) -> None:
        expect(truth, "step", next(s for s in range(r.steps) if r.input_scale[s] == 0.0))

    return Scenario(
        "mlp_all_zero_batch",
        "MLP 2x ReLU",
        "the loader yields an all-zero batch at step 30 (a blank shard): finite, but no signal at all",
        build,
        truth,
        check,
    )


def warmup_too_high() -> Scenario:
    truth = Truth("loss_divergence", "learning_rate_too_high", None, None)

    def make(peak: float) -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        return Setup(
            model,
            torch.optim.SGD(model.parameters(), lr=0.01),
            CE(),
            teacher_data(16, 4, 64),
            80,
            before_step=lr_at(lambda s: min(peak, 0.01 * (1 + 10 * s))),
        )

    def check(r: Record) -> None:
        assert max(r.loss) > 5 * min(r.loss[:30]) and max(r.loss) > r.loss[0], "the loss blows up"
        assert first_exploding(r)[0] is None, "gradients stay below 1e3"

    def counter_check(r: Record) -> None:
        assert max(r.loss[10:]) < r.loss[0]

    return Scenario(
        "mlp_warmup_to_lr_5",
        "MLP 2x ReLU",
        "a linear warmup that never stops: the lr reaches 5.0 around step 50 and the loss blows up",
        lambda: make(5.0),
        truth,
        check,
        lambda: make(0.1),
        counter_check,
    )


# ============================================================================ healthy


class TwoTowers(nn.Module):
    """Two MLP towers over the two halves of a paired input, their unit-norm embeddings
    stacked: ``(batch, 2, dim)``."""

    def __init__(self, half: int, hidden: int, dim: int) -> None:
        super().__init__()
        self.half = half
        self.a = nn.Sequential(nn.Linear(half, hidden), nn.ReLU(), nn.Linear(hidden, dim))
        self.b = nn.Sequential(nn.Linear(half, hidden), nn.ReLU(), nn.Linear(hidden, dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        za = F.normalize(self.a(x[:, : self.half]), dim=1)
        zb = F.normalize(self.b(x[:, self.half :]), dim=1)
        return torch.stack([za, zb], 1)


class ClipLoss(nn.Module):
    """CLIP's symmetric cross-entropy over the similarities of the two views, at temperature
    0.1; the targets are each sample's place in the batch."""

    def forward(self, z: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        logits = z[:, 0] @ z[:, 1].T / 0.1
        return (F.cross_entropy(logits, y) + F.cross_entropy(logits.T, y)) / 2


def healthy(name: str, arch: str, story: str, build, min_drop: float = 0.3) -> Scenario:
    return Scenario(name, arch, story, build, Truth(None), healthy_check(min_drop))


def healthy_runs() -> List[Scenario]:
    def h_mlp() -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), teacher_data(16, 4, 64), 150)

    def h_cnn() -> Setup:
        model = ConvNet([3, 8, 16, 16], 5, norm=True)
        return Setup(
            model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), CE(), image_data(3, 12, 5, 32), 80
        )

    def h_lstm() -> Setup:
        model = LSTMClassifier(8, 32, 4)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=3e-3), CE(), float_sequences(8, 20, 4, 32), 120)

    def h_transformer() -> Setup:
        model = TinyTransformer(50, 32, 4, 2, 4)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        return Setup(
            model,
            opt,
            CE(),
            sequence_data(50, 16, 4, 32),
            120,
            before_step=lr_at(lambda s: 1e-3 * min(1.0, (s + 1) / 20)),
        )

    def h_resnet() -> Setup:
        model = ResNetMLP(16, 32, 6, 4)
        return Setup(
            model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), CE(), teacher_data(16, 4, 64), 120
        )

    def h_tanh() -> Setup:
        model = mlp([16, 64, 64, 4], nn.Tanh)
        for m in model.modules():
            if isinstance(m, nn.Linear):
                nn.init.xavier_normal_(m.weight, gain=5 / 3)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), teacher_data(16, 4, 64), 120)

    def h_converges() -> Setup:
        model = mlp([16, 64, 4], nn.ReLU)
        fixed = teacher_data(16, 4, 64)(0)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-2), CE(), lambda i: fixed, 400)

    def h_accumulate() -> Setup:
        model = ResNetMLP(16, 32, 3, 4)
        return Setup(
            model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), teacher_data(16, 4, 16), 60, accumulate=4
        )

    def h_dropout() -> Setup:
        model = nn.Sequential(
            nn.Linear(16, 64),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(64, 64),
            nn.ReLU(),
            nn.Dropout(0.5),
            nn.Linear(64, 4),
        )
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), teacher_data(16, 4, 64), 150)

    def h_clipped() -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        opt = torch.optim.SGD(model.parameters(), lr=1.0)
        step = opt.step

        def clipped_step(*a, **k):  # clip inside step, like a training framework would
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            return step(*a, **k)

        opt.step = clipped_step  # type: ignore[method-assign]
        return Setup(model, opt, CE(), teacher_data(16, 4, 64), 100)

    def h_binary() -> Setup:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1), nn.Sigmoid())
        teacher = teacher_data(16, 2, 64)

        def batch_at(i: int) -> Batch:
            x, y = teacher(i)
            return x, y.float()[:, None]

        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-2), nn.BCELoss(), batch_at, 150)

    def h_unbalanced() -> Setup:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1))
        g = torch.Generator().manual_seed(7)
        w = torch.randn(16, generator=g)

        def batch_at(i: int) -> Batch:
            gi = torch.Generator().manual_seed(7 * 100_003 + i)
            x = torch.randn(256, 16, generator=gi)
            # One in five is positive: above the 84th percentile of a standard normal.
            return x, ((x @ w) / w.norm() > 0.84).float()[:, None]

        return Setup(model, torch.optim.Adam(model.parameters(), lr=3e-3), nn.BCEWithLogitsLoss(), batch_at, 150)

    def h_contrastive() -> Setup:
        model = TwoTowers(16, 32, 8)
        g = torch.Generator().manual_seed(5)
        mix = torch.randn(16, 16, generator=g)

        def batch_at(i: int) -> Batch:
            gi = torch.Generator().manual_seed(5 * 100_003 + i)
            a = torch.randn(64, 16, generator=gi)
            b = a @ mix + 0.1 * torch.randn(64, 16, generator=gi)
            return torch.cat([a, b], 1), torch.arange(64)

        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), ClipLoss(), batch_at, 150)

    def h_long() -> Setup:
        model = ConvNet([3, 8, 16], 5, norm=True)
        return Setup(
            model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9), CE(), image_data(3, 12, 5, 32), 400
        )

    return [
        healthy("healthy_dropout", "MLP 2x ReLU + Dropout", "dropout 0.5 between layers", h_dropout),
        healthy("healthy_high_lr_clipped", "MLP 2x ReLU", "SGD at lr=1 with gradient clipping at 1.0", h_clipped),
        healthy(
            "healthy_long_converged_cnn",
            "CNN + BatchNorm",
            "400 steps, converged for most of them: a flat converged loss is not a plateau",
            h_long,
            0.9,
        ),
        healthy("healthy_mlp_adam", "MLP 2x ReLU", "a ReLU MLP with Adam", h_mlp),
        healthy(
            "healthy_binary_sigmoid_bce",
            "MLP 1x ReLU + Sigmoid output",
            "a binary classifier ending in a sigmoid under BCELoss, trained to confident outputs: its output sigmoid at its bounds is not a saturation",
            h_binary,
            0.5,
        ),
        healthy(
            "healthy_unbalanced_binary",
            "MLP 1x ReLU, BCEWithLogits",
            "a binary classifier whose targets are one in five positive: it learns past the entropy of that frequency (0.50), which is its chance level",
            h_unbalanced,
            0.5,
        ),
        healthy(
            "healthy_contrastive_clip",
            "two MLP towers, CLIP loss",
            "a contrastive (CLIP-style) loss: each sample's class index is its place in the batch and its logits are the similarities to the batch's other view, not the model's output units",
            h_contrastive,
        ),
        healthy("healthy_cnn_bn", "CNN + BatchNorm", "Conv-BN-ReLU with SGD+momentum", h_cnn),
        healthy("healthy_lstm", "LSTM", "an LSTM classifier with Adam", h_lstm, 0.1),
        healthy(
            "healthy_transformer_warmup", "Transformer", "a transformer with AdamW and lr warmup", h_transformer, 0.1
        ),
        healthy("healthy_resnet", "residual MLP + LayerNorm", "6 residual blocks with LayerNorm", h_resnet),
        healthy("healthy_tanh_xavier", "MLP 2x Tanh", "tanh with Xavier(5/3) init", h_tanh),
        healthy(
            "healthy_memorizes_one_batch",
            "MLP 1x ReLU",
            "fits one fixed batch to ~zero loss: vanishing gradients of a converged run are not a failure",
            h_converges,
            0.9,
        ),
        healthy(
            "healthy_accumulation",
            "residual MLP, grad accumulation x4",
            "gradient accumulation, 4 micro-batches",
            h_accumulate,
        ),
    ]


def all_scenarios() -> List[Scenario]:
    failures = [
        deep_sigmoid(),
        deep_tanh_depth(),
        dead_relu_bias(),
        relu_dies_adam(),
        lr_spike_explosion(),
        nan_batch(),
        ood_batch(),
        normalize_nan(),
        masked_attention_nan(),
        lr_too_low(),
        adam_divergence(),
        tiny_init(),
        huge_init(),
        cnn_dead_channels(),
        lstm_divergence(),
        accumulation_explosion(),
        tanh_saturated(),
        lstm_nan_input(),
        softmax_overflow(),
        unscaled_targets(),
        majority_class_only(),
        lstm_first_step_readout(),
        double_he_init(),
        unnormalized_pixels(),
        zero_batch(),
        warmup_too_high(),
    ]
    from .loop_mistakes import (
        functional_scenarios,
        healthy_loop_runs,
        loop_mistake_scenarios,
        through_time_scenarios,
    )

    return (
        failures
        + loop_mistake_scenarios()
        + through_time_scenarios()
        + functional_scenarios()
        + healthy_runs()
        + healthy_loop_runs()
    )
