#!/usr/bin/env python3
"""Overhead benchmark (`make bench`): what watching a training run costs.

The arms train the same model (same initial weights, Adam (SGD for mlp16, mlp1024, normmlp256),
``loss.item()`` each step, CPU, one thread) in ONE process, and take turns: a round runs
``--block`` steps (default 10, the period of the debugger's sampled measurements, so a round
always holds the same share of periodic work) of every arm, one step of each arm in turn
(``--interleave step``, the default: steps side by side see the machine alike, which halved
the interval of the ratios here) or one arm's block after the other's (``block``: what a step
leaves in the caches lands on the same arm's next step; on the 16-layer MLP both gave the
same ratio). By default the arms share one model instance and one optimizer: an unwatched
arm's steps run with the debugger's hooks on it put aside (`suspended`, `unwrapped`), so
every arm runs on the very same tensors; ``--separate-models`` gives each arm its own copy
(needed by the compiled and 1.3.2 arms). The reported number for an arm is the median over
rounds of ``arm's round time / plain's round time``, with a 95% bootstrap interval: pairing
each arm's round with plain's, which ran side by side, cancels what the machine did then
(on a shared 2-vCPU VM single 1,024-layer steps of the same code vary by +-20%, and copies of
the model by several percent). The arms' order is shuffled each turn (seeded): what one arm's
step leaves behind (detect_anomaly's, a big arm's caches) lands on every arm alike; with a
fixed rotation, the arm after ``anomaly`` paid for it (A/A 0.97x, a one-off: BENCHMARKS.md). The warm-up
(registration, the debugger's dense first steps) is excluded.

Arms:

* ``plain``: the loop alone.
* ``A/A``: a second, identical plain arm: the ratio it gets is the noise of the measurement.
* ``floor``: plain plus one ``torch._foreach_norm`` over every gradient and one transfer of the
  stacked norms: the least any per-layer gradient monitor must do.
* ``neuraldbg``: plain inside ``with NeuralDbg(model):`` (the default configuration).
* ``anomaly``: plain under ``torch.autograd.detect_anomaly()``.
* ``1.3.2``: the Python NeuralDBG 1.3.2 from PyPI. It shares the import name ``neuraldbg``, so
  it lives in its own virtualenv (``.bench-venv``) and runs in a subprocess that interleaves it
  with its own plain arm the same way; its ratio is against that plain arm.

Run ``python bench/overhead.py --help`` for options; ``make bench`` runs the default set.
This file must not import ``neuraldbg`` at module level: the 1.3.2 worker imports it too.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import os
import platform
import random
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn as nn

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

Batch = Tuple[torch.Tensor, torch.Tensor]

# What a block costs: CPU time of this thread by default. With torch.set_num_threads(1) every
# kernel of the loop (forward, backward, optimizer) runs on this thread, and thread CPU time does
# not count the time other processes of a shared machine hold the core; `--clock wall` measures
# elapsed time instead.
CLOCK: Callable[[], float] = time.thread_time


# ----------------------------------------------------------------------------- models


class MLP(nn.Sequential):
    """``depth`` x (Linear(width, width) + ReLU), then a linear head."""

    def __init__(self, depth: int = 64, width: int = 32, classes: int = 10) -> None:
        layers: List[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.ReLU()]
        layers.append(nn.Linear(width, classes))
        super().__init__(*layers)


class NormMLP(nn.Sequential):
    """``depth`` x (Linear(width, width) + LayerNorm + GELU), then a linear head: a deep model
    of other module types than the MLP's (three parameters' owners a block, no ReLU)."""

    def __init__(self, depth: int = 256, width: int = 64, classes: int = 10) -> None:
        layers: List[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.LayerNorm(width), nn.GELU()]
        layers.append(nn.Linear(width, classes))
        super().__init__(*layers)


class CNN(nn.Module):
    """Conv-BN-ReLU(-MaxPool) blocks, global average pooling, linear head."""

    def __init__(self, channels: Tuple[int, ...] = (3, 32, 64, 128, 128), classes: int = 10) -> None:
        super().__init__()
        blocks = []
        for cin, cout in zip(channels[:-1], channels[1:]):
            blocks.append(
                nn.Sequential(
                    nn.Conv2d(cin, cout, 3, padding=1, bias=False),
                    nn.BatchNorm2d(cout),
                    nn.ReLU(),
                    nn.MaxPool2d(2),
                )
            )
        self.blocks = nn.Sequential(*blocks)
        self.head = nn.Linear(channels[-1], classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.blocks(x).mean(dim=(2, 3)))


class Transformer(nn.Module):
    """Token embedding, ``nn.TransformerEncoder`` (post-norm, ReLU, dropout 0.1), mean pooling,
    linear head."""

    def __init__(self, vocab: int, d: int, heads: int, layers: int, classes: int = 10) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        layer = nn.TransformerEncoderLayer(d, heads, dim_feedforward=4 * d, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, layers, enable_nested_tensor=False)
        self.head = nn.Linear(d, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x)).mean(dim=1))


def resnet18() -> nn.Module:
    import torchvision

    return torchvision.models.resnet18(num_classes=10)


class GPT2(nn.Module):
    """Hugging Face GPT-2 (6 layers, d_model 256, 4 heads, vocab 2000): next-token logits of
    every position, flattened for the cross-entropy."""

    def __init__(self) -> None:
        super().__init__()
        from transformers import GPT2Config, GPT2LMHeadModel

        config = GPT2Config(vocab_size=2000, n_positions=128, n_embd=256, n_layer=6, n_head=4)
        self.lm = GPT2LMHeadModel(config)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lm(input_ids=x).logits.reshape(-1, 2000)


def _batches(make: Callable[[torch.Generator], Batch], n: int = 8) -> List[Batch]:
    g = torch.Generator().manual_seed(1)
    return [make(g) for _ in range(n)]


# name -> (description, model factory, batch pool factory, default rounds)
MODELS: Dict[str, Tuple[str, Callable[[], nn.Module], Callable[[], List[Batch]], int]] = {
    "transformer": (
        "Transformer encoder, 4 layers, d_model 128, 4 heads, seq 64, batch 16",
        lambda: Transformer(1000, 128, 4, 4),
        lambda: _batches(
            lambda g: (torch.randint(0, 1000, (16, 64), generator=g), torch.randint(0, 10, (16,), generator=g))
        ),
        12,
    ),
    "cnn": (
        "CNN, 4 x Conv-BN-ReLU-MaxPool (32-64-128-128 ch), 32x32 images, batch 16",
        CNN,
        lambda: _batches(lambda g: (torch.randn(16, 3, 32, 32, generator=g), torch.randint(0, 10, (16,), generator=g))),
        20,
    ),
    "mlp": (
        "MLP, 64 x (Linear 32x32 + ReLU) + head, batch 64",
        MLP,
        lambda: _batches(lambda g: (torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g))),
        40,
    ),
    # The per-step and per-layer cost on fast steps (one thread: ~1-3 ms and ~75-150 ms a step),
    # SGD. (Rounds: a 1,024-layer round's ratio varies by +-4% on a shared 2-vCPU VM; 30 rounds
    # gave a 95% interval ~7 points wide, 50 ~3.)
    "mlp16": (
        "MLP, 16 x (Linear 32x32 + ReLU) + head, batch 64, SGD",
        lambda: MLP(depth=16),
        lambda: _batches(lambda g: (torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g))),
        300,
    ),
    "mlp1024": (
        "MLP, 1,024 x (Linear 32x32 + ReLU) + head, batch 64, SGD",
        lambda: MLP(depth=1024),
        lambda: _batches(lambda g: (torch.randn(64, 32, generator=g), torch.randint(0, 10, (64,), generator=g))),
        50,
    ),
    "normmlp256": (
        "MLP, 256 x (Linear 64x64 + LayerNorm + GELU) + head, batch 64, SGD",
        NormMLP,
        lambda: _batches(lambda g: (torch.randn(64, 64, generator=g), torch.randint(0, 10, (64,), generator=g))),
        50,
    ),
    "transformer-large": (
        "Transformer encoder, 6 layers, d_model 256, 8 heads, seq 128, batch 8",
        lambda: Transformer(4000, 256, 8, 6),
        lambda: _batches(
            lambda g: (torch.randint(0, 4000, (8, 128), generator=g), torch.randint(0, 10, (8,), generator=g))
        ),
        6,
    ),
    "resnet18": (
        "torchvision ResNet-18, 64x64 images, batch 8",
        resnet18,
        lambda: _batches(lambda g: (torch.randn(8, 3, 64, 64, generator=g), torch.randint(0, 10, (8,), generator=g))),
        6,
    ),
    "gpt2": (
        "Hugging Face GPT-2, 6 layers, d_model 256, 4 heads, seq 64, batch 4 (next-token loss)",
        GPT2,
        lambda: _batches(
            lambda g: (torch.randint(0, 2000, (4, 64), generator=g), torch.randint(0, 2000, (4 * 64,), generator=g))
        ),
        6,
    ),
}
DEFAULT_MODELS = ["transformer", "cnn", "mlp", "mlp16", "mlp1024"]
# Arms the default set leaves out on a model (named with --arms, they run): detect_anomaly on
# 1,024 layers takes seconds a step, and its ratio is plain on the smaller models already.
SKIPPED_BY_DEFAULT = {"mlp1024": {"anomaly"}}
DEFAULT_ARMS = "plain,A/A,floor,neuraldbg,anomaly"
# Optimizer per model (Adam when not named here).
SGD_MODELS = {"mlp16", "mlp1024", "normmlp256"}


# ----------------------------------------------------------------------------- arms


class Arm:
    """One training loop over its own copy of the model."""

    def __init__(self, name: str, model: nn.Module, batches: List[Batch], sgd: bool = False) -> None:
        self.name = name
        self.model = model
        self.batches = batches
        self.opt: torch.optim.Optimizer = (
            torch.optim.SGD(model.parameters(), lr=1e-2) if sgd else torch.optim.Adam(model.parameters(), lr=1e-3)
        )
        self.crit = nn.CrossEntropyLoss()
        self.i = 0
        self.times: List[float] = []

    def enter(self) -> None:
        pass

    def exit(self) -> None:
        pass

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad()
        loss = self.crit(self.model(x), y)
        loss.backward()
        self.after_backward()
        self.opt.step()
        self.after_step(loss.item())

    def after_backward(self) -> None:
        pass

    def after_step(self, loss: float) -> None:
        pass

    # Whether the arm runs with NeuralDBG's class-wide layer wrappers in place (see `unwrapped`).
    keep_wrappers = False

    # Sharing one model instance with the other arms (the default; see `measure`), an
    # unwatched arm's steps run with the watched arm's hooks on that model put aside too.
    shared = False

    def block(self, n: int, record: bool) -> float:
        """Runs ``n`` steps; their time (also kept in ``times`` with ``record``)."""
        with (
            contextlib.nullcontext() if self.keep_wrappers else unwrapped(),
            suspended(self.model) if self.shared and not self.keep_wrappers else contextlib.nullcontext(),
        ):
            t0 = CLOCK()
            for _ in range(n):
                self.step()
            spent = CLOCK() - t0
        if record:
            self.times.append(spent)
        return spent


@contextlib.contextmanager
def unwrapped() -> Iterator[None]:
    """While a watched arm is entered, NeuralDBG has process-wide pieces in place: ``forward``
    of torch's layer classes wrapped (other instances pass through at ~0.5 us a call), the
    ``torch.autograd.backward`` tap, and its global optimizer step post hook. An unwatched
    arm's block runs with all three put aside, so that it measures the plain loop. (The
    compiled arms keep what they were traced with: swapping would recompile them.)"""
    hooks = sys.modules.get("neuraldbg._hooks")
    recorder = getattr(hooks, "CALL_RECORDER", None)
    swapped = []
    for cls, wrapper in list(recorder.wrappers.items()) if recorder is not None else []:
        if cls.__dict__.get("forward") is wrapper:
            own = recorder.original.get(cls)
            if own is None:
                delattr(cls, "forward")
            else:
                cls.forward = own
            swapped.append((cls, wrapper))
    tap = getattr(hooks, "BACKWARD_TAP", None)
    tapped = tap is not None and torch.autograd.backward is tap.installed
    if tapped:
        torch.autograd.backward = tap.original
    from torch.optim import optimizer

    # (The one global hook every watched model's step boundary is called from: `_taps.StepTap`.)
    step_tap = getattr(sys.modules.get("neuraldbg._taps"), "STEP_TAP", None)
    ours = {
        k: h
        for k, h in optimizer._global_optimizer_post_hooks.items()
        if step_tap is not None and h == step_tap._stepped
    }
    for k in ours:
        del optimizer._global_optimizer_post_hooks[k]
    try:
        yield
    finally:
        for cls, wrapper in swapped:
            cls.forward = wrapper
        if tapped:
            torch.autograd.backward = tap.installed
        optimizer._global_optimizer_post_hooks.update(ours)


# The hook tables of a module and of a tensor that torch's call paths consult.
MODULE_HOOKS = (
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_backward_pre_hooks",
    "_backward_hooks",
)


@contextlib.contextmanager
def suspended(model: nn.Module) -> Iterator[None]:
    """On a shared model: the hooks NeuralDBG put on it (per-module forward
    hooks, the root's pre-hook, post-accumulate-grad hooks on parameters) put aside for an
    unwatched arm's block, so that it runs the plain loop on the very same tensors; the
    watched arm's hooks come back unchanged (the same tables, so their handles still remove
    them). The debugger simply does not see those steps, as if the loop had paused."""
    saved_modules = []
    for m in model.modules():
        tables = tuple(getattr(m, name, None) for name in MODULE_HOOKS)
        if any(tables):
            saved_modules.append((m, tables))
            for name, table in zip(MODULE_HOOKS, tables):
                if table is not None:
                    setattr(m, name, type(table)())
    saved_params = []
    for p in model.parameters():
        table = getattr(p, "_post_accumulate_grad_hooks", None)
        if table:
            saved_params.append((p, table))
            p._post_accumulate_grad_hooks = None
    try:
        yield
    finally:
        for m, tables in saved_modules:
            for name, table in zip(MODULE_HOOKS, tables):
                if table is not None:
                    setattr(m, name, table)
        for p, table in saved_params:
            p._post_accumulate_grad_hooks = table


class Floor(Arm):
    """Reads every gradient once (one fused norm call) and moves the norms to the host once."""

    def after_backward(self) -> None:
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        torch.stack(torch._foreach_norm(grads)).cpu()


class Anomaly(Arm):
    def step(self) -> None:
        with torch.autograd.detect_anomaly():
            super().step()


class Ours(Arm):
    options: Dict[str, object] = {}
    keep_wrappers = True

    def enter(self) -> None:
        from neuraldbg import NeuralDbg

        self.dbg = NeuralDbg(self.model, **self.options)
        self.dbg.__enter__()

    def exit(self) -> None:
        self.dbg.__exit__(None, None, None)


class Legacy(Arm):
    """NeuralDBG 1.3.2 as its README shows it: hooks on entry, ``record_loss(loss.item())`` and
    ``step_iteration()`` each step."""

    def enter(self) -> None:
        from neuraldbg import NeuralDbg  # the 1.3.2 package of the bench virtualenv

        self.dbg = NeuralDbg(self.model)
        self.dbg.__enter__()

    def exit(self) -> None:
        self.dbg.__exit__(None, None, None)

    def step(self) -> None:
        x, y = self.batches[self.i % len(self.batches)]
        self.i += 1
        self.opt.zero_grad()
        loss = self.crit(self.model(x), y)
        loss.backward()
        self.opt.step()
        self.dbg.record_loss(loss.item())
        self.dbg.step_iteration()


class Compiled(Arm):
    """The same loop on ``torch.compile(model)`` (inductor; compiled during the warm-up)."""

    keep_wrappers = True  # traced with them: swapping them would recompile

    def __init__(self, name: str, model: nn.Module, batches: List[Batch], sgd: bool = False) -> None:
        super().__init__(name, model, batches, sgd)
        self.plain_model = model
        self.model = torch.compile(model)


class CompiledOurs(Compiled):
    """``torch.compile(model)`` watched: entered before the first compiled call."""

    def enter(self) -> None:
        from neuraldbg import NeuralDbg

        self.dbg = NeuralDbg(self.plain_model, **Ours.options)
        self.dbg.__enter__()

    def exit(self) -> None:
        self.dbg.__exit__(None, None, None)


ARMS: Dict[str, type] = {
    "plain": Arm,
    "A/A": Arm,
    "floor": Floor,
    "neuraldbg": Ours,
    "anomaly": Anomaly,
    "1.3.2": Legacy,
    "compiled": Compiled,
    "compiled+neuraldbg": CompiledOurs,
}
# The arms that can share one model instance (the default unless ``--separate-models``): at
# most one of them watched.
SAME_MODEL_ARMS = {"plain", "A/A", "floor", "neuraldbg", "anomaly"}


def paired(times: List[float], plain: List[float], seed: int = 0) -> Tuple[float, float, float]:
    """The median over rounds of ``arm round time / plain round time`` (each round's arms ran
    side by side, so what the machine did then cancels), and a 95% bootstrap interval of that
    median (1,000 resamples of the rounds)."""
    ratios = [a / b for a, b in zip(times, plain)]
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(1000))
    return statistics.median(ratios), meds[25], meds[974]


def measure(
    model_name: str,
    arm_names: List[str],
    rounds: int,
    block: int,
    warmup: int,
    same_model: bool = False,
    interleave: str = "step",
) -> Dict[str, object]:
    """Interleaved timing of the arms on one model; ratios against ``plain``.

    A round runs ``block`` steps of every arm: with ``interleave="block"`` one arm's steps
    after the other's, with ``"step"`` one step of each arm in turn (the order shuffled each
    turn). With ``same_model`` the arms share one model instance and one
    optimizer (see `suspended`) instead of a copy each: copies of a deep model sit differently
    in memory, and on some machines that alone moved a copy's step time by several percent
    (A/A 0.91-1.07x on the 1,024-layer MLP on a 2-vCPU EPYC VM)."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    _, factory, batches_of, _ = MODELS[model_name]
    base = factory()
    batches = batches_of()
    if same_model:
        wrong = [a for a in arm_names if a not in SAME_MODEL_ARMS]
        if wrong:
            shareable = ", ".join(sorted(SAME_MODEL_ARMS))
            raise SystemExit(f"one shared model takes the arms {shareable}, not {', '.join(wrong)}")
        model = copy.deepcopy(base)
        arms = [ARMS[a](a, model, batches, model_name in SGD_MODELS) for a in arm_names]
        for a in arms:
            a.opt = arms[0].opt
            a.shared = True
    else:
        arms = [ARMS[a](a, copy.deepcopy(base), batches, model_name in SGD_MODELS) for a in arm_names]
    for a in arms:
        a.enter()
    try:
        for _ in range(warmup):
            for a in arms:
                a.block(1, record=False)
        # The arms' order is shuffled (seeded) each turn: what a step leaves behind (a slow
        # arm's caches, detect_anomaly's) then lands on every arm alike, not on a fixed successor.
        rng = random.Random(1)
        order = list(range(len(arms)))
        for _ in range(rounds):
            if interleave == "block":
                rng.shuffle(order)
                for i in order:
                    arms[i].block(block, record=True)
                continue
            spent = [0.0] * len(arms)
            for _ in range(block):
                rng.shuffle(order)
                for i in order:
                    spent[i] += arms[i].block(1, record=False)
            for a, t in zip(arms, spent):
                a.times.append(t)
    finally:
        for a in arms:
            a.exit()
    med = {a.name: statistics.median(a.times) / block for a in arms}
    plain = next(a for a in arms if a.name == "plain").times
    ratio: Dict[str, float] = {}
    interval: Dict[str, List[float]] = {}
    for a in arms:
        mid, lo, hi = paired(a.times, plain)
        ratio[a.name] = round(mid, 3)
        interval[a.name] = [round(lo, 3), round(hi, 3)]
    if "compiled" in med and "compiled+neuraldbg" in med:
        # What watching costs a compiled model: against the same compiled model unwatched.
        times = {a.name: a.times for a in arms}
        mid, lo, hi = paired(times["compiled+neuraldbg"], times["compiled"])
        ratio["compiled+neuraldbg vs compiled"] = round(mid, 3)
        interval["compiled+neuraldbg vs compiled"] = [round(lo, 3), round(hi, 3)]
    return {
        "model": model_name,
        "step_ms": {n: round(v * 1e3, 3) for n, v in med.items()},
        "ratio": ratio,
        "interval": interval,
        "rounds": rounds,
        "block": block,
        "same_model": same_model,
        "interleave": interleave,
    }


# ----------------------------------------------------------------------------- legacy worker


def legacy_python(path: Optional[str]) -> Optional[str]:
    candidates = [path] if path else [os.path.join(ROOT, ".bench-venv", "bin", "python")]
    for c in candidates:
        if c and os.path.exists(c):
            return os.path.abspath(c)  # the worker runs in a scratch directory
    return None


def run_legacy(python: str, model: str, rounds: int, block: int, warmup: int, interleave: str) -> Dict[str, object]:
    # 1.3.2 writes a tensor cache directory into the working directory: give it a scratch one.
    with tempfile.TemporaryDirectory() as tmp:
        out = subprocess.run(
            [
                python,
                os.path.abspath(__file__),
                "--worker",
                "--models",
                model,
                "--arms",
                "plain,1.3.2",
                "--clock",
                "thread" if CLOCK is time.thread_time else "wall",
                "--interleave",
                interleave,
                "--rounds",
                str(rounds),
                "--block",
                str(block),
                "--warmup",
                str(warmup),
            ],
            cwd=tmp,
            capture_output=True,
            text=True,
            check=False,
        )
    if out.returncode != 0:
        raise RuntimeError(f"1.3.2 worker failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ----------------------------------------------------------------------------- report


def machine() -> str:
    cpu = platform.processor() or "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    return f"{cpu}, {os.cpu_count()} logical CPUs, torch {torch.__version__}, Python {platform.python_version()}"


COLUMNS = ["A/A", "floor", "neuraldbg", "anomaly", "1.3.2"]


def table(results: List[Dict[str, object]]) -> str:
    head = f"| model | plain step | {' | '.join(COLUMNS)} |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 2)]
    for r in results:
        ratio, interval = r["ratio"], r["interval"]  # type: ignore[index]
        cells = [
            f"{ratio[c]:.3f}x [{interval[c][0]:.3f}-{interval[c][1]:.3f}]" if c in ratio else "n/a"  # type: ignore[index]
            for c in COLUMNS
        ]
        step = r["step_ms"]["plain"]  # type: ignore[index]
        lines.append(f"| {r['model']} | {step:.2f} ms | {' | '.join(cells)} |")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma-separated, from {', '.join(MODELS)}")
    ap.add_argument("--arms", default=DEFAULT_ARMS, help="in-process arms")
    ap.add_argument("--rounds", type=int, default=0, help="rounds per model (0: the model's default)")
    ap.add_argument("--block", type=int, default=10, help="steps per arm per round")
    ap.add_argument("--warmup", type=int, default=20, help="steps per arm before timing")
    ap.add_argument("--legacy-python", default=None, help="python of the virtualenv holding neuraldbg==1.3.2")
    ap.add_argument("--no-legacy", action="store_true", help="skip the 1.3.2 arm")
    ap.add_argument(
        "--clock",
        choices=("thread", "wall"),
        default="thread",
        help="thread CPU time (default; robust on a shared machine) or wall time",
    )
    ap.add_argument("--options", default="{}", help="JSON keyword options for NeuralDbg (ablations)")
    ap.add_argument("--json", default=None, help="also write the results here")
    ap.add_argument(
        "--no-view",
        action="store_true",
        help="ablation: hide torch's DLPack exchange API, so the reader takes a _to_dlpack capsule a tensor",
    )
    ap.add_argument(
        "--separate-models",
        action="store_true",
        help="every arm trains its own copy of the model (the default, when every arm can, is one shared instance: "
        "the unwatched arms' steps run with NeuralDBG's hooks put aside)",
    )
    ap.add_argument(
        "--interleave",
        choices=("step", "block"),
        default="step",
        help="within a round, the arms take turns step by step (default) or block by block",
    )
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    Ours.options = json.loads(args.options)
    if args.no_view and hasattr(torch.Tensor, "__dlpack_c_exchange_api__"):
        delattr(torch.Tensor, "__dlpack_c_exchange_api__")  # (before NeuralDBG makes its reader)
    global CLOCK
    CLOCK = time.thread_time if args.clock == "thread" else time.perf_counter
    models = [m for m in args.models.split(",") if m]
    arms = [a for a in args.arms.split(",") if a]
    if "plain" not in arms:
        arms.insert(0, "plain")

    same = not args.separate_models and all(a in SAME_MODEL_ARMS for a in arms)
    if args.worker:
        for m in models:
            r = measure(m, arms, args.rounds or MODELS[m][3], args.block, args.warmup, same, args.interleave)
            print(json.dumps(r), flush=True)
        return 0

    legacy = None if args.no_legacy else legacy_python(args.legacy_python)
    if not args.no_legacy and legacy is None:
        print("note: no .bench-venv/bin/python: the 1.3.2 column is skipped (make bench creates it)", file=sys.stderr)
    results = []
    for m in models:
        rounds = args.rounds or MODELS[m][3]
        t0 = time.perf_counter()
        skipped = SKIPPED_BY_DEFAULT.get(m, set()) if args.arms == DEFAULT_ARMS else set()
        r = measure(m, [a for a in arms if a not in skipped], rounds, args.block, args.warmup, same, args.interleave)
        if legacy is not None:
            lr = run_legacy(legacy, m, rounds, args.block, args.warmup, args.interleave)
            r["ratio"]["1.3.2"] = lr["ratio"]["1.3.2"]  # type: ignore[index]
            r["interval"]["1.3.2"] = lr["interval"]["1.3.2"]  # type: ignore[index]
            r["step_ms"]["1.3.2"] = lr["step_ms"]["1.3.2"]  # type: ignore[index]
            r["step_ms"]["plain (1.3.2 worker)"] = lr["step_ms"]["plain"]  # type: ignore[index]
        r["seconds"] = round(time.perf_counter() - t0, 1)
        results.append(r)
        print(f"{m}: {MODELS[m][0]}: {json.dumps(r['ratio'])} ({r['seconds']}s)", file=sys.stderr, flush=True)

    print()
    turns = "step by step" if args.interleave == "step" else "block by block"
    print(
        f"Overhead: median over rounds of (arm's round time / plain's round time), [95% bootstrap interval]; "
        f"a round: {args.block} steps of each arm, interleaved {turns}, "
        f"{'one shared model instance' if same else 'a model copy per arm'}, "
        f"{'thread CPU' if args.clock == 'thread' else 'wall'} time"
    )
    print(f"machine: {machine()}; torch.set_num_threads(1)")
    print()
    print(table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"machine": machine(), "results": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
