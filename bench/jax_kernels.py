"""Kernel counts of the optimized compiled step, plain vs watched (deterministic, no timing).

Counts the instructions of the ENTRY computation of the compiled HLO that launch work
(everything but parameter/constant/tuple/get-tuple-element/bitcast), by opcode, plus the
instructions inside conditional branches, and the bytes of the step's arguments. The models
and optimizer are ``bench/jax_overhead.py``'s; on a small step the kernel count is most of
what watching costs (BENCHMARKS.md, "JAX and Keras"). The JAX step is counted watched as the
bench times it (``learning_rate=`` given), with the batch as ``inputs=``, and without
``learning_rate=`` (``measured``: the step's size and direction read from weight and gradient
samples).

    .venv/bin/python bench/jax_kernels.py [jax|keras|all] [DUMP_PREFIX]
"""

from __future__ import annotations

import collections
import os
import re
import sys

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.jax_overhead import jax_mlp as nnx_mlp
from bench.jax_overhead import keras_mlp

FREE = {"parameter", "constant", "tuple", "get-tuple-element", "bitcast"}
INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?[\w.\-]+\s*=\s*(.+?)\s+([\w\-]+)\((.*)$")


def computations(text: str) -> dict:
    comps, name, body = {}, None, []
    for line in text.splitlines():
        m = re.match(r"^(ENTRY\s+)?%?([\w.\-]+)\s.*\{\s*$", line)
        if m and not line.startswith(" "):
            name = ("ENTRY:" if m.group(1) else "") + m.group(2)
            body = []
            continue
        if line.startswith("}"):
            if name:
                comps[name] = body
            name = None
            continue
        if name:
            body.append(line)
    return comps


def ops_of(lines):
    c = collections.Counter()
    for line in lines:
        m = INSTR.match(line)
        if m:
            op = m.group(2)
            if op not in FREE:
                c[op] += 1
    return c


def count(text: str) -> dict:
    comps = computations(text)
    entry = next(v for k, v in comps.items() if k.startswith("ENTRY:"))
    top = ops_of(entry)
    # instructions of conditional branches / while bodies (called from ENTRY)
    inner = collections.Counter()
    for line in entry:
        m = INSTR.match(line)
        if m and m.group(2) in ("conditional", "while"):
            for callee in re.findall(
                r"(?:branch_computations=\{|true_computation=|false_computation=|body=|condition=)([^,}]+(?:,\s*%[^,}]+)*)",
                line,
            ):
                for c in re.findall(r"%?([\w.\-]+)", callee):
                    if c in comps:
                        inner += ops_of(comps[c])
    return {"top": sum(top.values()), "ops": dict(top), "in_cond": sum(inner.values()), "cond_ops": dict(inner)}


def arg_bytes(args) -> int:
    import jax

    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(args) if hasattr(x, "shape"))


def show(label, text, args):
    r = count(text)
    ops = " ".join(f"{k}={v}" for k, v in sorted(r["ops"].items()))
    cond = " ".join(f"{k}={v}" for k, v in sorted(r["cond_ops"].items()))
    print(
        f"{label:<22} kernels {r['top']:3d}  [{ops}]  in cond/while {r['in_cond']} [{cond}]  args {arg_bytes(args)} B"
    )
    return r


def jax_mlp(width: int, depth: int, batch: int, dump: str = "") -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from neuraldbg.jax import NeuralDbg

    MLP, loss_fn = nnx_mlp(width, depth)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, size=batch))

    def compiled(model, opt, inputs=False):
        # What nnx.jit compiles: the graph state in, the new state out, nothing donated.
        graphdef, state = nnx.split((model, opt))

        def f(state, x, y):
            m, o = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(m, x, y)
            o.update(m, grads, value=loss, **({"inputs": x} if inputs else {}))
            return loss, nnx.state((m, o))

        return jax.jit(f).lower(state, x, y).compile().as_text(), state

    text, state = compiled(MLP(nnx.Rngs(0)), None) if False else (None, None)
    m = MLP(nnx.Rngs(0))
    text, state = compiled(m, nnx.Optimizer(m, optax.adam(1e-3), wrt=nnx.Param))
    label = f"jax {depth + 2}x{width}"
    p = show(label + " plain", text, state)
    m = MLP(nnx.Rngs(0))
    with NeuralDbg(m) as dbg:
        wtext, wstate = compiled(m, nnx.Optimizer(m, dbg.wrap(optax.adam(1e-3), learning_rate=1e-3), wrt=nnx.Param))
    w = show(label + " watched", wtext, wstate)
    print(f"{label}: +{w['top'] - p['top']} kernels, +{arg_bytes(wstate) - arg_bytes(state)} B of state")
    m = MLP(nnx.Rngs(0))
    with NeuralDbg(m) as dbg:
        opt = nnx.Optimizer(m, dbg.wrap(optax.adam(1e-3), learning_rate=1e-3), wrt=nnx.Param)
        itext, _ = compiled(m, opt, inputs=True)
    i = show(label + " inputs=x", itext, wstate)
    print(f"{label}: the batch given as inputs= adds {i['top'] - w['top']} kernels to the watched step")
    m = MLP(nnx.Rngs(0))
    with NeuralDbg(m) as dbg:  # no learning_rate=: the step's size and direction are measured
        mtext, mstate = compiled(m, nnx.Optimizer(m, dbg.wrap(optax.adam(1e-3)), wrt=nnx.Param))
    s = show(label + " measured", mtext, mstate)
    print(
        f"{label}: without learning_rate= (the weights' and the gradient's samples) +{s['top'] - w['top']} kernels, "
        f"+{arg_bytes(mstate) - arg_bytes(wstate)} B of state over the watched step"
    )
    if dump:
        for kind, t in (("plain", text), ("watched", wtext)):
            with open(f"{dump}_{label.replace(' ', '_')}_{kind}.txt", "w") as f:
                f.write(t)


def keras_fit(width: int = 256, depth: int = 4, batch: int = 128, dump: str = "", activations: bool = True) -> None:
    import jax
    import keras

    from neuraldbg.keras import NeuralDbgCallback

    rng = np.random.default_rng(0)
    x = rng.normal(size=(batch, 64)).astype("float32")
    y = rng.integers(0, 10, size=batch)
    out = {}

    class Grab(keras.callbacks.Callback):
        def on_train_batch_begin(self, batch_, logs=None):
            if "text" in out:
                return
            model = self.model
            state = (
                [v.value for v in model.trainable_variables],
                [v.value for v in model.non_trainable_variables],
                [v.value for v in model.optimizer.variables],
                [v.value for v in model.metrics_variables],
            )
            data = (jax.numpy.asarray(x), jax.numpy.asarray(y))
            fn = jax.jit(model.train_step, donate_argnums=0)
            out["text"] = fn.lower(state, data).compile().as_text()
            out["state"] = state

    res = {}
    for kind in ("plain", "watched"):
        out.clear()
        model = keras_mlp(width, depth)
        cbs = [Grab()] if kind == "plain" else [NeuralDbgCallback(verbose=False, activations=activations), Grab()]
        model.fit(x, y, batch_size=batch, epochs=1, callbacks=cbs, verbose=0)
        res[kind] = show(f"keras {depth + 2}x{width} {kind}", out["text"], out["state"])
        res[kind + "_b"] = arg_bytes(out["state"])
        if dump:
            with open(f"{dump}_keras_{kind}.txt", "w") as f:
                f.write(out["text"])
    print(
        f"keras {depth + 2}x{width}: +{res['watched']['top'] - res['plain']['top']} kernels, "
        f"+{res['watched_b'] - res['plain_b']} B of state"
    )


if __name__ == "__main__":
    dump = sys.argv[2] if len(sys.argv) > 2 else ""
    what = sys.argv[1] if len(sys.argv) > 1 else "all"
    if what in ("all", "jax"):
        jax_mlp(64, 2, 32, dump)
        jax_mlp(256, 4, 128, dump)
    if what in ("all", "keras"):
        keras_fit(dump=dump)
