"""What the JAX spoke's host side costs, on one watched model: its parts switched off between
rounds, so that every arm runs the same model, optimizer and compiled step (models created one
after another read apart by a few percent, BENCHMARKS.md).

Arms, each the same number of steps of a jitted flax nnx MLP step (Adam), rounds in a shuffled
order: ``plain`` (a second model, unwatched, its own ``nnx.jit``), and the watched model with
``0.1 s`` (the spoke as it is: lazy reading at ``READ_INTERVAL``, within half a ring),
``every-8`` (reading one state in 16, every 8 steps: the spoke before its reading interval),
``no-hook`` (the state's hook does nothing: the compiled measures and the state alone, nothing
read) and ``tuple`` (another model whose transformation only carries a ring of the same shape in
a tuple and writes a row of zeros into it: what one more state leaf costs). Each figure is the
median over rounds of the ratio to ``plain`` in the same round.

    .venv/bin/python bench/jax_reading.py [--width 64 --depth 2 --batch 32] [--rounds 30] [--steps 200]
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from typing import Any, Callable, Dict, List

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--width", type=int, default=64)
    ap.add_argument("--depth", type=int, default=2)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=200)
    args = ap.parse_args()

    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from jax_overhead import jax_mlp
    from neuraldbg._jax_stats import write_row
    from neuraldbg.jax import NeuralDbg

    MLP, loss_fn = jax_mlp(args.width, args.depth)

    def train_step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads, value=loss)
        return loss

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(args.batch, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, size=args.batch))

    plain_model = MLP(nnx.Rngs(0))
    plain = (plain_model, nnx.Optimizer(plain_model, optax.adam(1e-3), wrt=nnx.Param), nnx.jit(train_step))
    watched_model = MLP(nnx.Rngs(0))
    dbg = NeuralDbg(watched_model)
    dbg.__enter__()
    tx = dbg.wrap(optax.adam(1e-3), learning_rate=1e-3)
    watched = (watched_model, nnx.Optimizer(watched_model, tx, wrt=nnx.Param), nnx.jit(train_step))
    ring = dbg._rings[0]
    rows, width = ring.rows + 1, ring.width

    def carry(inner: Any) -> Any:
        def init(p: Any) -> Any:
            return (inner.init(p), jnp.zeros((rows, width), jnp.float32))

        def update(u: Any, s: Any, p: Any = None, **kw: Any) -> Any:
            new, state = inner.update(u, s[0], p)
            c = s[1][-1, 0].astype(jnp.int32)
            row = jnp.zeros((width,), jnp.float32)
            return new, (state, write_row(s[1], c % (rows - 1), row, {0: (c + 1).astype(jnp.float32)}))

        return optax.GradientTransformationExtraArgs(init, update)

    tuple_model = MLP(nnx.Rngs(0))
    carried = (tuple_model, nnx.Optimizer(tuple_model, carry(optax.adam(1e-3)), wrt=nnx.Param), nnx.jit(train_step))

    def switch(**attrs: Any) -> Callable[[], None]:
        return lambda: ring.__dict__.update(attrs)

    settings: Dict[str, Callable[[], None]] = {
        "0.1 s": switch(),
        "every-8": switch(max_every=16, every=16, interval=math.inf),
        "no-hook": switch(see=lambda leaf: None),
    }

    def restore() -> None:  # the class's reading (the interval, the cap, the hook)
        for name in ("max_every", "interval", "see"):
            ring.__dict__.pop(name, None)

    def timed(arm: Any) -> float:
        model, optimizer, fn = arm
        t = time.perf_counter()
        loss = None
        for _ in range(args.steps):
            loss = fn(model, optimizer, x, y)
        jax.block_until_ready(loss)
        return time.perf_counter() - t

    for model, optimizer, fn in (plain, watched, carried):
        for _ in range(20):  # compiles
            jax.block_until_ready(fn(model, optimizer, x, y))
    times: Dict[str, List[float]] = {k: [] for k in ["plain", *settings, "tuple"]}
    names = list(times)
    for _ in range(args.rounds):
        random.shuffle(names)
        for k in names:
            if k == "plain":
                times[k].append(timed(plain))
            elif k == "tuple":
                times[k].append(timed(carried))
            else:
                every = ring.every  # (the reading's own, which every-8 overrides)
                settings[k]()
                ring.newest()  # (what the setting before left unread)
                times[k].append(timed(watched))
                restore()
                ring.every = every
    ring.newest()
    observed = dbg.step
    dbg.__exit__(None, None, None)
    base = np.asarray(times["plain"])
    print(
        f"jax nnx MLP {args.depth + 2}x{args.width}, batch {args.batch}, {args.rounds} rounds of {args.steps} steps "
        f"(plain {np.median(base) / args.steps * 1e3:.3f} ms/step; watched model: {observed} steps observed)"
    )
    for k, v in times.items():
        r = np.asarray(v) / base
        print(f"  {k:8s} {np.median(v) / args.steps * 1e3:.3f} ms/step  ratio {np.median(r):.3f}x")


if __name__ == "__main__":
    main()
