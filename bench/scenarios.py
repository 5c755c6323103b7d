"""The scenario suite: training runs with a planted failure, and healthy runs.

Each scenario states its ground truth (failure, cause, root-cause layer, onset step) and a
``check`` that proves it from the independent plain-PyTorch :class:`~bench.recorder.Record` of the
very run being diagnosed (and, where the cause is an intervention, from a counterfactual run
without it). Only then is NeuralDBG's diagnosis scored against it.

Run ``python bench/scoreboard.py`` (``make bench-diagnosis``) for the per-scenario table;
``tests/test_scenarios.py`` runs the same suite under pytest.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.nn as nn

from .recorder import EXPLODING, VANISHING, Record, Recorder

Batch = Tuple[torch.Tensor, torch.Tensor]


@dataclass
class Truth:
    """Ground truth. ``failure is None`` means a healthy run. ``layer``/``step`` None: not scored."""

    failure: Optional[str]
    cause: Optional[str] = None
    layer: Optional[str] = None
    step: Optional[int] = None


@dataclass
class Setup:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    criterion: nn.Module
    batch: Callable[[int], Batch]
    steps: int
    before_step: Optional[Callable[[int, torch.optim.Optimizer], None]] = None
    accumulate: int = 1
    # False: the loop never zeroes the gradients (a planted mistake).
    zero_grad: bool = True


@dataclass
class Scenario:
    name: str
    arch: str
    story: str
    build: Callable[[], Setup]
    truth: Truth
    check: Callable[[Record], None]
    counterfactual: Optional[Callable[[], Setup]] = None
    counter_check: Optional[Callable[[Record], None]] = None


@dataclass
class Outcome:
    scenario: Scenario
    record: Record
    hypotheses: list
    events: list
    error: Optional[BaseException]
    seconds: float
    dbg: object = None
    score: Dict[str, Optional[bool]] = field(default_factory=dict)


# ----------------------------------------------------------------------------- runner


def train(setup: Setup, rec: Optional[Recorder] = None) -> None:
    """The scenario's training loop as its program writes it (told to ``rec`` when given)."""
    for step in range(setup.steps):
        if setup.before_step:
            setup.before_step(step, setup.optimizer)
        if setup.zero_grad:
            setup.optimizer.zero_grad()
        for micro in range(setup.accumulate):
            x, y = setup.batch(step * setup.accumulate + micro)
            if rec is not None:
                rec.begin_forward(x)
            loss = setup.criterion(setup.model(x), y)
            (loss / setup.accumulate).backward()
        if rec is not None:
            rec.end_step(loss)
        setup.optimizer.step()


def run(setup: Setup, monitor: bool, dbg_options: Optional[dict] = None):
    """Runs a setup with the independent recorder (and NeuralDbg when ``monitor``)."""
    from neuraldbg import NeuralDbg

    rec = Recorder(setup.model)
    # The default debugger: no criterion, no options. The loss is picked up from backward().
    dbg = NeuralDbg(setup.model, **(dbg_options or {})) if monitor else None
    error = None
    try:
        with dbg if dbg is not None else nullcontext():
            train(setup, rec)
    except Exception as e:  # a crashed run must still be diagnosable
        error = e
    finally:
        rec.close()
    return rec.rec, dbg, error


def evaluate(s: Scenario, dbg_options: Optional[dict] = None) -> Outcome:
    torch.manual_seed(0)
    t0 = time.perf_counter()
    record, dbg, error = run(s.build(), monitor=True, dbg_options=dbg_options)
    seconds = time.perf_counter() - t0
    hyps = dbg.explain_failure() if dbg is not None else []
    events = dbg.events if dbg is not None else []
    out = Outcome(s, record, hyps, events, error, seconds, dbg)
    out.score = score(s.truth, hyps)
    return out


def verify_truth(s: Scenario, record: Record) -> None:
    """Proves the scenario's ground truth from the independent record (AssertionError if not)."""
    s.check(record)
    if s.counterfactual is not None:
        torch.manual_seed(0)
        counter, _, _ = run(s.counterfactual(), monitor=False)
        assert s.counter_check is not None
        s.counter_check(counter)


def score(truth: Truth, hyps: list) -> Dict[str, Optional[bool]]:
    if truth.failure is None:
        top = max((h.confidence for h in hyps), default=0.0)
        return {"healthy": top < 0.5}
    if not hyps:
        return {"failure": False, "cause": False, "layer": False, "step": False}
    h = hyps[0]
    return {
        "failure": str(h.failure) == truth.failure,
        "cause": str(h.cause) == truth.cause,
        "layer": None if truth.layer is None else h.layer == truth.layer,
        "step": None if truth.step is None else h.step == truth.step,
    }


def passed(o: Outcome) -> bool:
    return all(v is not False for v in o.score.values())


# ----------------------------------------------------------------------------- data


def teacher_data(dim: int, classes: int, batch: int, seed: int = 1, scale: float = 1.0) -> Callable[[int], Batch]:
    """A learnable synthetic classification task: labels from a fixed random linear teacher."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(dim, classes, generator=g)

    def batch_at(i: int) -> Batch:
        gi = torch.Generator().manual_seed(seed * 100_003 + i)
        x = torch.randn(batch, dim, generator=gi) * scale
        return x, (x @ w).argmax(dim=1)

    return batch_at


def image_data(channels: int, size: int, classes: int, batch: int, seed: int = 2) -> Callable[[int], Batch]:
    g = torch.Generator().manual_seed(seed)
    proto = torch.randn(classes, channels, size, size, generator=g)

    def batch_at(i: int) -> Batch:
        gi = torch.Generator().manual_seed(seed * 100_003 + i)
        y = torch.randint(0, classes, (batch,), generator=gi)
        x = proto[y] + 0.8 * torch.randn(batch, channels, size, size, generator=gi)
        return x, y

    return batch_at


def sequence_data(vocab: int, length: int, classes: int, batch: int, seed: int = 3) -> Callable[[int], Batch]:
    """Token sequences labelled by which class-token occurs most often."""

    def batch_at(i: int) -> Batch:
        gi = torch.Generator().manual_seed(seed * 100_003 + i)
        x = torch.randint(0, vocab, (batch, length), generator=gi)
        y = (x % classes).mode(dim=1).values
        return x, y

    return batch_at


def float_sequences(features: int, length: int, classes: int, batch: int, seed: int = 4) -> Callable[[int], Batch]:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(features, classes, generator=g)

    def batch_at(i: int) -> Batch:
        gi = torch.Generator().manual_seed(seed * 100_003 + i)
        x = torch.randn(batch, length, features, generator=gi)
        return x, (x.mean(dim=1) @ w).argmax(dim=1)

    return batch_at


def corrupt(
    batch: Callable[[int], Batch], at: int, how: Callable[[torch.Tensor], torch.Tensor]
) -> Callable[[int], Batch]:
    def batch_at(i: int) -> Batch:
        x, y = batch(i)
        return (how(x.clone()), y) if i == at else (x, y)

    return batch_at


# ----------------------------------------------------------------------------- models


def mlp(dims: List[int], act: Callable[[], nn.Module]) -> nn.Sequential:
    layers: List[nn.Module] = []
    for i in range(len(dims) - 2):
        layers += [nn.Linear(dims[i], dims[i + 1]), act()]
    layers.append(nn.Linear(dims[-2], dims[-1]))
    return nn.Sequential(*layers)


class ConvNet(nn.Module):
    """Conv-BN-ReLU blocks, global pooling, linear head (a custom, non-Sequential module)."""

    def __init__(self, channels: List[int], classes: int, norm: bool = True) -> None:
        super().__init__()
        blocks = []
        for cin, cout in zip(channels[:-1], channels[1:]):
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(cin, cout, 3, padding=1, bias=not norm),
                    nn.BatchNorm2d(cout) if norm else nn.Identity(),
                    nn.ReLU(),
                )
            )
        self.blocks = nn.ModuleList(blocks)
        self.head = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x.mean(dim=(2, 3)))


class ResidualBlock(nn.Module):
    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(width, width)
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(x + self.fc2(self.act(self.fc1(x))))


class ResNetMLP(nn.Module):
    def __init__(self, dim: int, width: int, blocks: int, classes: int) -> None:
        super().__init__()
        self.stem = nn.Linear(dim, width)
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(blocks))
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for b in self.blocks:
            h = b(h)
        return self.head(h)


class LSTMClassifier(nn.Module):
    """An LSTM over batch-first sequences, a linear head on its output at step ``read``."""

    def __init__(self, features: int, hidden: int, classes: int, layers: int = 1, read: int = -1) -> None:
        super().__init__()
        self.lstm = nn.LSTM(features, hidden, num_layers=layers, batch_first=True)
        self.head = nn.Linear(hidden, classes)
        self.read = read

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.lstm(x)
        return self.head(out[:, self.read])


class TinyTransformer(nn.Module):
    """Embedding + nn.TransformerEncoder + mean pooling + linear head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=2 * d, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


class MaskedAttention(nn.Module):
    """Hand-written attention that masks padding with -inf: a row with every key masked makes
    softmax divide 0 by 0."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.qkv = nn.Linear(d, 3 * d)
        self.out = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        scores = q @ k.transpose(1, 2) / math.sqrt(q.shape[-1])
        scores = scores.masked_fill(pad[:, None, :], float("-inf"))
        return self.out(torch.softmax(scores, dim=-1) @ v)


class PaddedEncoder(nn.Module):
    """Token ids with id 0 as padding -> embedding -> masked attention -> pooled linear head."""

    def __init__(self, vocab: int, d: int, classes: int) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.attn = MaskedAttention(d)
        self.ff = nn.Sequential(nn.Linear(d, 2 * d), nn.GELU(), nn.Linear(2 * d, d))
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        pad = x == 0
        h = self.embed(x)
        h = h + self.attn(h, pad)
        h = h + self.ff(h)
        return self.head(h.mean(dim=1))


class L2Normalize(nn.Module):
    """Projects each sample onto the unit sphere, without an epsilon."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x / x.norm(dim=1, keepdim=True)


class NormalizedMLP(nn.Module):
    def __init__(self, dim: int, width: int, classes: int) -> None:
        super().__init__()
        self.normalize = L2Normalize()
        self.body = nn.Sequential(nn.Linear(dim, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU())
        self.head = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.body(self.normalize(x)))


def init_weights(model: nn.Module, std: float, bias: Optional[float] = None) -> nn.Module:
    with torch.no_grad():
        for m in model.modules():
            if isinstance(m, nn.Linear):
                m.weight.normal_(0.0, std)
                if bias is not None and m.bias is not None:
                    m.bias.fill_(bias)
    return model


def lr_at(schedule: Callable[[int], float]) -> Callable[[int, torch.optim.Optimizer], None]:
    def before(step: int, opt: torch.optim.Optimizer) -> None:
        for g in opt.param_groups:
            g["lr"] = schedule(step)

    return before


# ----------------------------------------------------------------------------- checks


def healthy_check(min_drop: float = 0.3) -> Callable[[Record], None]:
    """A healthy run: every gradient and loss finite, no layer vanishing or exploding for 3
    steps, and the loss fell by at least ``min_drop`` of its start."""

    def check(r: Record) -> None:
        assert all(r.all_finite(s) for s in range(r.steps)), "a gradient or loss went non-finite"
        assert r.first_step(lambda s: r.any_layer(s, lambda v: v < VANISHING), 3) is None, "a layer vanished"
        assert r.first_step(lambda s: r.any_layer(s, lambda v: v > EXPLODING), 3) is None, "a layer exploded"
        start = sum(r.loss[:5]) / 5
        end = sum(r.loss[-5:]) / 5
        assert end < (1 - min_drop) * start, f"loss did not fall enough: {start:.3f} -> {end:.3f}"

    return check


def learns(min_drop: float = 0.3) -> Callable[[Record], None]:
    def check(r: Record) -> None:
        assert all(r.all_finite(s) for s in range(r.steps)), "counterfactual went non-finite"
        start, end = sum(r.loss[:5]) / 5, sum(r.loss[-5:]) / 5
        assert end < (1 - min_drop) * start, f"counterfactual did not learn: {start:.3f} -> {end:.3f}"
        assert r.first_step(lambda s: r.any_layer(s, lambda v: v < VANISHING), 3) is None
        assert r.first_step(lambda s: r.any_layer(s, lambda v: v > EXPLODING), 3) is None

    return check


def expect(truth: Truth, what: str, got) -> None:
    want = getattr(truth, what)
    assert got == want, f"ground truth {what}: the record says {got!r}, the scenario claims {want!r}"


# ----------------------------------------------------------------------------- scenarios
# Each entry of SCENARIOS is built by a function below; see bench/suite.py.
