"""PyTorch training programs as users write them, each trained unwatched and then watched from the
same seed: does ``NeuralDbg`` leave training as it was, count every optimizer step, take its hooks
away, and stay quiet?

``.venv/bin/python bench/torch_sweep.py [PROGRAM ...]`` prints one JSON line per program: the
largest difference between the final parameters of the two runs (0.0: identical to the bit), an
exception from either run, the ``NeuralDbgWarning`` messages, whether a hook was left on a module,
``dbg.step`` beside the optimizer steps taken, and the top hypothesis (healthy programs: none at
0.5 or above). Programs: activation checkpointing (both kinds), weight and spectral norm
parametrizations, a sparse embedding under SparseAdam, bf16 autocast, a channels-last CNN, a
param group added mid-run, ``zero_grad(set_to_none=False)``, a packed LSTM, a gradient penalty
(double backward), adversarial examples (input gradients, two backwards a step), experts not used
on every step, validation under ``no_grad`` and ``inference_mode``, float64 and float16 models,
fused Adam, a custom autograd function, a user's forward hook that changes the output, a
Transformer encoder with a padding mask, ``torch.func.functional_call``, steps skipped on a bad
loss, ``DataParallel`` on CPU, and a model compiled after another of its class was compiled
unwatched in the process. Not a test: what it found is one (BENCHMARKS.md, twenty-second session).
"""

from __future__ import annotations

import json
import sys
import traceback
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

from neuraldbg import NeuralDbg
from neuraldbg.errors import NeuralDbgWarning

P = {}


def program(f):
    P[f.__name__] = f
    return f


def data(n=128, d=16, c=4, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g)
    y = x[:, :c].argmax(1)
    return x, y


def mlp(d=16, h=32, c=4):
    return nn.Sequential(nn.Linear(d, h), nn.ReLU(), nn.Linear(h, h), nn.ReLU(), nn.Linear(h, c))


@program
def checkpoint_nonreentrant():
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
            s.b = nn.Sequential(nn.Linear(32, 32), nn.Tanh())
            s.o = nn.Linear(32, 4)

        def forward(s, x):
            return s.o(checkpoint(s.b, checkpoint(s.a, x, use_reentrant=False), use_reentrant=False))

    m = M()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def checkpoint_reentrant():
    from torch.utils.checkpoint import checkpoint

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = nn.Sequential(nn.Linear(16, 32), nn.ReLU())
            s.o = nn.Linear(32, 4)

        def forward(s, x):
            xx = x.requires_grad_(True)
            return s.o(checkpoint(s.a, xx, use_reentrant=True))

    m = M()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x.clone()), y), 20


@program
def weight_norm_param():
    from torch.nn.utils.parametrizations import weight_norm

    m = nn.Sequential(weight_norm(nn.Linear(16, 32)), nn.ReLU(), weight_norm(nn.Linear(32, 4)))
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def spectral_norm_param():
    from torch.nn.utils.parametrizations import spectral_norm

    m = nn.Sequential(spectral_norm(nn.Linear(16, 32)), nn.LeakyReLU(0.2), nn.Linear(32, 4))
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def sparse_embedding():
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.e = nn.Embedding(50, 8, sparse=True)
            s.o = nn.Linear(8, 4)

        def forward(s, t):
            return s.o(s.e(t).mean(1))

    m = M()
    o1 = torch.optim.SparseAdam(list(m.e.parameters()), 1e-2)
    o2 = torch.optim.Adam(m.o.parameters(), 1e-2)
    g = torch.Generator().manual_seed(1)
    t = torch.randint(0, 50, (64, 5), generator=g)
    y = t[:, 0] % 4

    class Both:
        param_groups = o1.param_groups + o2.param_groups

        def zero_grad(s):
            o1.zero_grad()
            o2.zero_grad()

        def step(s):
            o1.step()
            o2.step()

    return m, Both(), lambda: F.cross_entropy(m(t), y), 20


@program
def autocast_bf16():
    m = mlp()
    opt = torch.optim.AdamW(m.parameters(), 1e-2)
    x, y = data()

    def loss():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return F.cross_entropy(m(x), y)

    return m, opt, loss, 20


@program
def channels_last_cnn():
    m = nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.AdaptiveAvgPool2d(1),
        nn.Flatten(),
        nn.Linear(8, 4),
    ).to(memory_format=torch.channels_last)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 3, 8, 8, generator=g).to(memory_format=torch.channels_last)
    y = torch.arange(16) % 4
    opt = torch.optim.SGD(m.parameters(), 0.1, momentum=0.9, nesterov=True)
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def add_param_group_midrun():
    m = mlp()
    x, y = data()
    for p in m[0].parameters():
        p.requires_grad_(False)
    opt = torch.optim.Adam([p for p in m.parameters() if p.requires_grad], 1e-2)
    state = {"n": 0}

    def loss():
        state["n"] += 1
        if state["n"] == 10:
            for p in m[0].parameters():
                p.requires_grad_(True)
            opt.add_param_group({"params": list(m[0].parameters()), "lr": 1e-3})
        return F.cross_entropy(m(x), y)

    return m, opt, loss, 20


@program
def zero_grad_keep():
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), 0.1)
    x, y = data()
    opt.zero_grad = lambda set_to_none=False, _z=opt.zero_grad: _z(set_to_none=False)
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def packed_lstm():
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.r = nn.LSTM(4, 16, batch_first=True, num_layers=2)
            s.o = nn.Linear(16, 2)

        def forward(s, x, lens):
            p = nn.utils.rnn.pack_padded_sequence(x, lens, batch_first=True, enforce_sorted=False)
            _, (h, _) = s.r(p)
            return s.o(h[-1])

    g = torch.Generator().manual_seed(0)
    x = torch.randn(16, 7, 4, generator=g)
    lens = torch.randint(1, 8, (16,), generator=g)
    y = (x[:, 0, 0] > 0).long()
    m = M()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    return m, opt, lambda: F.cross_entropy(m(x, lens), y), 20


@program
def gradient_penalty():
    m = nn.Sequential(nn.Linear(16, 32), nn.LeakyReLU(0.2), nn.Linear(32, 1))
    x, _ = data()
    opt = torch.optim.Adam(m.parameters(), 1e-3, betas=(0.5, 0.9))

    def loss():
        xi = x.clone().requires_grad_(True)
        out = m(xi)
        (g,) = torch.autograd.grad(out.sum(), xi, create_graph=True)
        return out.mean() + 10 * ((g.norm(2, dim=1) - 1) ** 2).mean()

    return m, opt, loss, 20


@program
def fgsm_adversarial():
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), 0.05)
    x, y = data()

    def loss():
        xi = x.clone().requires_grad_(True)
        l0 = F.cross_entropy(m(xi), y)
        (gx,) = torch.autograd.grad(l0, xi)
        xa = (x + 0.1 * gx.sign()).detach()
        return F.cross_entropy(m(xa), y)

    return m, opt, loss, 20


@program
def fgsm_backward_twice():
    m = mlp()
    opt = torch.optim.SGD(m.parameters(), 0.05)
    x, y = data()

    def loss():
        xi = x.clone().requires_grad_(True)
        F.cross_entropy(m(xi), y).backward()  # grads also land in params; user zero_grads after
        xa = (x + 0.1 * xi.grad.sign()).detach()
        opt.zero_grad()
        return F.cross_entropy(m(xa), y)

    return m, opt, loss, 20


@program
def moe_routing_unused_params():
    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.inp = nn.Linear(16, 32)
            s.ex = nn.ModuleList([nn.Linear(32, 32) for _ in range(3)])
            s.o = nn.Linear(32, 4)
            s.k = 0

        def forward(s, x):
            s.k += 1
            return s.o(F.relu(s.ex[s.k % 2](F.relu(s.inp(x)))))

    m = M()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def validation_no_grad_and_inference():
    m = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.Dropout(0.1), nn.ReLU(), nn.Linear(32, 4))
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    state = {"n": 0}

    def loss():
        state["n"] += 1
        if state["n"] % 5 == 0:
            m.eval()
            with torch.no_grad():
                m(x)
            with torch.inference_mode():
                m(x)
            m.train()
        return F.cross_entropy(m(x), y)

    return m, opt, loss, 20


@program
def float64_model():
    m = mlp().double()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x.double()), y), 20


@program
def fused_adam():
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-2, fused=True)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def custom_autograd_fn():
    class Clip(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.save_for_backward(x)
            return x.clamp(-1, 1)

        @staticmethod
        def backward(ctx, g):
            (x,) = ctx.saved_tensors
            return g * (x.abs() < 1)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.a = nn.Linear(16, 32)
            s.o = nn.Linear(32, 4)

        def forward(s, x):
            return s.o(Clip.apply(s.a(x)))

    m = M()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def user_forward_hook_modifies_output():
    m = mlp()
    m[1].register_forward_hook(lambda mod, i, o: o * 0.5)
    x, y = data()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def transformer_encoder():
    layer = nn.TransformerEncoderLayer(16, 2, 32, dropout=0.0, batch_first=True)

    class M(nn.Module):
        def __init__(s):
            super().__init__()
            s.enc = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
            s.o = nn.Linear(16, 4)

        def forward(s, x, mask):
            return s.o(s.enc(x, src_key_padding_mask=mask).mean(1))

    g = torch.Generator().manual_seed(0)
    x = torch.randn(8, 6, 16, generator=g)
    mask = torch.zeros(8, 6, dtype=torch.bool)
    mask[:, 4:] = True
    y = torch.arange(8) % 4
    m = M()
    opt = torch.optim.Adam(m.parameters(), 1e-3)
    return m, opt, lambda: F.cross_entropy(m(x, mask), y), 20


@program
def functional_call_loop():
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    from torch.func import functional_call

    return m, opt, lambda: F.cross_entropy(functional_call(m, dict(m.named_parameters()), (x,)), y), 20


@program
def skip_step_on_bad_loss():
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    state = {"n": 0}

    def loss():
        state["n"] += 1
        value = F.cross_entropy(m(x), y)
        return value * (float("nan") if state["n"] in (5, 6) else 1.0)

    return m, opt, loss, 20


@program
def dataparallel_cpu():
    m = nn.DataParallel(mlp())
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x), y), 20


@program
def half_cpu():
    m = mlp().half()
    opt = torch.optim.SGD(m.parameters(), 0.05)
    x, y = data()
    return m, opt, lambda: F.cross_entropy(m(x.half()).float(), y), 20


@program
def model_compiled_inner():
    m = mlp()
    opt = torch.optim.Adam(m.parameters(), 1e-2)
    x, y = data()
    cm = torch.compile(m, backend="eager")
    return m, opt, lambda: F.cross_entropy(cm(x), y), 20


def train(name, watched):
    torch.manual_seed(0)
    m, opt, loss_fn, steps = P[name]()
    hooks_before = {
        k: (len(mod._forward_hooks), len(mod._forward_pre_hooks), len(mod._backward_hooks))
        for k, mod in m.named_modules()
    }
    ws = []
    dbg = None
    err = None
    steps_done = 0

    def loop():
        nonlocal steps_done
        for _ in range(steps):
            opt.zero_grad()
            loss = loss_fn()
            if not torch.isfinite(loss):
                continue
            loss.backward()
            opt.step()
            steps_done += 1

    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        try:
            if watched:
                with NeuralDbg(m) as dbg:
                    loop()
            else:
                loop()
        except Exception as e:
            err = "".join(traceback.format_exception_only(type(e), e)).strip()
        ws = [
            str(x.message)[:200]
            for x in w
            if issubclass(x.category, NeuralDbgWarning) or "neuraldbg" in str(x.filename).lower()
        ]
    hooks_after = {
        k: (len(mod._forward_hooks), len(mod._forward_pre_hooks), len(mod._backward_hooks))
        for k, mod in m.named_modules()
    }
    params = [p.detach().clone().float() for p in m.parameters()]
    top = None
    if dbg is not None:
        try:
            hs = dbg.explain_failure()
            top = f"{hs[0].failure}/{hs[0].cause} {hs[0].confidence:.2f}" if hs else None
        except Exception as e:
            top = f"explain raised {e!r}"
    return dict(
        params=params,
        err=err,
        warns=ws,
        hooks_left=hooks_before != hooks_after,
        step=(dbg.step if dbg else None),
        done=steps_done,
        top=top,
    )


def main() -> None:
    names = sys.argv[1:] or list(P)
    for name in names:
        try:
            a = train(name, False)
            b = train(name, True)
        except Exception as e:
            print(json.dumps({"program": name, "setup_error": repr(e)}))
            continue
        diff = max((float((p - q).abs().max()) for p, q in zip(a["params"], b["params"])), default=0.0)
        print(
            json.dumps(
                {
                    "program": name,
                    "diff": diff,
                    "plain_err": a["err"],
                    "err": b["err"],
                    "warns": b["warns"],
                    "hooks_left": b["hooks_left"],
                    "step": b["step"],
                    "done": b["done"],
                    "top": b["top"],
                }
            ),
            flush=True,
        )


if __name__ == "__main__":
    main()
