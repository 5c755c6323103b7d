"""Normal beginnings are not failures: a gradient that is zero or tiny at the first steps and
recovers while the loss falls (a LoRA adapter's `lora_A` behind its zero-initialised `lora_B`;
attention's query and key at initialization) gives no hypothesis at 0.5 or above.

Both models are plain torch (no peft or transformers download); each test first checks, from
torch itself, that the run really starts the way the case describes and then trains well.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, List, Tuple

import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# A frozen layer plus lora_B(lora_A(x)), lora_B zero-initialised as in peft.
from bench.corpus.bases import LoRALinear

from neuraldbg import NeuralDbg


def lora_task() -> Tuple[nn.Sequential, torch.Tensor, torch.Tensor]:
    """Two LoRA layers over frozen ones and a frozen head; the target is the same network with a
    low-rank change to its first layer (512 samples)."""
    torch.manual_seed(0)
    model = nn.Sequential(LoRALinear(16, 64), nn.ReLU(), LoRALinear(64, 64), nn.ReLU(), nn.Linear(64, 1))
    model[4].requires_grad_(False)
    with torch.no_grad():
        delta = torch.randn(64, 2) @ torch.randn(2, 16) * 0.2
        x = torch.randn(512, 16)
        h = torch.relu(F.linear(x, model[0].base.weight + delta, model[0].base.bias))
        y = model[4](torch.relu(model[2].base(h)))
    return model, x, y


def train_lora(
    task: Tuple[nn.Sequential, torch.Tensor, torch.Tensor],
    opt: torch.optim.Optimizer,
    steps: int,
    adapter: int,
    **sched: Any,
) -> Tuple[NeuralDbg, List[float], List[float], List[float]]:
    """Trains ``task``'s model by ``opt`` (``sched``: a ``lr_lambda`` for a ``LambdaLR``) on
    batches of 32, watched; returns the debugger, the losses, the gradient norm of layer
    ``adapter``'s ``lora_A`` and the learning rate at each step."""
    model, x, y = task
    warmup = torch.optim.lr_scheduler.LambdaLR(opt, **sched) if sched else None
    losses: List[float] = []
    a_grad: List[float] = []
    lrs: List[float] = []
    with NeuralDbg(model) as dbg:
        for step in range(steps):
            i = torch.arange(step * 32, step * 32 + 32) % 512
            opt.zero_grad()
            loss = F.mse_loss(model(x[i]), y[i])
            loss.backward()
            a_grad.append(float(model[adapter].lora_A.weight.grad.norm()))
            lrs.append(opt.param_groups[0]["lr"])
            opt.step()
            if warmup is not None:
                warmup.step()
            losses.append(float(loss.detach()))
    return dbg, losses, a_grad, lrs


def test_lora_fine_tuning_is_healthy() -> None:
    task = lora_task()
    opt = torch.optim.AdamW([p for p in task[0].parameters() if p.requires_grad], lr=3e-3)
    dbg, losses, a_grad, _ = train_lora(task, opt, 120, adapter=0)
    # The case as described: lora_A's gradient is exactly zero at step 0, nonzero from step 1,
    # and the loss falls.
    assert a_grad[0] == 0.0 and all(g > 0 for g in a_grad[1:]), a_grad[:5]
    assert sum(losses[-10:]) / 10 < 0.5 * sum(losses[:3]) / 3, (losses[:3], losses[-10:])
    hyps = dbg.explain_failure()
    assert not any(h.confidence >= 0.5 for h in hyps), hyps[:3]


def test_a_lora_beginning_prolonged_by_an_endless_warmup_is_the_learning_rates() -> None:
    """The same LoRA start under a learning-rate warmup far longer than the run (lr 5e-9
    rising by 5e-9 a step): `lora_B` moves so slowly that `lora_A`'s gradient stays below the
    vanishing threshold for more than the first 20 steps before it recovers. That is still the
    adapter's beginning, prolonged by steps measured far too small; the finding is the learning
    rate (before: `vanishing_gradients <- poor_initialization` above `loss_plateau <-
    learning_rate_too_low`)."""
    task = lora_task()
    opt = torch.optim.Adam([p for p in task[0].parameters() if p.requires_grad], lr=5e-3)
    dbg, _, a_grad, lrs = train_lora(task, opt, 150, adapter=2, lr_lambda=lambda step: (step + 1) / 1_000_000)
    # The case as described, from torch: the second adapter's lora_A gets (almost) no gradient
    # for more than 20 steps, then recovers; the rate is still rising at the end, below 1e-6.
    tiny = [g < 1e-6 for g in a_grad]
    assert all(tiny[:21]) and not any(tiny[-20:]), a_grad[:3] + a_grad[-3:]
    assert lrs[-1] > lrs[0] and lrs[-1] < 1e-6, (lrs[0], lrs[-1])
    hyps = dbg.explain_failure()
    top = hyps[0]
    assert (str(top.failure), str(top.cause)) == ("loss_plateau", "learning_rate_too_low"), hyps[:3]
    assert top.confidence >= 0.5 and "still rising at the end" in top.description, top
    assert all(str(h.failure) != "vanishing_gradients" or h.confidence < 0.3 for h in hyps), hyps[:3]


class SelfAttention(nn.Module):
    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.out = nn.Linear(d, d)
        self.norm = nn.LayerNorm(d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape

        def split(z: torch.Tensor) -> torch.Tensor:
            return z.view(b, t, self.heads, -1).transpose(1, 2)

        q, k, v = split(self.query(x)), split(self.key(x)), split(self.value(x))
        a = torch.softmax(q @ k.transpose(-1, -2) / math.sqrt(d // self.heads), -1)
        return self.norm(x + self.out((a @ v).transpose(1, 2).reshape(b, t, d)))


class TinyBert(nn.Module):
    """Two attention layers, a pooler and a classification head, every weight N(0, 0.02) as
    BERT initialises them."""

    def __init__(self, vocab: int = 20, d: int = 32, t: int = 12) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(t, d)
        self.ln = nn.LayerNorm(d)
        self.layer1 = SelfAttention(d, 2)
        self.ff = nn.Sequential(nn.Linear(d, 64), nn.GELU(), nn.Linear(64, d))
        self.layer2 = SelfAttention(d, 2)
        self.pooler = nn.Linear(d, d)
        self.dense = nn.Linear(d, d)
        self.classifier = nn.Linear(d, 2)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, 0.0, 0.02)
            if isinstance(m, nn.Linear):
                nn.init.zeros_(m.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.ln(self.embed(x) + self.pos.weight[: x.shape[1]])
        h = self.layer1(h)
        h = self.layer2(h + self.ff(h))
        return self.classifier(torch.tanh(self.dense(torch.tanh(self.pooler(h[:, 0])))))


def test_attention_at_initialization_is_healthy() -> None:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    xs = torch.randint(3, 20, (2000, 12), generator=g)
    ys = ((xs == 3).sum(1) > (xs == 4).sum(1)).long()
    model = TinyBert()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses, q_grad = [], []
    with NeuralDbg(model) as dbg:
        for _ in range(150):
            i = torch.randint(0, 2000, (32,), generator=g)
            opt.zero_grad()
            loss = F.cross_entropy(model(xs[i]), ys[i])
            loss.backward()
            q_grad.append(float(model.layer1.query.weight.grad.norm()))
            opt.step()
            losses.append(float(loss.detach()))
    # The case as described: the query's gradient starts under the vanishing threshold (1e-6),
    # is above it by step 10, and the model learns the task.
    assert q_grad[0] < 1e-6 and min(q_grad[10:]) > 1e-6, q_grad[:12]
    with torch.no_grad():
        acc = float((model(xs[:500]).argmax(1) == ys[:500]).float().mean())
    assert acc > 0.9 and sum(losses[-10:]) / 10 < 0.5 * losses[0], (acc, losses[0], losses[-10:])
    hyps = dbg.explain_failure()
    assert not any(h.confidence >= 0.5 for h in hyps), hyps[:3]
