"""What every port shares: the program record, the original frameworks' defaults, the data that
replaces the originals' (nothing fetched is committed: every array here is generated or comes
from a dataset bundled in a pip package), and the training loop.

Framework defaults reproduced here (TF 1.x, which all the ported programs use):

- `tf.layers.dense` / `tf.layers.conv2d`: kernel glorot-uniform, bias zeros.
- `tf.initializers.he_normal()`: a normal truncated at 2 standard deviations, with stddev
  `sqrt(2 / fan_in) / 0.8796` (TF 1.x corrects the truncation); `he_uniform()`: U(+-sqrt(6/fan_in)).
- `tf.truncated_normal(stddev=s)`: normal truncated at +-2s; `tf.random_normal`: stddev 1.
- `tf.layers.batch_normalization`: momentum 0.99 (PyTorch's momentum 0.01), epsilon 1e-3.
- `tf.train.AdamOptimizer`: epsilon 1e-8; `MomentumOptimizer(lr, 0.9)`: PyTorch's SGD with
  momentum 0.9 and no dampening (the same update rule).
- `tf.keras.regularizers.l1_l2(0, l2)`: `l2 * sum(w ** 2)` over the kernel, added to the loss by
  the program itself (`loss + tf.losses.get_regularization_loss()`).
- Channels: TF is NHWC, PyTorch NCHW; a softmax "over the last axis" of a conv output is over
  channels, i.e. `dim=1` here. Flattening order differs only by a fixed permutation of the next
  layer's (randomly initialised) weights.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cache
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

Batch = Tuple[torch.Tensor, torch.Tensor]

TDC_REPO = "thedeepchecker/thedeepchecker"
TDC_COMMIT = "d0a2b3a5339b50c3f0b147231e295d3db25017fb"
TPB_REPO = "ForeverZyh/TensorFlow-Program-Bugs"
TPB_COMMIT = "158ba0a23e0cb74e73dbab08571b05fc36848f2a"


@dataclass
class Run:
    """One training program, ready to train: the user's loop is `Run.train`."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    batch: Callable[[int], Batch]
    steps: int
    # Runs between backward() and optimizer.step() (e.g. a hand-written gradient transform).
    after_backward: Optional[Callable[[], None]] = None
    # Accuracy of the model's output on a batch (classification), for the report only.
    accuracy: Optional[Callable[[torch.Tensor, torch.Tensor], float]] = None


@dataclass
class Program:
    """A published buggy program, ported, with its label and its fix.

    ``cause`` is our cause vocabulary's name for the original label, or None where the vocabulary
    has no name for it (then only detection is scored); ``also`` lists other causes that name the
    same mistake (e.g. a loss summed over the batch *is* a learning rate N times too high).
    """

    name: str
    source: str  # repository@commit:path of the buggy program
    fixed_source: str  # the same for the fixed version (or how the fix was derived)
    label: str  # the original's label for the fault
    cause: Optional[str]
    fix: str  # what the fix changes
    data: str  # what replaced the original's data, and why the bug behaves the same
    build: Callable[[bool, Optional[int]], Run]  # (buggy, steps override) -> Run
    also: Tuple[str, ...] = ()
    arch: str = ""
    # Programs whose fixed versions are the same program (same clean base, same edits) share
    # this key, so the runner trains that control once.
    fixed_key: Optional[str] = None


@dataclass
class TrainResult:
    losses: List[float] = field(default_factory=list)
    error: Optional[BaseException] = None
    accuracy: Optional[float] = None


def train(run: Run) -> TrainResult:
    """The user's loop, as the original programs wrote it: zero, forward, loss, backward, step."""
    out = TrainResult()
    try:
        for step in range(run.steps):
            x, y = run.batch(step)
            run.optimizer.zero_grad()
            loss = run.loss(run.model(x), y)
            loss.backward()
            if run.after_backward is not None:
                run.after_backward()
            run.optimizer.step()
            out.losses.append(float(loss.detach()))
        if run.accuracy is not None:
            x, y = run.batch(run.steps)
            with torch.no_grad():
                out.accuracy = run.accuracy(run.model(x), y)
    except Exception as e:  # a crashed program is still diagnosable
        out.error = e
    return out


# ----------------------------------------------------------------------------- initializers


def glorot_uniform(w: torch.Tensor) -> None:
    nn.init.xavier_uniform_(w)


def he_normal_tf1(w: torch.Tensor) -> None:
    fan_in = nn.init._calculate_fan_in_and_fan_out(w)[0]
    std = math.sqrt(2.0 / fan_in) / 0.87962566103423978
    nn.init.trunc_normal_(w, 0.0, std, -2 * std, 2 * std)


def he_uniform(w: torch.Tensor) -> None:
    fan_in = nn.init._calculate_fan_in_and_fan_out(w)[0]
    bound = math.sqrt(6.0 / fan_in)
    nn.init.uniform_(w, -bound, bound)


def truncated_normal(std: float) -> Callable[[torch.Tensor], None]:
    return lambda w: nn.init.trunc_normal_(w, 0.0, std, -2 * std, 2 * std)


def random_normal(std: float) -> Callable[[torch.Tensor], None]:
    return lambda w: nn.init.normal_(w, 0.0, std)


def constant(v: float) -> Callable[[torch.Tensor], None]:
    return lambda w: nn.init.constant_(w, v)


def tf_layer(layer: nn.Module, kernel_init: Callable[[torch.Tensor], None] = glorot_uniform) -> nn.Module:
    """A `tf.layers.*` layer: the given kernel initializer (glorot-uniform by default), zero bias."""
    kernel_init(layer.weight)
    if getattr(layer, "bias", None) is not None:
        nn.init.zeros_(layer.bias)
    return layer


def tf_batchnorm2d(c: int) -> nn.BatchNorm2d:
    return nn.BatchNorm2d(c, eps=1e-3, momentum=0.01)


def tf_batchnorm1d(c: int) -> nn.BatchNorm1d:
    return nn.BatchNorm1d(c, eps=1e-3, momentum=0.01)


def l2_penalty(layers: List[nn.Module], l2: float) -> torch.Tensor:
    """`tf.losses.get_regularization_loss()` for `l1_l2(0, l2)` kernel regularizers."""
    return l2 * sum(m.weight.pow(2).sum() for m in layers)


class Softmax2d(nn.Module):
    """`tf.nn.softmax` on an NHWC conv output: over channels (dim 1 in NCHW)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.softmax(x, dim=1)


def flip_gradients(params: List[nn.Parameter]) -> Callable[[], None]:
    """`apply_gradients(zip([-g for g in grads], vars))`: a hand-written update in the wrong direction."""

    def flip() -> None:
        for p in params:
            if p.grad is not None:
                p.grad.neg_()

    return flip


def accuracy_onehot(out: torch.Tensor, y: torch.Tensor) -> float:
    return float((out.argmax(1) == y.argmax(1)).float().mean())


# ----------------------------------------------------------------------------- data


@cache
def digits_as_mnist() -> Tuple[np.ndarray, np.ndarray]:
    """MNIST's schema from scikit-learn's bundled digits: 28x28 grey images, uint8 scale 0..255.

    Each 8x8 digit (values 0..16) is resized bilinearly to 20x20 and centred in a 28x28 frame,
    as MNIST centres its 20x20 digits; pixels are rescaled to 0..255 and rounded like uint8.
    Programs that normalise (or forget to) see the same raw range as with MNIST.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    img = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1)  # (N, 1, 8, 8)
    img = F.interpolate(img, size=(20, 20), mode="bilinear", align_corners=False)
    img = F.pad(img, (4, 4, 4, 4))
    img = (img.clamp(0, 16) * (255.0 / 16.0)).round()
    return img.squeeze(1).numpy(), d.target.astype(np.int64)


@cache
def digits_as_cifar() -> Tuple[np.ndarray, np.ndarray]:
    """CIFAR-10's schema (32x32 RGB, uint8 scale 0..255, 10 classes) from the bundled digits.

    A digit resized to 24x24 and centred, drawn in a random foreground colour over a random
    background colour, with pixel noise: colour and texture vary within a class as in CIFAR,
    the class is in the shape. Seeded, so every run sees the same images.
    """
    from sklearn.datasets import load_digits

    d = load_digits()
    g = np.random.default_rng(10)
    img = torch.tensor(d.images, dtype=torch.float32).unsqueeze(1)
    img = F.pad(F.interpolate(img, size=(24, 24), mode="bilinear", align_corners=False), (4, 4, 4, 4))
    mask = (img.clamp(0, 16) / 16.0).numpy()  # (N, 1, 32, 32)
    n = mask.shape[0]
    fg = g.uniform(0, 255, size=(n, 3, 1, 1))
    bg = g.uniform(0, 255, size=(n, 3, 1, 1))
    x = mask * fg + (1 - mask) * bg + g.normal(0, 20, size=(n, 3, 32, 32))
    x = np.clip(np.round(x), 0, 255).astype(np.float32)
    return x, d.target.astype(np.int64)


@cache
def auto_mpg() -> Tuple[np.ndarray, np.ndarray]:
    """TheDeepChecker's `data/auto-mpg.csv` rebuilt from vega_datasets' bundled `cars` (the same
    UCI Auto MPG records): 9 raw features in the original's column order (Cylinders,
    Displacement, Horsepower, Weight, Acceleration, Model Year, Europe, Japan, USA), target MPG,
    rows with a missing value dropped (392 rows, as the original)."""
    import warnings

    from vega_datasets import data

    with warnings.catch_warnings():  # vega_datasets passes a keyword pandas deprecates
        warnings.simplefilter("ignore")
        cars = data.cars()
    c = cars.dropna(subset=["Miles_per_Gallon", "Horsepower"])
    year = c["Year"].dt.year.to_numpy() - 1900
    origin = c["Origin"].to_numpy()
    x = np.stack(
        [
            c["Cylinders"].to_numpy(float),
            c["Displacement"].to_numpy(float),
            c["Horsepower"].to_numpy(float),
            c["Weight_in_lbs"].to_numpy(float),
            c["Acceleration"].to_numpy(float),
            year.astype(float),
            (origin == "Europe").astype(float),
            (origin == "Japan").astype(float),
            (origin == "USA").astype(float),
        ],
        axis=1,
    )
    return x, c["Miles_per_Gallon"].to_numpy(float)


def minmax(a: np.ndarray, axis: Optional[int]) -> Tuple[np.ndarray, np.ndarray]:
    """TheDeepChecker's `DataLoaderFromArrays.normalize`: (min, range) over the whole array
    (homogeneous, images) or per column; a zero range becomes its EPSILON."""
    mi = a.min(axis=axis)
    rng = a.max(axis=axis) - mi
    rng = np.where(rng == 0.0, 1e-8, rng)
    return mi, rng


def stratified_sample(y: np.ndarray, per_class: int, seed: int) -> np.ndarray:
    """TheDeepChecker's `get_sample` for classification: the same number of examples per class."""
    g = np.random.default_rng(seed)
    idx = [g.choice(np.flatnonzero(y == c), per_class, replace=False) for c in np.unique(y)]
    return np.concatenate(idx)


def onehot(y: np.ndarray, classes: int) -> np.ndarray:
    out = np.zeros((len(y), classes), dtype=np.float32)
    out[np.arange(len(y)), y] = 1.0
    return out


def fixed_batch(x: np.ndarray, y: np.ndarray) -> Callable[[int], Batch]:
    xt = torch.tensor(x, dtype=torch.float32)
    yt = torch.tensor(y, dtype=torch.float32)
    return lambda i: (xt, yt)


def cycling_batches(
    x: np.ndarray, y: np.ndarray, batch: int, seed: int, y_dtype=torch.float32
) -> Callable[[int], Batch]:
    """`next_batch(batch)` over a training set reshuffled at every epoch (seeded)."""
    xt = torch.tensor(x, dtype=torch.float32)
    yt = torch.tensor(y, dtype=y_dtype)
    n = len(xt)
    per_epoch = n // batch
    orders: dict = {}

    def batch_at(i: int) -> Batch:
        epoch, k = divmod(i, per_epoch)
        if epoch not in orders:
            orders[epoch] = torch.randperm(n, generator=torch.Generator().manual_seed(seed * 7919 + epoch))
        idx = orders[epoch][k * batch : (k + 1) * batch]
        return xt[idx], yt[idx]

    return batch_at
