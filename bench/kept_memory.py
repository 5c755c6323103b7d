"""Bytes NeuralDBG keeps alive that autograd would not (issue 26), per step, on the CPU.

What a watched step keeps costs GPU memory: a tensor the collector still references when the
forward pass ends, or while backward runs, that autograd did not save is memory the unwatched
run would have freed. This counts, on a 6-layer ``nn.TransformerEncoder`` (d=256, 8 heads,
batch 16, sequence 128, training mode), every tensor the collector references (its kept module
calls, activation probes' outputs, the step waiting for the host, summaries, inputs) at the
end of each forward pass (when the loss exists) and right after backward, whose storage is not
among the tensors autograd saved for backward (seen by ``saved_tensors_hooks``). Both code
paths: the host path (a CPU model) and the CUDA path's CPU stand-in
(``NEURALDBG_DEVICE_PATH=deferred``). Target: at most 5% of what autograd saves.

    .venv/bin/python bench/kept_memory.py [--steps 12] [--layers 6]
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Any, Dict, List, Set

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "python"))

import torch
import torch.nn as nn


def storages(obj: Any, out: Dict[int, int], depth: int = 0) -> None:
    """Each tensor storage inside ``obj`` (by data pointer) and its bytes."""
    if isinstance(obj, torch.Tensor):
        if obj.device.type != "meta" and obj.numel():
            s = obj.untyped_storage()
            out[s.data_ptr()] = s.nbytes()
    elif depth < 4 and isinstance(obj, (list, tuple)):
        for o in obj:
            storages(o, out, depth + 1)
    elif depth < 4 and isinstance(obj, dict):
        for o in obj.values():
            storages(o, out, depth + 1)


def held(c: Any) -> Dict[int, int]:
    """What the collector references now."""
    out: Dict[int, int] = {}
    storages(list(c.refs), out)
    storages(list(c.act_out), out)
    storages(list(c.out_kept), out)
    storages(list(c.inputs), out)
    storages(list(c.raw_inputs), out)
    storages(list(c.root_calls), out)
    storages(list(c.summaries.norms), out)
    if c.pending is not None:
        storages(list(c.pending.refs), out)
    return out


def run(path: str, steps: int, layers: int) -> Dict[str, float]:
    from neuraldbg import NeuralDbg

    if path == "deferred":
        os.environ["NEURALDBG_DEVICE_PATH"] = "deferred"
    else:
        os.environ.pop("NEURALDBG_DEVICE_PATH", None)
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(256, 8, dim_feedforward=1024, dropout=0.1, batch_first=True)
    model = nn.Sequential(nn.TransformerEncoder(layer, layers, enable_nested_tensor=False), nn.Linear(256, 1))
    model.train()
    opt = torch.optim.Adam(model.parameters(), lr=1e-4)
    x = torch.randn(16, 128, 256)
    y = torch.randn(16, 128, 1)
    saved: Set[int] = set()
    saved_bytes: List[int] = []
    kept_forward: List[int] = []
    kept_backward: List[int] = []

    def pack(t: torch.Tensor) -> torch.Tensor:
        s = t.untyped_storage()
        if s.data_ptr() not in saved:
            saved.add(s.data_ptr())
            saved_bytes[-1] += s.nbytes()
        return t

    with NeuralDbg(model) as dbg:
        c = dbg._collector
        for _step in range(steps):
            saved.clear()
            saved_bytes.append(0)
            opt.zero_grad()
            with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                loss = nn.functional.mse_loss(model(x), y)
            extra = {p: b for p, b in held(c).items() if p not in saved and p != x.untyped_storage().data_ptr()}
            kept_forward.append(sum(extra.values()))
            loss.backward()
            extra = {p: b for p, b in held(c).items() if p not in saved and p != x.untyped_storage().data_ptr()}
            kept_backward.append(sum(extra.values()))
            opt.step()
        assert dbg.step == steps
    # Steps after the first (which learns the model with every module hooked).
    tail = slice(1, None)
    mean = lambda v: sum(v[tail]) / len(v[tail])  # noqa: E731
    return {
        "saved": mean(saved_bytes),
        "forward": mean(kept_forward),
        "backward": mean(kept_backward),
        "forward_max": max(kept_forward[tail]),
        "first_step": kept_forward[0],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--layers", type=int, default=6)
    args = ap.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    mb = lambda b: f"{b / 2**20:.1f} MB"  # noqa: E731
    print(f"{args.layers}-layer TransformerEncoder (d=256, batch 16, sequence 128), steps 2-{args.steps}:")
    print(
        "| path | autograd saves | kept at the loss | kept after backward | largest at the loss | first step at the loss |"
    )
    print("|---|---|---|---|---|---|")
    for path in ("host", "deferred"):
        r = run(path, args.steps, args.layers)
        share = r["forward"] / r["saved"] if r["saved"] else float("nan")
        print(
            f"| {path} | {mb(r['saved'])} | {mb(r['forward'])} ({share:.1%}) | {mb(r['backward'])} | "
            f"{mb(r['forward_max'])} | {mb(r['first_step'])} |"
        )


if __name__ == "__main__":
    main()
