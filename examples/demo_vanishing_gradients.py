"""The seed's demo: a deep Tanh network whose gradients vanish, monitored by NeuralDBG.

A 30-layer Tanh MLP with PyTorch's default initialization trains on a small synthetic
classification task. Nothing in the training loop mentions the debugger; after training,
``dbg.explain_failure()`` says what failed, where, from which step, why, and what to change.

Run it with ``make demo`` (sets everything up) or ``python examples/demo_vanishing_gradients.py``.
"""

from __future__ import annotations

import math
import os

import torch
import torch.nn as nn

from neuraldbg import NeuralDbg

DEPTH, WIDTH, CLASSES, STEPS = 30, 32, 4, 100


def make_model() -> nn.Sequential:
    layers: list[nn.Module] = [nn.Linear(16, WIDTH), nn.Tanh()]
    for _ in range(DEPTH - 1):
        layers += [nn.Linear(WIDTH, WIDTH), nn.Tanh()]
    layers.append(nn.Linear(WIDTH, CLASSES))
    return nn.Sequential(*layers)


def train_loader(steps: int, batch: int = 64):
    g = torch.Generator().manual_seed(0)
    teacher = torch.randn(16, CLASSES, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, 16, generator=g)
        yield x, (x @ teacher).argmax(dim=1)


def sparkline(values) -> str:
    """log10 gradient norms as a one-line bar chart."""
    bars = " ▁▂▃▄▅▆▇█"
    logs = [math.log10(v) if v > 0 else -12.0 for v in values]
    lo, hi = min(logs), max(logs)
    return "".join(bars[int((v - lo) / (hi - lo + 1e-12) * (len(bars) - 1))] for v in logs)


def main() -> None:
    torch.manual_seed(0)
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    criterion = nn.CrossEntropyLoss()

    os.makedirs("runs", exist_ok=True)
    with NeuralDbg(model, trace="runs/demo_vanishing_gradients.ndbg") as dbg:
        for _step, (x, y) in enumerate(train_loader(STEPS)):
            optimizer.zero_grad()
            output = model(x)
            loss = criterion(output, y)
            loss.backward()  # hooks observe here and at optimizer.step()
            optimizer.step()

    print(f"Trained {dbg.step} steps; final loss {loss.item():.3f} (chance level is {math.log(CLASSES):.3f}).")
    linears = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    first_norms = [dbg.history(name)[1][0] for name in linears]
    print("\nGradient norm per Linear layer at step 0 (input -> output, log scale):")
    print(f"  {sparkline(first_norms)}   {first_norms[0]:.1e} ... {first_norms[-1]:.1e}")

    events = dbg.events
    print(f"\n{len(events)} semantic events (transitions only), the first few:")
    for e in events[:5]:
        print(f"  {e}")

    print("\nDiagnosis (most likely first):")
    hypotheses = dbg.explain_failure()
    for h in hypotheses[:3]:
        print(f"  {h}")
    top = hypotheses[0]
    print("\nCausal chain:")
    for line in top.causal_chain:
        print(f"  - {line}")
    print("What to change:")
    for r in top.remedies:
        print(f"  - {r}")
    print("\nCausal graph (Mermaid):")
    print(dbg.export_mermaid_causal_graph())

    dbg.save_report("runs/demo_vanishing_gradients.html")
    print("\nReport: runs/demo_vanishing_gradients.html (open it in a browser)")
    print("Trace:  runs/demo_vanishing_gradients.ndbg (try: neuraldbg explain runs/demo_vanishing_gradients.ndbg)")


if __name__ == "__main__":
    main()
