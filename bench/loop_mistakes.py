"""Scenarios for the silent mistakes in a training loop: nothing raises, training just does not
learn. Each planted mistake is proved from the independent record (weights that never move,
layers that never get a gradient, a loss that stays flat or blows up) and, where the failure is
its consequence, by a counterfactual run with the mistake fixed that learns."""

from __future__ import annotations

import math
from typing import Callable, List

import torch
import torch.nn as nn

from .recorder import VANISHING, Record
from .scenarios import (
    LSTMClassifier,
    Scenario,
    Setup,
    Truth,
    expect,
    float_sequences,
    healthy_check,
    learns,
    mlp,
    teacher_data,
)

CE = nn.CrossEntropyLoss


def _mean(v: List[float]) -> float:
    return sum(v) / len(v)


def flat_loss(window: int = 50, tolerance: float = 0.02) -> Callable[[Record], None]:
    """The loss improved by less than ``tolerance`` over the last ``window`` steps, and stayed
    near its start."""

    def check(r: Record) -> None:
        before = _mean(r.loss[-window - 5 : -window])
        after = _mean(r.loss[-5:])
        assert (before - after) / before < tolerance, f"loss still falling: {before:.4f} -> {after:.4f}"
        start = _mean(r.loss[:5])
        assert after > 0.5 * start, f"loss fell far from its start: {start:.4f} -> {after:.4f}"

    return check


def learns_much_better(than: float) -> Callable[[Record], None]:
    """The counterfactual learns: finite throughout, and its final loss (mean of the last 5
    steps) below ``than`` x its first (mean of the first 5)."""

    def check(r: Record) -> None:
        assert all(r.all_finite(s) for s in range(r.steps)), "counterfactual went non-finite"
        start, end = _mean(r.loss[:5]), _mean(r.loss[-5:])
        assert end < than * start, f"counterfactual did not learn: {start:.3f} -> {end:.3f}"

    return check


def moved(r: Record, layer: str) -> bool:
    w = r.weight[layer]
    return any(abs(b - a) > 0.0 for a, b in zip(w, w[1:]))


def regression_data(
    dim: int, batch: int, scale: float = 1.0, shift: float = 0.0, seed: int = 5, column: bool = True
) -> Callable[[int], tuple]:
    """Targets from a fixed linear teacher: ``(N, 1)`` (``column``) or ``(N,)``."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, 1, generator=g) / math.sqrt(dim)

    def batch_at(i: int):
        gi = torch.Generator().manual_seed(seed * 100_003 + i)
        x = torch.randn(batch, dim, generator=gi)
        y = (x @ w) * scale + shift
        return x, (y if column else y[:, 0])

    return batch_at


# ============================================================================ mistakes


def never_zeroed() -> Scenario:
    truth = Truth("loss_divergence", "missing_zero_grad", None, None)

    def make(zero: bool) -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        return Setup(
            model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), teacher_data(16, 4, 64), 150, zero_grad=zero
        )

    def check(r: Record) -> None:
        best = min(r.loss)
        assert max(r.loss[r.loss.index(best) :]) > 10 * best, "the loss did not blow up after its best"
        # The gradient read before each step is the sum of every step's: it keeps growing.
        norms = r.grad["4"]
        assert norms[-1] > 20 * norms[0], "accumulated gradients grew"

    return Scenario(
        "mlp_sgd_grad_never_zeroed",
        "MLP 2x ReLU, SGD",
        "optimizer.zero_grad() missing: every step applies the sum of all gradients so far, so the "
        "steps grow until the loss blows up",
        lambda: make(False),
        truth,
        check,
        lambda: make(True),
        learns(0.3),
    )


def never_zeroed_lstm() -> Scenario:
    truth = Truth("loss_divergence", "missing_zero_grad", None, None)

    def make(zero: bool) -> Setup:
        model = LSTMClassifier(8, 32, 4)
        return Setup(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9),
            CE(),
            float_sequences(8, 20, 4, 32),
            150,
            zero_grad=zero,
        )

    def check(r: Record) -> None:
        best = min(r.loss)
        assert max(r.loss[r.loss.index(best) :]) > 5 * best, "the loss did not blow up after its best"

    return Scenario(
        "lstm_momentum_grad_never_zeroed",
        "LSTM, SGD+momentum",
        "an LSTM classifier whose loop never zeroes the gradients",
        lambda: make(False),
        truth,
        check,
        lambda: make(True),
        learns(0.1),
    )


def not_in_optimizer() -> Scenario:
    truth = Truth("stalled_layer", "parameters_not_updated", "0", 0)

    def build() -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        # The optimizer was built from the later layers only (e.g. a head-only optimizer left
        # over from fine-tuning).
        rest = [p for n, p in model.named_parameters() if not n.startswith("0.")]
        return Setup(model, torch.optim.Adam(rest, lr=1e-3), CE(), teacher_data(16, 4, 64), 120)

    def check(r: Record) -> None:
        assert not moved(r, "0"), "layer 0's weights changed"
        assert all(moved(r, n) for n in r.layer_names if n != "0"), "the other layers train"
        assert min(r.grad["0"]) > 1e-4, "layer 0 receives real gradients"
        expect(truth, "layer", next(n for n in r.layer_names if not moved(r, n)))

    return Scenario(
        "mlp_layer_not_in_optimizer",
        "MLP 2x ReLU, Adam",
        "the first layer receives gradients but the optimizer does not hold its parameters",
        build,
        truth,
        check,
    )


def zero_lr_group() -> Scenario:
    truth = Truth("stalled_layer", "parameters_not_updated", "lstm", 0)

    def build() -> Setup:
        model = LSTMClassifier(8, 32, 4)
        opt = torch.optim.Adam(
            [
                {"params": model.lstm.parameters(), "lr": 0.0},  # "frozen" by a schedule gone wrong
                {"params": model.head.parameters()},
            ],
            lr=3e-3,
        )
        return Setup(model, opt, CE(), float_sequences(8, 20, 4, 32), 120)

    def check(r: Record) -> None:
        assert not moved(r, "lstm") and moved(r, "head")
        assert min(r.grad["lstm"]) > 1e-5, "the LSTM receives real gradients"

    return Scenario(
        "lstm_param_group_lr_zero",
        "LSTM, Adam with 2 groups",
        "the LSTM's param group has lr 0: it gets gradients and never moves while the head trains",
        build,
        truth,
        check,
    )


class DetachedEncoder(nn.Module):
    """An encoder whose features are detached before the head (a custom module)."""

    def __init__(self) -> None:
        super().__init__()
        self.enc = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 64))
        self.head = nn.Sequential(nn.ReLU(), nn.Linear(64, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.enc(x).detach())


def detached_encoder() -> Scenario:
    truth = Truth("stalled_layer", "parameters_not_updated", "enc.2", 0)

    def build() -> Setup:
        model = DetachedEncoder()
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), teacher_data(16, 4, 64), 80)

    def check(r: Record) -> None:
        cut = [n for n in r.layer_names if all(math.isnan(g) for g in r.grad[n])]
        assert cut == ["enc.0", "enc.2"], f"layers without any gradient: {cut}"
        assert all(g > 0 for g in r.grad["head.1"]), "the head gets gradients"
        expect(truth, "layer", cut[-1])  # the one next to the cut

    return Scenario(
        "custom_encoder_detached",
        "custom encoder + head",
        "the encoder's output is .detach()ed before the head: the encoder never gets a gradient",
        build,
        truth,
        check,
    )


def softmax_into_cross_entropy() -> Scenario:
    truth = Truth("loss_plateau", "output_loss_mismatch", None, None)

    def make(softmax: bool) -> Setup:
        layers = [nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10)]
        model = nn.Sequential(*layers, *([nn.Softmax(dim=1)] if softmax else []))
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), teacher_data(16, 10, 64), 200)

    return Scenario(
        "mlp_softmax_into_cross_entropy",
        "MLP 1x ReLU + Softmax",
        "nn.Softmax before CrossEntropyLoss (which applies log-softmax itself): the loss is "
        "bounded away from zero and its gradient is tiny, so it barely moves",
        lambda: make(True),
        truth,
        flat_loss(),
        lambda: make(False),
        learns_much_better(0.6),
    )


def tanh_logits_into_cross_entropy() -> Scenario:
    truth = Truth("saturated_activations", "output_loss_mismatch", "3", None)

    def make(last: nn.Module) -> Setup:
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 10), last)
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-2), CE(), teacher_data(16, 10, 64), 200)

    def check(r: Record) -> None:
        # Logits in (-1, 1) over 10 classes: the right class gets at most e / (e + 9 / e) = 0.45,
        # so the cross-entropy cannot fall below -log(0.45) = 0.80 on any sample.
        floor = -math.log(math.e / (math.e + 9 / math.e))
        assert min(r.loss) > floor - 1e-3, f"loss {min(r.loss):.3f} below the floor {floor:.3f}"
        # Pushing the capped logits apart drives the tanh into its bounds.
        assert r.saturated["3"][-1] > 0.6, "the tanh on the logits ends saturated"

    return Scenario(
        "mlp_tanh_logits_into_cross_entropy",
        "MLP 1x ReLU + Tanh logits",
        "a tanh on the logits (a Keras Dense(10, activation='tanh') ported as is) before "
        "CrossEntropyLoss: the logits are capped to (-1, 1), so the loss has a floor of 0.80 and "
        "the tanh saturates trying to pass it",
        lambda: make(nn.Tanh()),
        truth,
        check,
        lambda: make(nn.Identity()),
        learns_much_better(0.25),
    )


class SigmoidClassifier(nn.Module):
    """A binary classifier whose forward ends in torch.sigmoid (functional, a custom module)."""

    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.body(x))[:, 0]


def sigmoid_into_logits_loss() -> Scenario:
    truth = Truth("loss_plateau", "output_loss_mismatch", None, None)
    teacher = teacher_data(16, 2, 64)

    def data(i: int):
        x, y = teacher(i)
        return x, y.float()

    def make(loss: nn.Module) -> Setup:
        model = SigmoidClassifier()
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-2), loss, data, 200)

    def check(r: Record) -> None:
        # BCE-with-logits of a sigmoid output: each sample's loss is at least
        # log(1 + exp(-sigmoid(z))) >= log(1 + e^-1) = 0.313.
        assert min(r.loss) > 0.31, f"loss went below its floor: {min(r.loss):.3f}"
        flat_loss()(r)

    return Scenario(
        "custom_sigmoid_into_bce_with_logits",
        "custom MLP + torch.sigmoid",
        "torch.sigmoid on the output, then BCEWithLogitsLoss (which applies sigmoid again): the "
        "outputs are confined to [0.5, 0.73] and the loss cannot go below 0.31",
        lambda: make(nn.BCEWithLogitsLoss()),
        truth,
        check,
        lambda: make(nn.BCELoss()),
        learns_much_better(0.5),
    )


def one_unit_softmax() -> Scenario:
    truth = Truth("vanishing_gradients", "output_loss_mismatch", None, 0)
    teacher = teacher_data(16, 2, 64)

    def data(i: int):
        x, y = teacher(i)
        return x, y.float()[:, None]

    def make(last: nn.Module) -> Setup:
        model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1), last)
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.1), nn.MSELoss(), data, 60)

    def check(r: Record) -> None:
        assert all(g == 0.0 for n in r.layer_names for g in r.grad[n]), "every gradient is exactly zero"
        expect(truth, "step", r.first_step(lambda s: r.any_layer(s, lambda v: v < VANISHING), 3))

    return Scenario(
        "mlp_one_unit_softmax",
        "MLP 1x ReLU + Softmax(1 unit)",
        "a softmax over a single output unit is the constant 1: every gradient is exactly zero",
        lambda: make(nn.Softmax(dim=1)),
        truth,
        check,
        lambda: make(nn.Sigmoid()),
        learns(0.2),
    )


def bounded_regression() -> Scenario:
    truth = Truth("saturated_activations", "output_loss_mismatch", "3", None)

    def make(last: nn.Module) -> Setup:
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1), last)
        # Targets around 20 (e.g. prices in thousands), regressed through a sigmoid.
        return Setup(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            nn.MSELoss(),
            regression_data(8, 64, scale=5.0, shift=20.0),
            200,
        )

    def check(r: Record) -> None:
        # A sigmoid output is below 1 and the targets are above 5: the error cannot fall below
        # (5 - 1)^2 = 16 on any sample; the sigmoid is driven into its upper bound.
        assert min(r.loss) > 16.0, f"loss {min(r.loss):.2f} below the bound's floor"
        assert r.saturated["3"][-1] > 0.9, "the output sigmoid ends saturated"

    return Scenario(
        "mlp_sigmoid_output_regression",
        "MLP 1x ReLU + Sigmoid output",
        "a sigmoid output regressing targets around 20: the output cannot exceed 1",
        lambda: make(nn.Sigmoid()),
        truth,
        check,
        lambda: make(nn.Identity()),
        learns_much_better(0.1),
    )


def broadcast_targets() -> Scenario:
    truth = Truth("loss_plateau", "target_shape_mismatch", None, None)

    def make(column: bool) -> Setup:
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 1))
        return Setup(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-2),
            nn.MSELoss(),
            regression_data(8, 64, column=column),
            200,
        )

    def check(r: Record) -> None:
        # Output (N, 1) against target (N,): the loss is the mean over all N x N pairs, at
        # best the targets' variance (~1 here), whatever the model predicts.
        assert min(r.loss) > 0.5, f"loss {min(r.loss):.3f} below the pairwise floor"
        flat_loss(tolerance=0.1)(r)

    return Scenario(
        "mlp_mse_broadcast_targets",
        "MLP 1x ReLU regression",
        "MSELoss on an (N, 1) output and an (N,) target broadcasts to (N, N): only the mean is learned",
        lambda: make(False),
        truth,
        check,
        lambda: make(True),
        learns_much_better(0.2),
    )


class PenalizedLoss(nn.Module):
    """``criterion(out, y) + l2 * sum(|W|^2)`` over the model's weight matrices, written into the
    loss the way a program adds an L2 penalty by hand."""

    def __init__(self, criterion: nn.Module, model: nn.Module, l2: float) -> None:
        super().__init__()
        self.criterion, self.l2 = criterion, l2
        self.weights = [p for p in model.parameters() if p.dim() >= 2]

    def forward(self, out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return self.criterion(out, y) + self.l2 * sum(w.pow(2).sum() for w in self.weights)


def penalty_in_the_loss() -> Scenario:
    truth = Truth("loss_plateau", "over_regularization", None, None)

    def make(l2: float) -> Setup:
        model = nn.Sequential(nn.Linear(8, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 1))
        return Setup(
            model,
            torch.optim.Adam(model.parameters(), lr=1e-3),
            PenalizedLoss(nn.MSELoss(), model, l2),
            regression_data(8, 64),
            200,
        )

    def check(r: Record) -> None:
        # The loss moves with the parameters' sum of squares (the record's norms hold the biases
        # too, which the penalty leaves out): a line through them fits it, its slope of the
        # order of the penalty's coefficient, and that line makes the penalty most of the first
        # loss.
        sq = [sum(r.weight[n][s] ** 2 for n in r.layer_names) for s in range(r.steps)]
        n = len(sq)
        ms, ml = sum(sq) / n, sum(r.loss) / n
        cov = sum((a - ms) * (b - ml) for a, b in zip(sq, r.loss))
        var_s = sum((a - ms) ** 2 for a in sq)
        var_l = sum((b - ml) ** 2 for b in r.loss)
        assert cov * cov / (var_s * var_l) > 0.99, "the loss does not follow the weights' squared norm"
        slope = cov / var_s
        assert 0.05 < slope < 0.2, f"slope {slope:.3f}, not of the order of the penalty's 0.1"
        assert slope * sq[0] > 0.5 * r.loss[0], "the penalty is not most of the first loss"

    return Scenario(
        "mlp_l2_penalty_in_the_loss",
        "MLP 2x ReLU regression, L2 0.1 in the loss",
        "an L2 penalty of 0.1 on the weights written into the loss: it is most of the loss, and the "
        "optimizer shrinks the weights instead of fitting the data",
        lambda: make(0.1),
        truth,
        check,
        lambda: make(1e-5),
        learns_much_better(0.1),
    )


def weight_decay_too_strong() -> Scenario:
    truth = Truth("vanishing_gradients", "over_regularization", None, None)

    def make(weight_decay: float) -> Setup:
        model = mlp([16, 64, 64, 10], nn.ReLU)
        opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, weight_decay=weight_decay)
        return Setup(model, opt, CE(), teacher_data(16, 10, 64), 200)

    def check(r: Record) -> None:
        # The hidden layers' weights collapse and the gradients with them; the loss sits at
        # ln 10 (the output layer keeps a bias: the class frequencies).
        for n in ("0", "2"):
            assert r.weight[n][-1] < 0.05 * r.weight[n][0], f"{n} kept its weights"
        assert r.grad["0"][-1] < VANISHING, f"gradient of 0 did not vanish: {r.grad['0'][-1]:.2e}"
        assert abs(_mean(r.loss[-20:]) - math.log(10)) < 0.05, "the loss is not at ln 10"

    return Scenario(
        "mlp_sgd_weight_decay_too_strong",
        "MLP 2x ReLU, SGD weight_decay 0.5",
        "SGD's weight_decay of 0.5 pulls the weights to zero far harder than the loss's gradient: "
        "they collapse, the gradients vanish and the model outputs a constant guess",
        lambda: make(0.5),
        truth,
        check,
        lambda: make(5e-4),
        learns_much_better(0.5),
    )


def deep_bn_eval() -> Scenario:
    truth = Truth("vanishing_gradients", "eval_mode", None, 15)

    def make(eval_mode: bool) -> Setup:
        layers: List[nn.Module] = [nn.Linear(16, 32)]
        for _ in range(12):
            layers += [nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 32)]
        layers += [nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4)]
        model = nn.Sequential(*layers)
        if eval_mode:
            model.eval()  # left over from an evaluation before training
        return Setup(model, torch.optim.SGD(model.parameters(), lr=0.05), CE(), teacher_data(16, 4, 64), 60)

    def check(r: Record) -> None:
        assert not any(r.training), "the model ran in eval mode"
        step = r.first_step(lambda s: r.any_layer(s, lambda v: v < VANISHING), 3)
        expect(truth, "step", step)

    def counter_check(r: Record) -> None:
        assert all(r.training), "the counterfactual trains in train mode"
        learns(0.1)(r)  # no layer vanishes, and the loss falls

    return Scenario(
        "deep_bn_mlp_trained_in_eval_mode",
        "MLP 13x BatchNorm+ReLU",
        "model.eval() before training: BatchNorm uses its initial running statistics and no "
        "longer normalizes, so the gradients of a deep stack vanish",
        lambda: make(True),
        truth,
        check,
        lambda: make(False),
        counter_check,
    )


# ============================================================================ healthy


def healthy_loop_runs() -> List[Scenario]:
    def h_eval_dropout() -> Setup:
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.3), nn.Linear(64, 4))
        model.eval()  # a mistake that does not make training fail: no alarm
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), CE(), teacher_data(16, 4, 64), 120)

    def h_log_softmax_nll() -> Setup:
        model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Linear(64, 4), nn.LogSoftmax(dim=1))
        return Setup(model, torch.optim.Adam(model.parameters(), lr=1e-3), nn.NLLLoss(), teacher_data(16, 4, 64), 120)

    def h_frozen_first_layer() -> Setup:
        model = mlp([16, 64, 64, 4], nn.ReLU)
        model[0].requires_grad_(False)  # frozen on purpose, the documented way
        params = [p for p in model.parameters() if p.requires_grad]
        return Setup(model, torch.optim.Adam(params, lr=1e-3), CE(), teacher_data(16, 4, 64), 120)

    def h_regression() -> Setup:
        model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 1), nn.Tanh())
        # Targets inside the tanh's range: a bounded output is fine.
        return Setup(
            model, torch.optim.Adam(model.parameters(), lr=1e-2), nn.MSELoss(), regression_data(8, 64, scale=0.3), 150
        )

    return [
        Scenario(
            "healthy_eval_mode_dropout_only",
            "MLP 1x ReLU + Dropout (eval mode)",
            "trained in eval mode, but its only mode-dependent layer is Dropout: it learns",
            h_eval_dropout,
            Truth(None),
            healthy_check(0.3),
        ),
        Scenario(
            "healthy_log_softmax_nll",
            "MLP 1x ReLU + LogSoftmax",
            "LogSoftmax with NLLLoss: the right pairing",
            h_log_softmax_nll,
            Truth(None),
            healthy_check(0.3),
        ),
        Scenario(
            "healthy_frozen_first_layer",
            "MLP 2x ReLU, first layer frozen",
            "a layer frozen with requires_grad_(False) is not a stalled layer",
            h_frozen_first_layer,
            Truth(None),
            healthy_check(0.3),
        ),
        Scenario(
            "healthy_tanh_output_regression",
            "MLP 1x Tanh + Tanh output",
            "a tanh output regressing targets within (-1, 1)",
            h_regression,
            Truth(None),
            healthy_check(0.3),
        ),
    ]


def loop_mistake_scenarios() -> List[Scenario]:
    return [
        never_zeroed(),
        never_zeroed_lstm(),
        not_in_optimizer(),
        zero_lr_group(),
        detached_encoder(),
        softmax_into_cross_entropy(),
        tanh_logits_into_cross_entropy(),
        sigmoid_into_logits_loss(),
        one_unit_softmax(),
        bounded_regression(),
        broadcast_targets(),
        deep_bn_eval(),
        penalty_in_the_loss(),
        weight_decay_too_strong(),
    ]


# ============================================================================ through time


class ReluRNN(nn.Module):
    """nn.RNN (ReLU) over a sequence, linear head on the last state."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.rnn = nn.RNN(8, 32, nonlinearity="relu", batch_first=True)
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            nn.init.orthogonal_(self.rnn.weight_hh_l0)
            self.rnn.weight_hh_l0.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(x)
        return self.head(out[:, -1])


class LoopRNN(nn.Module):
    """A hand-written recurrence: one Linear applied to the state at every time step."""

    def __init__(self, gain: float) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 32)
        self.rec = nn.Linear(32, 32, bias=False)
        self.head = nn.Linear(32, 1)
        with torch.no_grad():
            nn.init.orthogonal_(self.rec.weight)
            self.rec.weight.mul_(gain)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.new_zeros(x.shape[0], 32)
        for t in range(x.shape[1]):
            h = torch.relu(self.inp(x[:, t]) + self.rec(h))
        return self.head(h)


def sequence_regression(length: int, batch: int = 16, seed: int = 6) -> Callable[[int], tuple]:
    """Standard-normal sequences; the target is the mean of the first feature."""

    def batch_at(i: int):
        gi = torch.Generator().manual_seed(seed * 100_003 + i)
        x = torch.randn(batch, length, 8, generator=gi)
        return x, x[:, :, :1].mean(dim=1)

    return batch_at


def amplified_through_time(name: str, arch: str, model: Callable[[float], nn.Module], root: str) -> Scenario:
    truth = Truth("exploding_gradients", "poor_initialization", root, 0)

    def make(gain: float) -> Setup:
        m = model(gain)
        return Setup(m, torch.optim.SGD(m.parameters(), lr=0.01), nn.MSELoss(), sequence_regression(40), 30)

    def check(r: Record) -> None:
        expect(truth, "step", r.first_step(lambda s: r.any_layer(s, lambda v: v > 1e3), 1))
        inputs = r.input_scale[0]
        assert inputs < 10, "the inputs are ordinary standard-normal values"
        # The forward signal is amplified inside the recurrent layer, not before or after it.
        assert r.out_scale[root] > 100 * inputs, f"{root} amplifies: {r.out_scale[root]:.3g} from {inputs:.3g}"
        assert r.out_scale["head"] < 10 * r.out_scale[root], "the head does not amplify further"

    def counter_check(r: Record) -> None:
        assert r.first_step(lambda s: r.any_layer(s, lambda v: v > 1e3), 1) is None, "gain 1: no explosion"

    return Scenario(
        name,
        arch,
        "recurrent weights 2x orthogonal, 40 time steps of standard-normal inputs: the state is "
        "amplified at every step and the gradients explode from step 0, though each weight matrix "
        "is only twice the usual scale",
        lambda: make(2.0),
        truth,
        check,
        lambda: make(1.0),
        counter_check,
    )


def through_time_scenarios() -> List[Scenario]:
    return [
        amplified_through_time("rnn_relu_amplified_through_time", "nn.RNN (ReLU) + Linear", ReluRNN, "rnn"),
        amplified_through_time("custom_loop_rnn_amplified_through_time", "hand-written recurrence", LoopRNN, "rec"),
    ]


# ============================================================================ functional activations


class FunctionalMLP(nn.Module):
    """ReLUs written inline (F.relu), no activation modules; fc2's bias pushes it far below 0."""

    def __init__(self, bias: float) -> None:
        super().__init__()
        self.fc1 = nn.Linear(16, 64)
        self.fc2 = nn.Linear(64, 64)
        self.fc3 = nn.Linear(64, 4)
        with torch.no_grad():
            self.fc2.bias.fill_(bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.fc2(torch.relu(self.fc1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc3(self.hidden(x))


class FunctionalCNN(nn.Module):
    """Conv -> F.relu -> Conv -> F.relu -> pool -> Linear; conv2's bias switches it off."""

    def __init__(self, bias: float) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, padding=1)
        self.conv2 = nn.Conv2d(8, 16, 3, padding=1)
        self.conv3 = nn.Conv2d(16, 16, 3, padding=1)
        self.head = nn.Linear(16, 5)
        with torch.no_grad():
            self.conv2.bias.fill_(bias)

    def hidden(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.conv2(torch.relu(self.conv1(x))))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.conv3(self.hidden(x))).mean(dim=(2, 3)))


def functional_dead(name: str, arch: str, model: Callable[[float], nn.Module], data, layer: str) -> Scenario:
    truth = Truth("dead_neurons", "dying_relu", layer, 0)

    def make(bias: float) -> Setup:
        m = model(bias)
        return Setup(m, torch.optim.SGD(m.parameters(), lr=0.05), CE(), data, 60)

    def check(r: Record) -> None:
        # Rebuilt exactly as the run built it: every unit after `layer` is zero for the first
        # batch, by direct computation.
        torch.manual_seed(0)
        m = model(-10.0)
        x, _ = data(0)
        with torch.no_grad():
            assert (m.hidden(x) == 0).all(), "every unit of the layer is zero for the whole batch"
        assert all(g == 0.0 for g in r.grad[layer]), "no gradient passes the dead units"

    def counter_check(r: Record) -> None:
        assert all(g > 0.0 for g in r.grad[layer]), "with a zero bias the layer gets gradients"

    return Scenario(
        name,
        arch,
        "ReLUs applied inline with torch.relu (no module to observe) after a layer whose bias is "
        "-10: every unit is dead for every sample from step 0",
        lambda: make(-10.0),
        truth,
        check,
        lambda: make(0.0),
        counter_check,
    )


def functional_scenarios() -> List[Scenario]:
    from .scenarios import image_data

    return [
        functional_dead(
            "custom_functional_relu_mlp_dead",
            "custom MLP, inline torch.relu",
            FunctionalMLP,
            teacher_data(16, 4, 64),
            "fc2",
        ),
        functional_dead(
            "custom_functional_relu_cnn_dead",
            "custom CNN, inline torch.relu",
            FunctionalCNN,
            image_data(3, 8, 5, 16),
            "conv2",
        ),
    ]
