"""Ports of the training bugs in `ForeverZyh/TensorFlow-Program-Bugs` (Zhang et al., "An
Empirical Study on TensorFlow Program Bugs", ISSTA 2018): `StackOverflow/IPS-<n>/<question>-{buggy,fix}/`.
IPS is the study's root-cause class "incorrect model parameter or structure"; the fix directory
is the accepted answer's change, which is our healthy control.

Also two of TheDeepChecker's GitHub examples (`GH_buggy_examples/TFE_<commit>`): bugs of
`aymericdamien/TensorFlow-Examples` whose fixing commit is named (742675d, bc09f95); the buggy
program is that commit's parent, the fixed one the commit.

The originals are TF 1.x scripts over raw `tf.Variable`s and `tf.nn` ops: the ports keep that
style (parameters in a small module, functional activations), the same initializers, losses,
optimizers, learning rates, batch sizes and iteration counts, except where noted (`steps`).
"""

from __future__ import annotations

from typing import Callable, List, Optional

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .common import (
    TPB_COMMIT,
    TPB_REPO,
    Program,
    Run,
    accuracy_onehot,
    cycling_batches,
    digits_as_mnist,
    onehot,
    random_normal,
    truncated_normal,
)


def src(ips: str, question: str, kind: str, file: str) -> str:
    return f"{TPB_REPO}@{TPB_COMMIT[:10]}:StackOverflow/{ips}/{question}-{kind}/{file}"


TFE_REPO = "aymericdamien/TensorFlow-Examples"


def mnist_flat() -> tuple:
    """`input_data.read_data_sets(one_hot=True)`: 784 floats in [0, 1], one-hot labels."""
    x, y = digits_as_mnist()
    return x.reshape(len(x), 784) / 255.0, onehot(y, 10)


MNIST_DATA = (
    "MNIST (input_data, pixels in [0, 1]) -> scikit-learn's bundled digits resized to 28x28, "
    "same scale (common.digits_as_mnist / 255)"
)


def param(*shape: int, init: Callable[[torch.Tensor], None]) -> nn.Parameter:
    p = nn.Parameter(torch.empty(*shape))
    init(p.data)
    return p


def const(v: float) -> Callable[[torch.Tensor], None]:
    return lambda t: nn.init.constant_(t, v)


# ============================================================================ IPS-14: softmax regression


class SoftmaxRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.zeros(784, 10))
        self.b = nn.Parameter(torch.zeros(10))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x @ self.W + self.b, dim=1)


def ips14(buggy: bool, steps: Optional[int]) -> Run:
    x, y = mnist_flat()
    model = SoftmaxRegression()
    return Run(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01 if buggy else 0.005),
        lambda p, t: -(t * torch.log(p)).sum(),  # -reduce_sum(y_ * log(y)): summed over the batch
        cycling_batches(x, y, 205, seed=14),
        steps or 1000,
        accuracy=accuracy_onehot,
    )


# ============================================================================ IPS-15: linear regression


class LinearRow(nn.Module):
    """`Yhat = matmul(W, X)` with W = ones([1, 2]) and X = [x; 1] of shape [2, T]."""

    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.ones(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.W @ x


def ips15(buggy: bool, steps: Optional[int]) -> Run:
    T = 100
    g = np.random.default_rng(20180130)
    noise = 10 * g.random(T)
    x = np.stack([np.arange(T), np.ones(T)]).astype(np.float32)
    yv = (np.array([[2.0, 4.0]]) @ x + noise).astype(np.float32)
    xt, yt = torch.tensor(x), torch.tensor(yv)
    model = LinearRow()
    return Run(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5 if buggy else 0.0005),
        lambda out, t: (1.0 / (2 * T)) * (t - out).pow(2).sum(),
        lambda i: (xt, yt),
        steps or 100,
    )


# ============================================================================ IPS-17: quadratic fit


class Quadratic(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.A = nn.Parameter(torch.zeros(1))
        self.B = nn.Parameter(torch.zeros(1))
        self.C = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.A * x**2 + self.B * x + self.C


def ips17(buggy: bool, steps: Optional[int]) -> Run:
    x = torch.tensor([0.0, 1.0, 2.0, 3.0])
    y = torch.tensor([0.0, 1.0, 4.0, 9.0])
    model = Quadratic()
    return Run(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01 if buggy else 0.001),
        lambda out, t: (out - t).pow(2).sum(),
        lambda i: (x, y),
        steps or 100,
    )


# ============================================================================ IPS-5: simple regression


class ScalarLine(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.W = nn.Parameter(torch.zeros(1))
        self.B = nn.Parameter(torch.zeros(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.W + self.B


def ips5(buggy: bool, steps: Optional[int]) -> Run:
    g = np.random.default_rng(20180130)
    w, b = g.uniform(-8, 8), g.uniform(-8, 8)
    xs = g.uniform(-8, 8, 8)
    ys = w * xs + b + g.uniform(-1, 1, 8)
    xt, yt = torch.tensor(xs, dtype=torch.float32), torch.tensor(ys, dtype=torch.float32)
    model = ScalarLine()
    opt = (
        torch.optim.SGD(model.parameters(), lr=0.1) if buggy else torch.optim.Adam(model.parameters(), lr=0.1, eps=1e-8)
    )
    return Run(model, opt, lambda out, t: (out - t).pow(2).mean(), lambda i: (xt, yt), steps or 100)


# ============================================================================ IPS-7: MLP with a hand-written sigmoid CE


class SigmoidMLP(nn.Module):
    """784 -> 512 sigmoid -> 10, no biases, weights N(0, 1); the fix puts a sigmoid on the output."""

    def __init__(self, output_sigmoid: bool) -> None:
        super().__init__()
        self.W_h1 = param(784, 512, init=random_normal(1.0))
        self.W_out = param(512, 10, init=random_normal(1.0))
        self.output_sigmoid = output_sigmoid

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.sigmoid(x @ self.W_h1) @ self.W_out
        return torch.sigmoid(y) if self.output_sigmoid else y


def ips7(buggy: bool, steps: Optional[int]) -> Run:
    x, y = mnist_flat()
    model = SigmoidMLP(output_sigmoid=not buggy)

    def loss(out: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        if buggy:  # reduce_sum(-y log(y_) - (1 - y) log(1 - y_), 1) on the raw linear output
            ce = (-t * torch.log(out) - (1 - t) * torch.log(1 - out)).sum(1)
        else:
            ce = (-t * torch.log(out.clamp(1e-10, 1.0)) - (1 - t) * torch.log((1 - out).clamp(1e-10, 1.0))).sum(1)
        return ce.mean()

    return Run(
        model,
        torch.optim.SGD(model.parameters(), lr=0.05 if buggy else 0.5),
        loss,
        cycling_batches(x, y, 100, seed=7),
        steps or 300,
        accuracy=accuracy_onehot,
    )


# ============================================================================ IPS-10: float16 Adam epsilon


class HalfConv(nn.Module):
    """`slim.conv2d(inpt, 16, [3, 3], weights_initializer=zeros)` in float16: ReLU (slim's
    default activation), zero bias."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 16, 3, padding=1).half()
        nn.init.zeros_(self.conv.weight)
        nn.init.zeros_(self.conv.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.relu(self.conv(x))


def ips10(buggy: bool, steps: Optional[int]) -> Run:
    x = torch.zeros(4, 3, 16, 16, dtype=torch.float16)
    model = HalfConv()
    return Run(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8 if buggy else 1e-4),
        lambda out, t: out.mean(),
        lambda i: (x, x),
        steps or 2,
    )


# ============================================================================ IPS-13: logistic regression on raw features


def heart_like(n: int, seed: int) -> tuple:
    """The South-African heart disease table's schema (9 raw features, `famhist` Present/Absent
    as 1/0, label chd), generated: each feature drawn at the original's scale (sbp ~138 mmHg,
    tobacco 0..30 kg, ldl ~4.7, adiposity ~25, typea ~53, obesity ~26, alcohol 0..150, age
    15..64); chd from a logistic model of age, tobacco, ldl, famhist and typea. The bug depends
    on the raw, unnormalised scale of these columns, which is kept."""
    g = np.random.default_rng(seed)
    age = g.uniform(15, 64, n)
    x = np.stack(
        [
            g.normal(138, 20, n),
            np.clip(g.exponential(3.6, n), 0, 31),
            np.clip(g.normal(4.7, 2.1, n), 1, 15),
            np.clip(g.normal(25, 7.8, n), 6, 43),
            (g.random(n) < 0.42).astype(float),
            g.normal(53, 10, n),
            np.clip(g.normal(26, 4.2, n), 15, 47),
            np.clip(g.exponential(17, n), 0, 147),
            age,
        ],
        axis=1,
    )
    z = -6.2 + 0.045 * age + 0.08 * x[:, 1] + 0.17 * x[:, 2] + 0.9 * x[:, 4] + 0.035 * x[:, 5]
    chd = (g.random(n) < 1 / (1 + np.exp(-z))).astype(np.int64)
    return x.astype(np.float32), np.stack([1 - chd, chd], 1).astype(np.float32)


class LogisticRegression(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.w = param(9, 2, init=truncated_normal(1.0))
        self.b = nn.Parameter(torch.zeros(1, 2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w + self.b


def ips13(buggy: bool, steps: Optional[int]) -> Run:
    x, y = heart_like(413, seed=13)  # heart_train.csv: 413 rows
    model = LogisticRegression()
    beta = 1.0 if buggy else 0.1

    def loss(score: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        entropy = -(t * torch.log_softmax(score, 1)).sum(1)
        return (entropy + beta * model.w.pow(2).sum() / 2).mean()  # tf.nn.l2_loss = sum(w^2) / 2

    return Run(
        model,
        torch.optim.SGD(model.parameters(), lr=0.5 if buggy else 0.01),
        loss,
        cycling_batches(x, y, 7, seed=13),
        steps or 300,
        accuracy=accuracy_onehot,
    )


# ============================================================================ IPS-11: the deep MNIST CNN


class MnistCNN(nn.Module):
    """The TF tutorial's deep MNIST network: conv5x5(32) -> pool -> conv5x5(64) -> pool ->
    fc(1024) -> fc(10), weights truncated-normal 0.1, biases 0.1, ReLU written inline."""

    def __init__(self, relu_on_logits: bool = False) -> None:
        super().__init__()
        tn = truncated_normal(0.1)
        self.W_conv1, self.b_conv1 = param(32, 1, 5, 5, init=tn), param(32, init=const(0.1))
        self.W_conv2, self.b_conv2 = param(64, 32, 5, 5, init=tn), param(64, init=const(0.1))
        self.W_fc1, self.b_fc1 = param(7 * 7 * 64, 1024, init=tn), param(1024, init=const(0.1))
        self.W_fc2, self.b_fc2 = param(1024, 10, init=tn), param(10, init=const(0.1))
        self.relu_on_logits = relu_on_logits

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.reshape(-1, 1, 28, 28)
        h = F.max_pool2d(F.relu(F.conv2d(h, self.W_conv1, self.b_conv1, padding=2)), 2)
        h = F.max_pool2d(F.relu(F.conv2d(h, self.W_conv2, self.b_conv2, padding=2)), 2)
        h = F.relu(h.flatten(1) @ self.W_fc1 + self.b_fc1)
        logits = h @ self.W_fc2 + self.b_fc2
        return F.relu(logits) if self.relu_on_logits else logits


def ips11(buggy: bool, steps: Optional[int]) -> Run:
    x, y = mnist_flat()
    model = MnistCNN(relu_on_logits=buggy)
    return Run(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-3, eps=1e-8),
        lambda logits, t: -(t * torch.log_softmax(logits, 1)).sum(1).mean(),
        cycling_batches(x, y, 100, seed=11),
        steps or 100,
        accuracy=accuracy_onehot,
    )


# ============================================================================ UT-15: (N,) targets against (N, 1) outputs


class Fit2(nn.Module):
    """`y = matmul(x, w)`, w [2, 1] truncated-normal 0.1, float64 like the original."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.empty(2, 1, dtype=torch.float64))
        truncated_normal(0.1)(self.w.data)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.w


def ut15(buggy: bool, steps: Optional[int]) -> Run:
    x = torch.tensor([[1.0, 1.0], [1.0, 2.0], [1.0, 3.0]], dtype=torch.float64)
    y = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    target = y if buggy else y.unsqueeze(1)  # the fix: y_ = tf.expand_dims(y_, axis=1)
    model = Fit2()
    return Run(
        model,
        torch.optim.Adam(model.parameters(), lr=1e-4, eps=1e-8),
        lambda out, t: (t - out).pow(2).mean(),  # reduce_mean(square(y_ - y)): (3,) - (3, 1) is (3, 3)
        lambda i: (x, target),
        # The original runs 50000 iterations; by 20000 both versions have settled: the buggy
        # one at 0.676 (its floor is 2/3, the variance of y_: it learns the mean), the fix at 5e-5.
        steps or 20000,
    )


# ============================================================================ TensorFlow-Examples: losses summed over the batch


def tfe742675d(buggy: bool, steps: Optional[int]) -> Run:
    """examples/2 - Basic Classifiers/logistic_regression.py: softmax regression, zero weights,
    SGD 0.01, batch 100; `-reduce_sum(y * log(softmax))` (summed over the batch) until the fix
    `reduce_mean(-reduce_sum(y * log(softmax), 1))`."""
    x, y = mnist_flat()
    model = SoftmaxRegression()

    def loss(p: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        per_example = -(t * torch.log(p)).sum(1)
        return per_example.sum() if buggy else per_example.mean()

    return Run(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss,
        cycling_batches(x, y, 100, seed=742),
        steps or 300,
        accuracy=accuracy_onehot,
    )


class RawMLP(nn.Module):
    """examples/4_Utils/tensorboard_advanced.py: 784-256-256-10, ReLU inline, every weight and
    bias `tf.random_normal` (stddev 1)."""

    def __init__(self) -> None:
        super().__init__()
        n = random_normal(1.0)
        self.w1, self.b1 = param(784, 256, init=n), param(256, init=n)
        self.w2, self.b2 = param(256, 256, init=n), param(256, init=n)
        self.w3, self.b3 = param(256, 10, init=n), param(10, init=n)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = F.relu(x @ self.w1 + self.b1)
        h = F.relu(h @ self.w2 + self.b2)
        return h @ self.w3 + self.b3


def tfebc09f95(buggy: bool, steps: Optional[int]) -> Run:
    """SGD 0.01, batch 100, `reduce_sum(softmax_cross_entropy_with_logits)` until the fix
    `reduce_mean(...)`."""
    x, y = mnist_flat()
    model = RawMLP()

    def loss(logits: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        per_example = -(t * torch.log_softmax(logits, 1)).sum(1)
        return per_example.sum() if buggy else per_example.mean()

    return Run(
        model,
        torch.optim.SGD(model.parameters(), lr=0.01),
        loss,
        cycling_batches(x, y, 100, seed=95),
        steps or 300,
        accuracy=accuracy_onehot,
    )


# ============================================================================ the programs


def programs() -> List[Program]:
    return [
        Program(
            "tpb/IPS-14_mnist_softmax_nan",
            src("IPS-14", "33641799", "buggy", "mnist.py"),
            src("IPS-14", "33641799", "fix", "mnist.py"),
            "IPS: learning rate too high for a cross-entropy summed over 205 examples (NaN)",
            "learning_rate_too_high",
            "SGD lr 0.01 -> 0.005",
            MNIST_DATA,
            ips14,
            also=("numerical_instability",),
            arch="softmax regression 784-10",
        ),
        Program(
            "tpb/IPS-15_linreg_diverges",
            src("IPS-15", "43636736", "buggy", "linear_regression.py"),
            src("IPS-15", "43636736", "fix", "linear_regression.py"),
            "IPS: learning rate too high on unnormalised x in [0, 99]",
            "learning_rate_too_high",
            "SGD lr 0.5 -> 0.0005",
            "generated in the program itself (x = 0..99, y = 2x + 4 + 10 U(0,1)), regenerated here",
            ips15,
            also=("bad_input_data",),
            arch="linear 2 -> 1",
        ),
        Program(
            "tpb/IPS-17_quadratic_diverges",
            src("IPS-17", "46577203", "buggy", "linear_regression.py"),
            src("IPS-17", "46577203", "fix", "linear_regression.py"),
            "IPS: learning rate too high for a summed squared error",
            "learning_rate_too_high",
            "SGD lr 0.01 -> 0.001",
            "inline in the program (x = 0..3, y = x^2)",
            ips17,
            arch="A x^2 + B x + C",
        ),
        Program(
            "tpb/IPS-5_line_sgd_diverges",
            src("IPS-5", "39939881", "buggy", "simple_regression.py"),
            src("IPS-5", "39939881", "fix", "simple_regression.py"),
            "IPS: plain SGD at lr 0.1 diverges on x in [-8, 8]",
            "learning_rate_too_high",
            "GradientDescentOptimizer(0.1) -> AdamOptimizer(0.1)",
            "generated in the program itself (8 points on a random line), regenerated here",
            ips5,
            arch="w x + b",
        ),
        Program(
            "tpb/IPS-7_mlp_missing_sigmoid",
            src("IPS-7", "35078027", "buggy", "MLP.py"),
            src("IPS-7", "35078027", "fix", "MLP.py"),
            "IPS: binary cross-entropy written on a linear output (no sigmoid): log of negatives",
            "output_loss_mismatch",
            "sigmoid on the output, clipped logs, SGD lr 0.05 -> 0.5",
            MNIST_DATA,
            ips7,
            also=("numerical_instability",),
            arch="MLP 784-512(sigmoid)-10",
        ),
        Program(
            "tpb/IPS-10_fp16_adam_eps",
            src("IPS-10", "42064941", "buggy", "float16_broken.py"),
            src("IPS-10", "42064941", "fix", "float16_broken.py"),
            "IPS: Adam epsilon 1e-8 underflows to 0 in float16 (0/0 = NaN)",
            "numerical_instability",
            "AdamOptimizer(1e-3) -> AdamOptimizer(1e-3, epsilon=1e-4)",
            "inline in the program (zeros)",
            ips10,
            arch="conv3x3 float16",
        ),
        Program(
            "tpb/IPS-13_logreg_heart",
            src("IPS-13", "45002504", "buggy", "q2_linear_logistic_regression.py"),
            src("IPS-13", "45002504", "fix", "q2_linear_logistic_regression.py"),
            "IPS: learning rate 0.5 (and l2 weight 1) on raw clinical features",
            "learning_rate_too_high",
            "SGD lr 0.5 -> 0.01, l2 weight 1 -> 0.1",
            "heart_train.csv -> generated rows of the same schema and raw scale (heart_like)",
            ips13,
            also=("bad_input_data",),
            arch="logistic regression 9-2",
        ),
        Program(
            "tpb/IPS-11_relu_on_logits",
            src("IPS-11", "43239467", "buggy", "mnist.py"),
            src("IPS-11", "43239467", "fix", "mnist.py"),
            "IPS: ReLU applied to the output logits",
            "output_loss_mismatch",
            "no activation on the last layer (fc_layer(..., activation=None))",
            MNIST_DATA,
            ips11,
            also=("dying_relu",),
            arch="CNN 2 conv + 2 fc (functional ReLU)",
        ),
        Program(
            "tpb/UT-15_target_broadcast",
            src("UT-15", "38447935", "buggy", "fitting.py"),
            src("UT-15", "38447935", "fix", "fitting.py"),
            "UT (unaligned tensors): targets of shape (3,) minus outputs (3, 1) broadcast to (3, 3)",
            "target_shape_mismatch",
            "y_ = tf.expand_dims(y_, axis=1)",
            "inline in the program (3 points)",
            ut15,
            arch="linear 2 -> 1, float64",
        ),
        Program(
            "tfe/742675d_logreg_sum_loss",
            f"{TFE_REPO}@844bbfce6d:examples/2 - Basic Classifiers/logistic_regression.py",
            f"{TFE_REPO}@742675db9e:examples/2 - Basic Classifiers/logistic_regression.py",
            "TheDeepChecker GH example: cross-entropy summed over the batch (NaN), 'fix #10'",
            "learning_rate_too_high",
            "reduce_mean over the batch instead of reduce_sum",
            MNIST_DATA,
            tfe742675d,
            also=("numerical_instability",),
            arch="softmax regression 784-10",
        ),
        Program(
            "tfe/bc09f95_mlp_sum_loss",
            f"{TFE_REPO}@534b4febcd:examples/4_Utils/tensorboard_advanced.py",
            f"{TFE_REPO}@bc09f959c0:examples/4_Utils/tensorboard_advanced.py",
            "TheDeepChecker GH example: 'reduce mean instead of sum' of the softmax cross-entropy",
            "learning_rate_too_high",
            "reduce_mean over the batch instead of reduce_sum",
            MNIST_DATA,
            tfebc09f95,
            also=("numerical_instability",),
            arch="MLP 784-256-256-10, N(0,1) init",
        ),
    ]
