"""The healthy base programs of the mutation corpus, and the knobs mutations turn.

Every base is a small, seeded training program on CPU that trains well as written (its healthy
run is part of the corpus). A base is built from a :class:`Knobs`: the default knobs give the
base itself; a mutation (see ``mutations``) changes one or two knobs, the way DeepCrime's
operators edit a program. All data is generated or comes with scikit-learn (nothing fetched).

A base is scored by a measure that does not depend on the scale a mutation may put on the data:
accuracy for classifiers, R^2 for regressions and the autoencoder, each on a batch never trained
on. ``chance`` is what guessing scores, so a mutant's loss of quality is comparable across bases.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from typing import Any, Callable, Dict, FrozenSet, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class Knobs:
    """What a mutation may change in a base program (defaults: the base as written)."""

    lr_factor: float = 1.0
    # Hidden activation replacing the base's ("sigmoid", "tanh"); None keeps it.
    act: Optional[str] = None
    # Every weight matrix multiplied by this after the default initialization.
    init_scale: float = 1.0
    raw_inputs: bool = False
    raw_targets: bool = False
    # A table's features each on its own scale, 3.5 decades apart, the largest ~1 (divided by
    # their ranges twice, or left in mixed units): no input is large, the small ones are tiny.
    uneven_features: bool = False
    # An activation applied to the output before the loss ("softmax", "relu", "sigmoid").
    output_act: Optional[str] = None
    zero_grad: bool = True
    # optimizer.zero_grad() between loss.backward() and optimizer.step(): the step finds nothing.
    zero_grad_late: bool = False
    # The first weighted layer's parameters left out of the optimizer.
    frozen_first: bool = False
    eval_mode: bool = False
    label_noise: float = 0.0
    # The training targets shuffled apart from their inputs (one permutation of the labels):
    # what a loader that shuffles x and y separately, or a misaligned join, gives.
    labels_apart: bool = False
    # Extra hidden layers (each followed by the hidden activation).
    extra_depth: int = 0
    # Biases of the first hidden layer set very negative: its ReLU units start dead.
    dead_bias: bool = False
    # The optimizer's weight_decay (added to the gradient by SGD and Adam, decoupled by AdamW).
    weight_decay: float = 0.0
    # An L2 penalty on every trained weight matrix, written into the loss by the loop.
    weight_penalty: float = 0.0
    # Gradients clipped to this total norm before each step (None: not clipped).
    clip_norm: Optional[float] = None
    # Every gradient negated between the backward pass and the step: the step climbs the loss.
    negate_grads: bool = False
    # A linear learning-rate warmup over this many optimizer steps, stepped every batch (0: none).
    warmup_steps: int = 0
    # The loss rebuilt from its value (`torch.tensor(loss.item(), requires_grad=True)`): the
    # backward pass never reaches the model.
    loss_cut: bool = False
    # Dropout after every hidden activation of an MLP, zeroing this share of the units (0: none).
    dropout: float = 0.0
    # The model's forward gives every sample the first sample's input (as if it began with
    # `x = x[:1].expand_as(x)`): no sample's own input reaches the output (see `lose_input`).
    input_lost: bool = False
    # A recurrent model's head reads the first step of the sequence (`out[:, 0]`) instead of
    # the last: a one-way layer's output there has seen only the first input step.
    readout_first: bool = False


@dataclass
class Program:
    """A base program built with some knobs: the user's loop is :func:`train`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int], Batch]
    steps: int
    # Quality on a batch never trained on (accuracy or R^2), and what guessing scores.
    score: Callable[[nn.Module], float]
    chance: float


@dataclass
class Base:
    name: str
    kind: str  # what sort of program: mlp-regression, cnn, lstm, transformer, ...
    build: Callable[[Knobs, int], Program]
    # Knob names this base can turn (a mutation applies only where all its knobs are supported).
    supports: FrozenSet[str] = field(default_factory=frozenset)


# ----------------------------------------------------------------------------- building blocks

ACTS: Dict[str, Callable[[], nn.Module]] = {
    "relu": nn.ReLU,
    "sigmoid": nn.Sigmoid,
    "tanh": nn.Tanh,
    "gelu": nn.GELU,
}


class OutputAct(nn.Module):
    """An activation on the output, before the loss (the output/loss mismatch mutation)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "softmax":
            return torch.softmax(x, dim=-1)
        if self.kind == "relu":
            return torch.relu(x)
        return torch.sigmoid(x)


def mlp(sizes: List[int], k: Knobs, act: str = "relu", norm: bool = False) -> nn.Sequential:
    """Linear layers of `sizes`, the hidden activation between them, `k.extra_depth` more hidden
    layers of the last hidden width before the output."""
    a = ACTS[k.act or act]
    hidden = sizes[1:-1]
    widths = list(sizes[:-1]) + [hidden[-1]] * k.extra_depth if hidden else list(sizes[:-1])
    layers: List[nn.Module] = []
    for i in range(len(widths) - 1):
        layers.append(nn.Linear(widths[i], widths[i + 1]))
        if norm:
            layers.append(nn.LayerNorm(widths[i + 1]))
        layers.append(a())
        if k.dropout:
            layers.append(nn.Dropout(k.dropout))
    layers.append(nn.Linear(widths[-1], sizes[-1]))
    return nn.Sequential(*layers)


def finish(model: nn.Module, k: Knobs, seed: int) -> nn.Module:
    """Applies the model-side knobs: weight scale, dead biases, output activation."""
    if k.init_scale != 1.0:
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.dim() >= 2 and "norm" not in name:
                    p.mul_(k.init_scale)
    if k.dead_bias:
        first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d)))
        assert first.bias is not None
        with torch.no_grad():
            first.bias.fill_(-20.0)
    if k.output_act is not None:
        model = nn.Sequential(model, OutputAct(k.output_act))
    return model


def optimizer(model: nn.Module, k: Knobs, kind: str, lr: float, **kw) -> torch.optim.Optimizer:
    params = list(model.parameters())
    if k.frozen_first:
        first = next(m for m in model.modules() if isinstance(m, (nn.Linear, nn.Conv2d, nn.LSTM, nn.GRU, nn.Embedding)))
        skip = {id(p) for p in first.parameters()}
        params = [p for p in params if id(p) not in skip]
    cls = {"sgd": torch.optim.SGD, "adam": torch.optim.Adam, "adamw": torch.optim.AdamW}[kind]
    if k.weight_decay:
        kw = {**kw, "weight_decay": k.weight_decay}
    return cls(params, lr=lr * k.lr_factor, **kw)


def batches(x: torch.Tensor, y: torch.Tensor, size: int, seed: int) -> Callable[[int], Batch]:
    """Minibatches over a training set reshuffled every epoch (seeded)."""
    n = len(x)
    per_epoch = max(1, n // size)
    orders: Dict[int, torch.Tensor] = {}

    def at(i: int) -> Batch:
        epoch, j = divmod(i, per_epoch)
        if epoch not in orders:
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        idx = orders[epoch][j * size : (j + 1) * size]
        return x[idx], y[idx]

    return at


def lose_input(model: nn.Module, k: Knobs) -> None:
    """When ``k.input_lost``: the model's forward gives every sample of a batch the first
    sample's input (a forward pre-hook, so every base loses its input the same way)."""
    if not k.input_lost:
        return

    def first_only(module: nn.Module, args: Tuple[Any, ...]) -> Tuple[Any, ...]:
        x = args[0]
        return (x[:1].expand_as(x), *args[1:])

    model.register_forward_pre_hook(first_only)


def targets_apart(y: torch.Tensor, k: Knobs, seed: int) -> torch.Tensor:
    """The training targets, permuted apart from their inputs when ``k.labels_apart``."""
    if not k.labels_apart:
        return y
    return y[torch.randperm(len(y), generator=torch.Generator().manual_seed(seed + 103))]


def noisy_labels(y: torch.Tensor, share: float, classes: int, seed: int) -> torch.Tensor:
    if share <= 0:
        return y
    g = torch.Generator().manual_seed(seed + 101)
    flip = torch.rand(len(y), generator=g) < share
    return torch.where(flip, torch.randint(0, classes, y.shape, generator=g), y)


def accuracy(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(x)
    if out.dim() == 1 or out.shape[-1] == 1:
        return float(
            ((out.reshape(-1) > (0.5 if is_prob(model) else 0.0)).long() == y.long().reshape(-1)).float().mean()
        )
    return float((out.argmax(-1) == y).float().mean())


def is_prob(model: nn.Module) -> bool:
    return isinstance(model, nn.Sequential) and isinstance(model[-1], OutputAct) and model[-1].kind == "sigmoid"


def r2(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> float:
    with torch.no_grad():
        out = model(x).reshape(y.shape)
    if not torch.isfinite(out).all():
        return -1.0
    ss = float(((out - y) ** 2).sum())
    tot = float(((y - y.mean()) ** 2).sum())
    return max(-1.0, 1.0 - ss / max(tot, 1e-12))


def scored(
    fn: Callable[[nn.Module, torch.Tensor, torch.Tensor], float], x: torch.Tensor, y: torch.Tensor
) -> Callable[[nn.Module], float]:
    def score(model: nn.Module) -> float:
        was = model.training
        model.eval()
        try:
            v = fn(model, x, y)
        except Exception:
            v = float("nan")
        model.train(was)
        return v if math.isfinite(v) else -1.0

    return score


# ----------------------------------------------------------------------------- data


@cache
def digits() -> Tuple[np.ndarray, np.ndarray]:
    """scikit-learn's bundled 8x8 digits: 1,797 images, pixels 0..16, 10 classes."""
    from sklearn.datasets import load_digits  # type: ignore[import-untyped]

    d = load_digits()
    return d.images.astype(np.float32), d.target.astype(np.int64)


def digit_tensors(
    k: Knobs, seed: int, classes: Optional[List[int]] = None
) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(train x, train y, held-out x, held-out y); pixels in [0, 1], or 0..255 raw."""
    img, lab = digits()
    if classes is not None:
        keep = np.isin(lab, classes)
        img, lab = img[keep], lab[keep]
        lab = np.searchsorted(np.array(sorted(classes)), lab)
    scale = 255.0 / 16.0 if k.raw_inputs else 1.0 / 16.0
    x = torch.tensor(img * scale)
    y = torch.tensor(lab)
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(len(x), generator=g)
    n_test = len(x) // 5
    te, tr = perm[:n_test], perm[n_test:]
    return x[tr], y[tr], x[te], y[te]


def regression_data(k: Knobs, seed: int, n: int = 1200, d: int = 10) -> Tuple[torch.Tensor, ...]:
    """A smooth nonlinear target of standardized features; raw: features on scales 1..1000 with
    offsets (as measured, unnormalized), targets in the thousands."""
    g = torch.Generator().manual_seed(1000 + seed)
    x = torch.randn(n, d, generator=g)
    w = torch.randn(d, generator=g)
    y = torch.sin(x @ w / math.sqrt(d)) * 2 + 0.5 * x[:, 0] * x[:, 1] + 0.1 * torch.randn(n, generator=g)
    y = (y - y.mean()) / y.std()
    if k.raw_inputs:
        scales = torch.logspace(0, 3, d)
        x = x * scales + 3 * scales
    if k.uneven_features:
        x = uneven(x)
    if k.raw_targets:
        y = y * 800.0 + 3000.0
    return x[200:], y[200:], x[:200], y[:200]


def uneven(x: torch.Tensor) -> torch.Tensor:
    """Each feature of a table on its own scale, from 1 down to 3.5 decades below."""
    return x * torch.logspace(0, -3.5, x.shape[1])


def sequence_sum_data(k: Knobs, seed: int, n: int = 1200, t: int = 20) -> Tuple[torch.Tensor, ...]:
    """Sequences of one feature; class 1 when the running sum ends above zero."""
    g = torch.Generator().manual_seed(2000 + seed)
    x = torch.randn(n, t, 1, generator=g)
    y = (x.sum(dim=(1, 2)) > 0).long()
    if k.raw_inputs:
        x = x * 300.0 + 1000.0
    return x[200:], y[200:], x[:200], y[:200]


def sine_data(k: Knobs, seed: int, n: int = 1200, t: int = 16) -> Tuple[torch.Tensor, ...]:
    """Noisy sine waves of random frequency and phase; the target is the next value."""
    g = torch.Generator().manual_seed(3000 + seed)
    freq = 0.2 + 0.6 * torch.rand(n, 1, generator=g)
    phase = 6.28 * torch.rand(n, 1, generator=g)
    s = torch.arange(t + 1).float().unsqueeze(0)
    wave = torch.sin(freq * s + phase) + 0.05 * torch.randn(n, t + 1, generator=g)
    x, y = wave[:, :t].unsqueeze(-1), wave[:, t]
    if k.raw_inputs:
        x = x * 500.0 + 2000.0
    if k.raw_targets:
        y = y * 500.0 + 2000.0
    return x[200:], y[200:], x[:200], y[:200]


def token_data(seed: int, n: int = 1200, t: int = 12, vocab: int = 12) -> Tuple[torch.Tensor, ...]:
    """Token sequences; class 1 when token 1 occurs more often than token 2."""
    g = torch.Generator().manual_seed(4000 + seed)
    x = torch.randint(0, vocab, (n, t), generator=g)
    y = ((x == 1).sum(1) > (x == 2).sum(1)).long()
    return x[200:], y[200:], x[:200], y[:200]


# ----------------------------------------------------------------------------- the bases


def _classifier(
    model: nn.Module, k: Knobs, seed: int, data, classes: int, opt: str, lr: float, steps: int = 150, bs: int = 64, **kw
) -> Program:
    xtr, ytr, xte, yte = data
    ytr = targets_apart(noisy_labels(ytr, k.label_noise, classes, seed), k, seed)
    model = finish(model, k, seed)
    return Program(
        model,
        optimizer(model, k, opt, lr, **kw),
        nn.CrossEntropyLoss(),
        batches(xtr, ytr, bs, seed),
        steps,
        scored(accuracy, xte, yte),
        1.0 / classes,
    )


def _regressor(
    model: nn.Module, k: Knobs, seed: int, data, opt: str, lr: float, steps: int = 150, bs: int = 64, **kw
) -> Program:
    xtr, ytr, xte, yte = data
    ytr = targets_apart(ytr, k, seed)
    model = finish(model, k, seed)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.mse_loss(out.reshape(y.shape), y)

    return Program(
        model, optimizer(model, k, opt, lr, **kw), loss, batches(xtr, ytr, bs, seed), steps, scored(r2, xte, yte), 0.0
    )


def mlp_classifier(k: Knobs, seed: int) -> Program:
    torch.manual_seed(seed)
    x0, y0, x1, y1 = digit_tensors(k, seed)
    data = (x0.flatten(1), y0, x1.flatten(1), y1)
    return _classifier(mlp([64, 128, 64, 10], k), k, seed, data, 10, "adam", 1e-3)


def mlp_regression(k: Knobs, seed: int) -> Program:
    torch.manual_seed(seed)
    return _regressor(mlp([10, 64, 64, 1], k), k, seed, regression_data(k, seed), "adam", 3e-3)


def mlp_binary(k: Knobs, seed: int) -> Program:
    """Binary classification with BCEWithLogitsLoss, SGD with momentum."""
    torch.manual_seed(seed)
    xtr, ytr, xte, yte = regression_data(Knobs(raw_inputs=k.raw_inputs, uneven_features=k.uneven_features), seed, d=12)
    ytr, yte = (ytr > 0).float(), (yte > 0).float()
    if k.label_noise > 0:
        ytr = noisy_labels(ytr.long(), k.label_noise, 2, seed).float()
    ytr = targets_apart(ytr, k, seed)
    model = finish(mlp([12, 32, 32, 1], k, act="tanh"), k, seed)

    def loss(out: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return F.binary_cross_entropy_with_logits(out.reshape(y.shape), y)

    return Program(
        model,
        optimizer(model, k, "sgd", 0.1, momentum=0.9),
        loss,
        batches(xtr, ytr, 64, seed),
        150,
        scored(accuracy, xte, yte),
        0.5,
    )


class ConvNet(nn.Module):
    def __init__(self, k: Knobs, bn: bool) -> None:
        super().__init__()
        a = ACTS[k.act or "relu"]
        chans = [1, 8, 16] + [16] * k.extra_depth
        blocks: List[nn.Module] = []
        for i in range(len(chans) - 1):
            blocks.append(nn.Conv2d(chans[i], chans[i + 1], 3, padding=1))
            if bn:
                blocks.append(nn.BatchNorm2d(chans[i + 1]))
            blocks.append(a())
        self.features = nn.Sequential(*blocks)
        self.pool = nn.MaxPool2d(2)
        self.head = nn.Linear(16 * 16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.pool(self.features(x.unsqueeze(1))).flatten(1))


def cnn(k: Knobs, seed: int) -> Program:
    torch.manual_seed(seed)
    return _classifier(ConvNet(k, bn=False), k, seed, digit_tensors(k, seed), 10, "sgd", 0.05, momentum=0.9)


def cnn_batchnorm(k: Knobs, seed: int) -> Program:
    torch.manual_seed(seed)
    return _classifier(ConvNet(k, bn=True), k, seed, digit_tensors(k, seed), 10, "adam", 2e-3)


class RecurrentClassifier(nn.Module):
    def __init__(self, k: Knobs, cell: str, out: int) -> None:
        super().__init__()
        rnn = nn.LSTM if cell == "lstm" else nn.GRU
        self.rnn = rnn(1, 32, num_layers=1 + k.extra_depth, batch_first=True)
        self.head = mlp([32, 32, out], Knobs(act=k.act))
        self.readout_first = k.readout_first

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(x)
        return self.head(h[:, 0] if self.readout_first else h[:, -1])


def lstm_classifier(k: Knobs, seed: int) -> Program:
    torch.manual_seed(seed)
    return _classifier(
        RecurrentClassifier(k, "lstm", 2), k, seed, sequence_sum_data(k, seed), 2, "adam", 5e-3, steps=150
    )


def gru_regression(k: Knobs, seed: int) -> Program:
    torch.manual_seed(seed)
    return _regressor(RecurrentClassifier(k, "gru", 1), k, seed, sine_data(k, seed), "adam", 5e-3, steps=150)


class TinyTransformer(nn.Module):
    def __init__(self, k: Knobs, vocab: int = 12, d: int = 32, t: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Parameter(torch.randn(t, d) * 0.1)
        layer = nn.TransformerEncoderLayer(d, 4, 64, dropout=0.0, batch_first=True, activation="gelu")
        self.encoder = nn.TransformerEncoder(layer, 2 + k.extra_depth, enable_nested_tensor=False)
        self.head = nn.Linear(d, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x) + self.pos).mean(1))


def transformer(k: Knobs, seed: int) -> Program:
    torch.manual_seed(seed)
    return _classifier(TinyTransformer(k), k, seed, token_data(seed), 2, "adamw", 2e-3, steps=120)


class AutoEncoder(nn.Module):
    def __init__(self, k: Knobs) -> None:
        super().__init__()
        self.encoder = mlp([64, 32, 8], k)
        self.act = ACTS[k.act or "relu"]()
        self.decoder = mlp([8, 32, 64], k)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sigmoid(self.decoder(self.act(self.encoder(x))))


def autoencoder(k: Knobs, seed: int) -> Program:
    """Digits reconstructed through an 8-unit code; a sigmoid output for pixels in [0, 1]."""
    torch.manual_seed(seed)
    x0, _, x1, _ = digit_tensors(k, seed)
    x0, x1 = x0.flatten(1), x1.flatten(1)
    model = finish(AutoEncoder(k), k, seed)
    return Program(
        model, optimizer(model, k, "adam", 3e-3), nn.MSELoss(), batches(x0, x0, 64, seed), 200, scored(r2, x1, x1), 0.0
    )


def finetune(k: Knobs, seed: int) -> Program:
    """A body pretrained (unwatched) on digits 0-4, then fine-tuned with a new head on 5-9 at a
    low learning rate: the run starts close to a good solution."""
    torch.manual_seed(seed)
    body = mlp([64, 128, 64], Knobs(act=k.act))
    pre_head = nn.Linear(64, 5)
    xa, ya, _, _ = digit_tensors(Knobs(), seed, classes=[0, 1, 2, 3, 4])
    opt = torch.optim.Adam(list(body.parameters()) + list(pre_head.parameters()), lr=2e-3)
    at = batches(xa.flatten(1), ya, 64, seed)
    for i in range(150):
        x, y = at(i)
        opt.zero_grad()
        F.cross_entropy(pre_head(torch.relu(body(x))), y).backward()
        opt.step()
    model = nn.Sequential(body, ACTS[k.act or "relu"](), nn.Linear(64, 5))
    x0, y0, x1, y1 = digit_tensors(k, seed, classes=[5, 6, 7, 8, 9])
    return _classifier(model, k, seed, (x0.flatten(1), y0, x1.flatten(1), y1), 5, "adam", 3e-4, steps=120)


class LoRALinear(nn.Module):
    """A frozen linear layer plus a trainable low-rank update `B @ A`, B zero-initialised (so
    A's gradient is exactly zero at the first step, by design)."""

    def __init__(self, d_in: int, d_out: int, rank: int = 4) -> None:
        super().__init__()
        self.base = nn.Linear(d_in, d_out)
        self.base.requires_grad_(False)
        self.lora_A = nn.Linear(d_in, rank, bias=False)
        self.lora_B = nn.Linear(rank, d_out, bias=False)
        nn.init.kaiming_uniform_(self.lora_A.weight, a=math.sqrt(5))
        nn.init.zeros_(self.lora_B.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + self.lora_B(self.lora_A(x))


class LoRAModel(nn.Module):
    def __init__(self, k: Knobs) -> None:
        super().__init__()
        self.fc1 = LoRALinear(16, 64)
        self.act = ACTS[k.act or "relu"]()
        self.fc2 = LoRALinear(64, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))


def lora(k: Knobs, seed: int) -> Program:
    """LoRA fine-tuning: the target is a frozen teacher network with a low-rank change to its
    first layer; only the adapters train."""
    torch.manual_seed(seed)
    model = LoRAModel(k)
    g = torch.Generator().manual_seed(5000 + seed)
    with torch.no_grad():
        delta = torch.randn(64, 2, generator=g) @ torch.randn(2, 16, generator=g) * 0.15
        x = torch.randn(1200, 16, generator=g)
        h = torch.relu(F.linear(x, model.fc1.base.weight + delta, model.fc1.base.bias))
        y = F.linear(h, model.fc2.base.weight, model.fc2.base.bias).reshape(-1)
        y = (y - y.mean()) / y.std()
    if k.raw_inputs:
        x = x * 300.0 + 500.0
    if k.uneven_features:
        x = uneven(x)
    if k.raw_targets:
        y = y * 800.0 + 3000.0
    return _regressor(model, k, seed, (x[200:], y[200:], x[:200], y[:200]), "adam", 5e-3)


def deep_layernorm(k: Knobs, seed: int) -> Program:
    """A six-layer MLP with LayerNorm and GELU on digits."""
    torch.manual_seed(seed)
    x0, y0, x1, y1 = digit_tensors(k, seed)
    model = mlp([64, 64, 64, 64, 64, 64, 10], k, act="gelu", norm=True)
    return _classifier(model, k, seed, (x0.flatten(1), y0, x1.flatten(1), y1), 10, "sgd", 0.05, momentum=0.9)


_LOOP = {"clip_norm", "warmup_steps", "loss_cut", "input_lost", "negate_grads"}
_ALL = {
    "lr_factor",
    "init_scale",
    "zero_grad",
    "zero_grad_late",
    "frozen_first",
    "weight_decay",
    "weight_penalty",
} | _LOOP
_MODEL = {"act", "extra_depth", "output_act"}

BASES: List[Base] = [
    Base(
        "mlp_classifier",
        "mlp-classification",
        mlp_classifier,
        frozenset(_ALL | _MODEL | {"raw_inputs", "label_noise", "labels_apart", "dead_bias", "dropout"}),
    ),
    Base(
        "mlp_regression",
        "mlp-regression",
        mlp_regression,
        frozenset(
            _ALL | _MODEL | {"raw_inputs", "raw_targets", "uneven_features", "labels_apart", "dead_bias", "dropout"}
        ),
    ),
    Base(
        "mlp_binary",
        "mlp-binary-classification",
        mlp_binary,
        frozenset(_ALL | _MODEL | {"raw_inputs", "uneven_features", "label_noise", "labels_apart", "dropout"}),
    ),
    Base("cnn", "cnn", cnn, frozenset(_ALL | _MODEL | {"raw_inputs", "label_noise", "labels_apart", "dead_bias"})),
    Base(
        "cnn_batchnorm",
        "cnn-batchnorm",
        cnn_batchnorm,
        frozenset(_ALL | _MODEL | {"raw_inputs", "label_noise", "labels_apart", "eval_mode"}),
    ),
    Base(
        "lstm_classifier",
        "lstm",
        lstm_classifier,
        frozenset(_ALL | {"act", "output_act", "raw_inputs", "label_noise", "labels_apart", "readout_first"}),
    ),
    Base(
        "gru_regression",
        "gru",
        gru_regression,
        frozenset(_ALL | {"act", "output_act", "raw_inputs", "raw_targets", "labels_apart", "readout_first"}),
    ),
    Base(
        "transformer",
        "transformer",
        transformer,
        frozenset(_ALL | {"output_act", "label_noise", "labels_apart", "extra_depth"}),
    ),
    Base(
        "autoencoder", "autoencoder", autoencoder, frozenset(_ALL | {"act", "extra_depth", "raw_inputs", "dead_bias"})
    ),
    Base(
        "finetune",
        "fine-tuning",
        finetune,
        frozenset(
            {
                "lr_factor",
                "zero_grad",
                "zero_grad_late",
                "act",
                "output_act",
                "raw_inputs",
                "label_noise",
                "labels_apart",
                "weight_decay",
                "weight_penalty",
            }
            | _LOOP
        ),
    ),
    Base(
        "lora",
        "lora-fine-tuning",
        lora,
        frozenset(
            {
                "lr_factor",
                "zero_grad",
                "zero_grad_late",
                "act",
                "raw_inputs",
                "raw_targets",
                "uneven_features",
                "weight_decay",
                "weight_penalty",
            }
            | _LOOP
        ),
    ),
    Base(
        "deep_layernorm",
        "deep-mlp-layernorm",
        deep_layernorm,
        frozenset(_ALL | {"act", "output_act", "raw_inputs", "label_noise", "labels_apart", "extra_depth", "dropout"}),
    ),
]


def base(name: str) -> Base:
    return next(b for b in BASES if b.name == name)
