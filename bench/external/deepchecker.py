"""Ports of TheDeepChecker's buggy synthetic programs (Ben Braiek & Khomh, "Testing Feedforward
Neural Networks Training Programs", TOSEM 2022): `buggy_synthetic_programs/<fault>/*.py`, each a
copy of one of three clean TF1 programs (`clean_base_programs/{baseCNN,regrNN,deepCNN}.py`) with
one planted fault.

How the originals train, and so how the ports train: TheDeepChecker's `run_full_checks` fits
one fixed, stratified batch (`overfit_batch`: 50 images, 5 per class, for the CNNs; 8 rows for
regrNN) for `overfit_iters` = 200 iterations, from data its `DataLoaderFromArrays` min-max
normalises (over the whole array for images, per column for tabular data; regression targets
too, to [0, 1]). That overfitting phase is where its checks flag the faults.

The fixed version of each program is the clean base program, keeping the buggy file's incidental
edits that are not the fault (several buggy files widen the dense layer to 1024 units, use
he-uniform kernels and 64 filters in the deepCNN's last block, or l2 = 1e-6), so that a pair
differs only in the labelled fault.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Callable, List, Optional

import numpy as np
import torch
import torch.nn as nn

from .common import (
    TDC_COMMIT,
    TDC_REPO,
    Program,
    Run,
    Softmax2d,
    accuracy_onehot,
    auto_mpg,
    constant,
    digits_as_cifar,
    digits_as_mnist,
    fixed_batch,
    flip_gradients,
    glorot_uniform,
    he_normal_tf1,
    he_uniform,
    l2_penalty,
    minmax,
    onehot,
    random_normal,
    stratified_sample,
    tf_batchnorm1d,
    tf_batchnorm2d,
    tf_layer,
)

OVERFIT_ITERS = 200
# The deepCNN (6 conv layers at 32x32) costs ~0.25 s a step on one CPU thread: its ports train
# 60 of the 200 overfit iterations so that the whole suite stays within minutes.
DEEP_STEPS = 60
EPS_CLIP = 1e-32  # the programs' own `tf.clip_by_value(p, 1e-32, 1 - 1e-32)`


def src(path: str) -> str:
    return f"{TDC_REPO}@{TDC_COMMIT[:10]}:{path}"


# ============================================================================ shared pieces


def init_for(kind: str, std: float = 0.0) -> Callable[[torch.Tensor], None]:
    return {
        "he_normal": he_normal_tf1,
        "he_uniform": he_uniform,
        "glorot": glorot_uniform,
        "constant": constant(0.01),
        "random": random_normal(std),
    }[kind]


def make_optimizer(params, kind: str, lr: float, eps: float = 1e-8) -> torch.optim.Optimizer:
    if kind == "sgd":
        return torch.optim.SGD(params, lr=lr)
    if kind == "momentum":
        return torch.optim.SGD(params, lr=lr, momentum=0.9)
    return torch.optim.Adam(params, lr=lr, eps=eps)


def clipped_log(p: torch.Tensor) -> torch.Tensor:
    return torch.log(p.clamp(EPS_CLIP, 1 - EPS_CLIP))


def classification_loss(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """The loss on the logits for each variant the programs write (labels are one-hot)."""

    def softmax_ce(logits, y):  # tf.losses.softmax_cross_entropy(labels, logits)
        return -(y * torch.log_softmax(logits, 1)).sum(1).mean()

    def redundant_softmax(logits, y):  # softmax_cross_entropy_with_logits(logits=softmax(logits))
        return softmax_ce(torch.softmax(logits, 1), y)

    def missing_softmax(logits, y):  # hand-written CE on the logits, no softmax
        return (-(y * clipped_log(logits)).sum(1)).mean()

    def sum_of_class_means(logits, y):  # reduce_sum over the batch of reduce_mean over classes
        return (-(y * clipped_log(torch.softmax(logits, 1))).mean(1)).sum()

    def batch_sum_axis0(logits, y):  # -reduce_sum(.., axis=0) (over the batch), then reduce_mean
        return (-(y * clipped_log(torch.softmax(logits, 1))).sum(0)).mean()

    def softmax_over_batch(logits, y):  # softmax reduced over axis 0, the batch
        return (-(y * clipped_log(torch.softmax(logits, 0))).sum(1)).mean()

    def mse_on_probabilities(logits, y):  # tf.losses.mean_squared_error(labels, probabilities)
        return (torch.softmax(logits, 1) - y).pow(2).mean()

    return {
        "ce": softmax_ce,
        "redundant_softmax": redundant_softmax,
        "missing_softmax": missing_softmax,
        "sum_of_class_means": sum_of_class_means,
        "batch_sum_axis0": batch_sum_axis0,
        "softmax_over_batch": softmax_over_batch,
        "mse": mse_on_probabilities,
    }[kind]


def image_batch(x: np.ndarray, y: np.ndarray, scaling: str, seed: int) -> Callable:
    """TheDeepChecker's loader on images: homogeneous min-max ('norm'), none ('raw'), or the
    planted double division by the range ('double'); then the stratified overfit batch."""
    x = x.astype(np.float32)
    if scaling != "raw":
        mi, rng = minmax(x, None)
        x = (x - mi) / rng
        if scaling == "double":
            x = x / rng
    idx = stratified_sample(y, 5, seed)
    return fixed_batch(x[idx], onehot(y[idx], 10))


# ============================================================================ baseCNN (MNIST)


@dataclass(frozen=True)
class BaseCNNConfig:
    units: int = 512
    optimizer: str = "sgd"
    lr: float = 0.1
    eps: float = 1e-8
    init: str = "he_normal"  # conv1, conv2, dense; the output layer keeps glorot-uniform
    init_std: float = 0.0
    out_init: str = "glorot"
    conv1_act: str = "relu"
    loss: str = "ce"
    scaling: str = "norm"
    l2: float = 1e-5
    flip: bool = False


class BaseCNN(nn.Module):
    """clean_base_programs/baseCNN.py: conv5x5(32)-relu-pool, conv3x3(64)-relu-pool, dense-relu, dense(10)."""

    def __init__(self, c: BaseCNNConfig):
        super().__init__()
        k = init_for(c.init, c.init_std)
        self.conv1 = tf_layer(nn.Conv2d(1, 32, 5, padding=2), k)
        self.act1 = Softmax2d() if c.conv1_act == "softmax" else nn.ReLU()
        self.conv2 = tf_layer(nn.Conv2d(32, 64, 3, padding=1), k)
        self.act2 = nn.ReLU()
        self.pool = nn.MaxPool2d(2, 2)
        self.dense = tf_layer(nn.Linear(7 * 7 * 64, c.units), k)
        self.act3 = nn.ReLU()
        self.outputs = tf_layer(nn.Linear(c.units, 10), init_for(c.out_init, c.init_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.reshape(-1, 1, 28, 28)
        x = self.pool(self.act1(self.conv1(x)))
        x = self.pool(self.act2(self.conv2(x)))
        x = self.act3(self.dense(x.flatten(1)))
        return self.outputs(x)


def base_cnn(c: BaseCNNConfig) -> Callable[[bool, Optional[int]], Run]:
    def build(_: bool, steps: Optional[int]) -> Run:
        x, y = digits_as_mnist()
        model = BaseCNN(c)
        kernels: List[nn.Module] = [model.conv1, model.conv2, model.dense, model.outputs]
        ce = classification_loss(c.loss)
        opt = make_optimizer(model.parameters(), c.optimizer, c.lr, c.eps)
        return Run(
            model,
            opt,
            lambda out, t: ce(out, t) + l2_penalty(kernels, c.l2),
            image_batch(x, y, c.scaling, seed=0),
            steps or OVERFIT_ITERS,
            after_backward=flip_gradients(list(model.parameters())) if c.flip else None,
            accuracy=accuracy_onehot,
        )

    return build


# ============================================================================ regrNN (auto-mpg)


@dataclass(frozen=True)
class RegrConfig:
    optimizer: str = "adam"
    lr: float = 1e-3
    eps: float = 1e-8
    init: str = "he_normal"  # dense_0, dense_1; the output layer keeps glorot-uniform
    init_std: float = 0.0
    out_act: str = "none"
    loss: str = "mse"
    scaling: str = "norm"
    targets: str = "scaled"  # 'scaled' (min-max to target_range) or 'x10' (10 * MPG, unscaled)
    target_range: tuple = (0.0, 1.0)
    flat_labels: bool = False  # labels placeholder [None] instead of [None, 1]
    l2: float = 1e-5
    flip: bool = False


class RegrNN(nn.Module):
    """clean_base_programs/regrNN.py: dense(64)-relu, dense(64)-relu, dense(1)."""

    def __init__(self, c: RegrConfig):
        super().__init__()
        k = init_for(c.init, c.init_std)
        self.dense_0 = tf_layer(nn.Linear(9, 64), k)
        self.act_0 = nn.ReLU()
        self.dense_1 = tf_layer(nn.Linear(64, 64), k)
        self.act_1 = nn.ReLU()
        self.outputs = tf_layer(nn.Linear(64, 1))
        self.out_act: nn.Module = {"none": nn.Identity(), "sigmoid": nn.Sigmoid(), "softmax": nn.Softmax(dim=-1)}[
            c.out_act
        ]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out_act(self.outputs(self.act_1(self.dense_1(self.act_0(self.dense_0(x))))))


def regression_loss(kind: str) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    return {
        "mse": lambda out, y: (out - y).pow(2).mean(),  # tf.losses.mean_squared_error
        "sum_sq": lambda out, y: (out - y).pow(2).sum(),  # reduce_sum(square(out - y))
        # -reduce_sum(labels * log(clip(out, 1e-10, 1))): cross-entropy on a regression output
        "ce": lambda out, y: -(y * torch.log(out.clamp(1e-10, 1.0))).sum(),
    }[kind]


def regr_nn(c: RegrConfig) -> Callable[[bool, Optional[int]], Run]:
    def build(_: bool, steps: Optional[int]) -> Run:
        x, mpg = auto_mpg()
        g = np.random.default_rng(0)
        train = g.permutation(len(x))[: int(0.8 * len(x))]  # dataset.sample(frac=0.8, random_state=0)
        x, mpg = x[train], mpg[train]
        if c.scaling != "raw":
            mi, rng = minmax(x, 0)
            x = (x - mi) / rng
            if c.scaling == "double":
                x = x / rng
        if c.targets == "x10":
            t = 10 * mpg
        else:
            lo, hi = c.target_range
            tmi, trng = minmax(mpg, 0)
            t = lo + (mpg - tmi) / trng * (hi - lo)
        t = t if c.flat_labels else t.reshape(-1, 1)
        idx = g.choice(len(x), 8, replace=False)  # get_sample(overfit_batch=8)
        model = RegrNN(c)
        kernels: List[nn.Module] = [model.dense_0, model.dense_1, model.outputs]
        loss = regression_loss(c.loss)
        opt = make_optimizer(model.parameters(), c.optimizer, c.lr, c.eps)
        return Run(
            model,
            opt,
            lambda out, y: loss(out, y) + l2_penalty(kernels, c.l2),
            fixed_batch(x[idx], t[idx]),
            steps or OVERFIT_ITERS,
            after_backward=flip_gradients(list(model.parameters())) if c.flip else None,
        )

    return build


# ============================================================================ deepCNN (CIFAR-10)


@dataclass(frozen=True)
class DeepCNNConfig:
    lr: float = 1e-3
    optimizer: str = "momentum"
    eps: float = 1e-8
    init: str = "he_uniform"  # the buggy files' base: he-uniform kernels, 64 filters in block 3
    init_std: float = 0.0
    out_init: str = "glorot"
    batchnorm: bool = True
    conv1_act: str = "relu"
    loss: str = "ce"
    scaling: str = "norm"


class DeepCNN(nn.Module):
    """clean_base_programs/deepCNN.py (VGG-like): 3 blocks of [conv3x3-relu-BN] x2, maxpool,
    dropout (0.2, 0.3, 0.4); dense(128)-relu-BN-dropout(0.5); dense(10). Convs have no bias."""

    def __init__(self, c: DeepCNNConfig):
        super().__init__()
        k = init_for(c.init, c.init_std)
        chans = [3, 32, 32, 64, 64, 64, 64]
        layers: List[nn.Module] = []
        for i in range(6):
            layers.append(tf_layer(nn.Conv2d(chans[i], chans[i + 1], 3, padding=1, bias=not c.batchnorm), k))
            layers.append(Softmax2d() if (i == 0 and c.conv1_act == "softmax") else nn.ReLU())
            if c.batchnorm:
                layers.append(tf_batchnorm2d(chans[i + 1]))
            if i % 2 == 1:
                layers += [nn.MaxPool2d(2, 2), nn.Dropout([0.2, 0.3, 0.4][i // 2])]
        self.features = nn.Sequential(*layers)
        self.dense = tf_layer(nn.Linear(4 * 4 * 64, 128), k)
        self.act = nn.ReLU()
        self.dense_norm: nn.Module = tf_batchnorm1d(128) if c.batchnorm else nn.Identity()
        self.drop = nn.Dropout(0.5)
        self.outputs = tf_layer(nn.Linear(128, 10), init_for(c.out_init, c.init_std))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.features(x).flatten(1)
        return self.outputs(self.drop(self.dense_norm(self.act(self.dense(x)))))


def deep_cnn(c: DeepCNNConfig) -> Callable[[bool, Optional[int]], Run]:
    def build(_: bool, steps: Optional[int]) -> Run:
        x, y = digits_as_cifar()
        model = DeepCNN(c)
        ce = classification_loss(c.loss)
        return Run(
            model,
            make_optimizer(model.parameters(), c.optimizer, c.lr, c.eps),
            ce,
            image_batch(x, y, c.scaling, seed=0),
            steps or DEEP_STEPS,
            accuracy=accuracy_onehot,
        )

    return build


# ============================================================================ the programs

MNIST_DATA = (
    "MNIST -> scikit-learn's bundled 8x8 digits resized to MNIST's 28x28 at its 0..255 scale "
    "(common.digits_as_mnist); the fault acts on the same raw range, architecture and loss"
)
MPG_DATA = "auto-mpg.csv -> vega_datasets' bundled `cars` (the same UCI Auto MPG records, same 9 raw features)"
CIFAR_DATA = (
    "CIFAR-10 -> 32x32 RGB images at 0..255 built from the bundled digits with random colours "
    "and noise (common.digits_as_cifar)"
)


def _pair(
    name: str,
    path: str,
    label: str,
    cause: Optional[str],
    fix: str,
    kind: str,
    fixed_cfg,
    buggy_cfg,
    also=(),
) -> Program:
    builder = {"base": base_cnn, "regr": regr_nn, "deep": deep_cnn}[kind]
    clean = {"base": "baseCNN", "regr": "regrNN", "deep": "deepCNN"}[kind]
    fixed_build, buggy_build = builder(fixed_cfg), builder(buggy_cfg)
    arch = {"base": "CNN 2 conv + 2 dense", "regr": "MLP 9-64-64-1", "deep": "VGG-like 6 conv + BN"}[kind]
    return Program(
        name=f"tdc/{name}",
        source=src(f"buggy_synthetic_programs/{path}"),
        fixed_source=src(f"clean_base_programs/{clean}.py") + " (+ the buggy file's non-fault edits)",
        label=label,
        cause=cause,
        fix=fix,
        data={"base": MNIST_DATA, "regr": MPG_DATA, "deep": CIFAR_DATA}[kind],
        build=lambda buggy, steps: (buggy_build if buggy else fixed_build)(buggy, steps),
        also=tuple(also),
        arch=arch,
        fixed_key=f"{kind}:{fixed_cfg}",
    )


def programs() -> List[Program]:
    B, R, D = BaseCNNConfig(), RegrConfig(), DeepCNNConfig()
    B1024 = replace(B, units=1024)
    out: List[Program] = [
        # ------------------------------------------------------------------ regrNN
        _pair(
            "regrNN_high_lr",
            "high_lr/regrNN_high_lr.py",
            "high_lr",
            "learning_rate_too_high",
            "Adam lr 0.1 -> 0.001",
            "regr",
            R,
            replace(R, lr=0.1),
        ),
        _pair(
            "regrNN_low_lr",
            "low_lr/regrNN_low_lr.py",
            "low_lr",
            "learning_rate_too_low",
            "Adam lr 1e-5 -> 0.001",
            "regr",
            R,
            replace(R, lr=1e-5),
        ),
        _pair(
            "regrNN_low_eps",
            "low_adam_epsilon/regrNN_low_eps.py",
            "low_adam_epsilon",
            "numerical_instability",
            "Adam epsilon 1e-16 -> 1e-8 (TF default)",
            "regr",
            R,
            replace(R, eps=1e-16),
        ),
        _pair(
            "regrNN_miss_norm",
            "missing_normalization/regrNN_miss_norm.py",
            "missing_normalization",
            "bad_input_data",
            "min-max normalise the features (normalization=True)",
            "regr",
            R,
            replace(R, scaling="raw"),
        ),
        _pair(
            "regrNN_dbl_norm",
            "double_normalization/regrNN_dbl_norm.py",
            "double_normalization",
            "bad_input_data",
            "divide by the column range once, not twice",
            "regr",
            R,
            replace(R, scaling="double"),
        ),
        _pair(
            "regrNN_flip_sign",
            "flipped_sign/regrNN_flip_sign.py",
            "flipped_sign",
            "flipped_update_sign",
            "apply the gradients, not their negation",
            "regr",
            R,
            replace(R, flip=True),
        ),
        _pair(
            "regrNN_constant",
            "wrong_init/regrNN_constant.py",
            "wrong_init (constant 0.01)",
            "poor_initialization",
            "he-normal kernels instead of constant(0.01)",
            "regr",
            replace(R, l2=1e-6),
            replace(R, l2=1e-6, init="constant"),
        ),
        _pair(
            "regrNN_random",
            "wrong_init/regrNN_random.py",
            "wrong_init (normal std 0.25)",
            "poor_initialization",
            "he-normal kernels instead of N(0, 0.25)",
            "regr",
            replace(R, l2=1e-6),
            replace(R, l2=1e-6, init="random", init_std=0.25),
        ),
        _pair(
            "regrNN_wrong_act",
            "wrong_activation/regrNN_wrong_act.py",
            "wrong_activation (1-unit softmax output)",
            "output_loss_mismatch",
            "no activation on the 1-unit output",
            "regr",
            R,
            replace(R, out_act="softmax"),
        ),
        _pair(
            "regrNN_inapp_act",
            "wrong_activation/regrNN_inapp_act.py",
            "wrong_activation (sigmoid output, targets in [-1, 1])",
            "output_loss_mismatch",
            "no sigmoid on the output (targets stay in [-1, 1])",
            "regr",
            replace(R, target_range=(-1.0, 1.0)),
            replace(R, target_range=(-1.0, 1.0), out_act="sigmoid"),
        ),
        _pair(
            "regrNN_inap_loss",
            "wrong_loss_selection/regrNN_inap_loss.py",
            "wrong_loss_selection (CE for regression)",
            "output_loss_mismatch",
            "mean squared error instead of cross-entropy",
            "regr",
            R,
            replace(R, loss="ce"),
        ),
        _pair(
            "regrNN_wrong_loss2",
            "wrong_loss_function2/regrNN_wrong_loss2.py",
            "wrong_loss_function (labels [None] broadcast against outputs [None, 1])",
            "target_shape_mismatch",
            "labels shaped [None, 1] like the outputs",
            "regr",
            replace(R, l2=1e-6),
            replace(R, l2=1e-6, flat_labels=True),
        ),
        _pair(
            "regrNN_wrong_loss",
            "wrong_loss_function/regrNN_wrong_loss.py",
            "wrong_loss_function (sum of squares, unscaled 10x targets)",
            "bad_input_data",
            "mean squared error on min-max scaled targets",
            "regr",
            replace(R, l2=1e-5),
            replace(R, loss="sum_sq", targets="x10"),
            also=("learning_rate_too_high",),
        ),
        _pair(
            "regrNN_over_scaled_outputs",
            "over_scaled_outputs/regrNN_over_scaled_outputs.py",
            "over_scaled_outputs (targets 10 x MPG, not scaled)",
            "bad_input_data",
            "min-max scale the targets (target_scaling=True)",
            "regr",
            replace(R, l2=1e-6),
            replace(R, l2=1e-6, targets="x10"),
        ),
        _pair(
            "regrNN_over_reg",
            "over_regulariaztion/regrNN_over_reg.py",
            "over_regularization (l2 0.1)",
            "over_regularization",
            "l2 1e-5 instead of 1e-1",
            "regr",
            R,
            replace(R, l2=0.1),
        ),
        # ------------------------------------------------------------------ baseCNN
        _pair(
            "baseCNN_high_lr",
            "high_lr/baseCNN_high_lr.py",
            "high_lr",
            "learning_rate_too_high",
            "SGD lr 0.5 -> 0.1",
            "base",
            B1024,
            replace(B1024, lr=0.5),
        ),
        _pair(
            "baseCNN_low_lr",
            "low_lr/baseCNN_low_lr.py",
            "low_lr",
            "learning_rate_too_low",
            "SGD lr 0.001 -> 0.1",
            "base",
            B,
            replace(B, lr=0.001),
        ),
        _pair(
            "baseCNN_low_eps",
            "low_adam_epsilon/baseCNN_low_eps.py",
            "low_adam_epsilon",
            "numerical_instability",
            "the clean program's SGD(0.1) instead of Adam(0.1, epsilon=1e-16)",
            "base",
            B,
            replace(B, optimizer="adam", lr=0.1, eps=1e-16),
            also=("learning_rate_too_high",),
        ),
        _pair(
            "baseCNN_miss_norm",
            "missing_normalization/baseCNN_miss_norm.py",
            "missing_normalization",
            "bad_input_data",
            "scale pixels to [0, 1] (normalization=True)",
            "base",
            B,
            replace(B, scaling="raw"),
        ),
        _pair(
            "baseCNN_dbl_norm",
            "double_normalization/baseCNN_dbl_norm.py",
            "double_normalization",
            "bad_input_data",
            "divide by the pixel range once, not twice",
            "base",
            B,
            replace(B, scaling="double"),
        ),
        _pair(
            "baseCNN_flip_sign",
            "flipped_sign/baseCNN_flip_sign.py",
            "flipped_sign",
            "flipped_update_sign",
            "apply the gradients, not their negation",
            "base",
            B,
            replace(B, flip=True),
        ),
        _pair(
            "baseCNN_constant",
            "wrong_init/baseCNN_constant.py",
            "wrong_init (constant 0.01)",
            "poor_initialization",
            "he-normal kernels (glorot output) instead of constant(0.01)",
            "base",
            B1024,
            replace(B1024, init="constant", out_init="constant"),
        ),
        _pair(
            "baseCNN_random",
            "wrong_init/baseCNN_random.py",
            "wrong_init (normal std 0.1)",
            "poor_initialization",
            "he-normal kernels (glorot output) instead of N(0, 0.1)",
            "base",
            B1024,
            replace(B1024, init="random", init_std=0.1, out_init="random"),
        ),
        _pair(
            "baseCNN_wrong_act",
            "wrong_activation/baseCNN_wrong_act.py",
            "wrong_activation (softmax after conv1)",
            "saturating_activation",
            "ReLU after the first convolution",
            "base",
            B,
            replace(B, conv1_act="softmax"),
        ),
        _pair(
            "baseCNN_red_soft",
            "redundant_softmax/baseCNN_red_soft.py",
            "redundant_softmax",
            "output_loss_mismatch",
            "pass the logits, not the probabilities, to softmax_cross_entropy_with_logits",
            "base",
            B,
            replace(B, loss="redundant_softmax"),
        ),
        _pair(
            "baseCNN_miss_soft",
            "missing_softmax/baseCNN_miss_soft.py",
            "missing_softmax",
            "output_loss_mismatch",
            "softmax before the hand-written cross-entropy",
            "base",
            B,
            replace(B, loss="missing_softmax"),
        ),
        _pair(
            "baseCNN_wrong_loss",
            "wrong_loss_function/baseCNN_wrong_loss.py",
            "wrong_loss_function (sum over the batch of means over classes)",
            "learning_rate_too_high",
            "mean over the batch of the sum over classes",
            "base",
            B1024,
            replace(B1024, loss="sum_of_class_means"),
        ),
        _pair(
            "baseCNN_wrong_loss2",
            "wrong_loss_function2/baseCNN_wrong_loss2.py",
            "wrong_loss_function (reduction over the wrong axis)",
            "learning_rate_too_high",
            "sum over classes, mean over the batch",
            "base",
            B1024,
            replace(B1024, loss="batch_sum_axis0"),
        ),
        _pair(
            "baseCNN_wrong_soft",
            "wrong_softmax_impl/baseCNN_wrong_soft.py",
            "wrong_softmax_impl (axis 0)",
            None,
            "softmax over the classes (axis 1)",
            "base",
            B1024,
            replace(B1024, loss="softmax_over_batch"),
        ),
        _pair(
            "baseCNN_inap_loss",
            "wrong_loss_selection/baseCNN_inap_loss.py",
            "wrong_loss_selection (MSE on probabilities)",
            None,
            "softmax cross-entropy instead of MSE",
            "base",
            B,
            replace(B, loss="mse"),
        ),
        # ------------------------------------------------------------------ deepCNN
        _pair(
            "deepCNN_miss_batchnorm",
            "missing_batchnorm/deepCNN_miss_batchnorm.py",
            "missing_batchnorm",
            "missing_normalization",
            "batch normalization after every conv and the dense layer",
            "deep",
            D,
            replace(D, batchnorm=False),
        ),
        _pair(
            "deepCNN_high_lr",
            "high_lr/deepCNN_high_lr.py",
            "high_lr",
            "learning_rate_too_high",
            "momentum lr 0.1 -> 0.001",
            "deep",
            D,
            replace(D, lr=0.1),
        ),
        _pair(
            "deepCNN_low_lr",
            "low_lr/deepCNN_low_lr.py",
            "low_lr",
            "learning_rate_too_low",
            "momentum lr 1e-5 -> 0.001",
            "deep",
            D,
            replace(D, lr=1e-5),
        ),
        _pair(
            "deepCNN_random",
            "wrong_init/deepCNN_random.py",
            "wrong_init (normal std 0.25)",
            "poor_initialization",
            "he-normal kernels instead of N(0, 0.25)",
            "deep",
            replace(D, init="he_normal"),
            replace(D, init="random", init_std=0.25, out_init="random"),
        ),
        _pair(
            "deepCNN_constant",
            "wrong_init/deepCNN_constant.py",
            "wrong_init (constant 0.01)",
            "poor_initialization",
            "he-normal kernels (glorot output) instead of constant(0.01)",
            "deep",
            replace(D, init="he_normal"),
            replace(D, init="constant", out_init="constant"),
        ),
        _pair(
            "deepCNN_miss_norm",
            "missing_normalization/deepCNN_miss_norm.py",
            "missing_normalization",
            "bad_input_data",
            "scale pixels to [0, 1] (normalization=True)",
            "deep",
            replace(D, out_init="he_uniform"),
            replace(D, out_init="he_uniform", scaling="raw"),
        ),
        _pair(
            "deepCNN_red_soft",
            "redundant_softmax/deepCNN_red_soft.py",
            "redundant_softmax",
            "output_loss_mismatch",
            "pass the logits, not the probabilities, to softmax_cross_entropy_with_logits",
            "deep",
            D,
            replace(D, loss="redundant_softmax"),
        ),
        _pair(
            "deepCNN_low_eps",
            "low_adam_epsilon/deepCNN_low_eps.py",
            "low_adam_epsilon",
            "numerical_instability",
            "the clean program's momentum SGD (0.001, 0.9) instead of Adam(0.01, epsilon=1e-16)",
            "deep",
            D,
            replace(D, optimizer="adam", lr=0.01, eps=1e-16),
            also=("learning_rate_too_high",),
        ),
    ]
    return out
