"""A compiled train step alone, plain vs watched: timed on one XLA thread, or profiled by kernel.
Keras (``keras``, default) or a flax nnx step (``jax``).

``bench/jax_overhead.py`` times whole ``fit`` epochs, where the fit loop, the callbacks and the
VM's noise move a 4 ms step by more than watching costs (BENCHMARKS.md: +-8% intervals after 40
rounds). This script takes the step ``fit`` compiles (``model.train_step`` under ``jax.jit``
with the state donated, traced with the callback's wrapping in place), and calls it directly on
one batch, so that only the compiled step is compared. XLA runs on one thread
(``--xla_cpu_multi_thread_eigen=false``; ``--default-threads``: XLA's own, as ``fit`` runs
it); rounds of ``--steps`` calls alternate between the arms (reversed every other round),
each ending with ``block_until_ready``, timed by the process's CPU time (and by wall time
beside it). Arms: ``plain``, ``A/A`` (a second plain model), ``watched``
(``NeuralDbgCallback()``), ``no-act`` (``activations=False``: gradient and parameter norms only),
and the ``--ablations`` asked for, each the callback with its statistics cut down (``rings``:
the rings written with nothing measured; ``squares``: the gradients' sums of squares as
``sum(g * g)`` and nothing else; ``abs-squares``: the same as ``sum(|g| * |g|)``).

``jax``: the bench's nnx MLP and Adam under ``jax.jit`` with the state donated (as ``nnx.jit``
with ``donate_argnums``), plain, ``A/A``, ``watched`` (``dbg.wrap``), ``inputs=x`` (watched, the
batch given to the update as ``inputs=``), and one watched arm per
``--small-leaf N`` (``_jax_stats.SMALL_LEAF`` set to N while it traces: leaves up to N elements
have their squares reduced together, larger ones alone).

``--profile`` instead records ``--steps`` calls of each arm with ``jax.profiler`` and prints the
time per step of each kind of kernel (numbered names merged: ``wrapped_multiply.8`` counts as
``wrapped_multiply``), to show where the watched step's extra time goes.

    .venv/bin/python bench/compiled_step.py [keras|jax] [--rounds 30] [--steps 100] [--profile]
        [--ablations rings,squares,abs-squares] [--small-leaf 16384,65536] [--width 256 --depth 4 --batch 128]
        [--default-threads]
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os
import re
import sys
import tempfile
import time
from typing import Any, Dict, List

os.environ.setdefault("KERAS_BACKEND", "jax")
if "--default-threads" not in sys.argv:
    os.environ["XLA_FLAGS"] = (
        os.environ.get("XLA_FLAGS", "") + " --xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1"
    ).strip()

import numpy as np

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.jax_overhead import interval, keras_mlp


class Arm:
    """One model's compiled train step, its state and one batch."""

    def __init__(self, width: int, depth: int, batch: int, callback: Any = None) -> None:
        import jax
        import keras

        rng = np.random.default_rng(0)
        x = rng.normal(size=(batch * 2, 64)).astype("float32")
        y = rng.integers(0, 10, size=batch * 2)
        self.data = (jax.numpy.asarray(x[:batch]), jax.numpy.asarray(y[:batch]))
        arm = self

        class Grab(keras.callbacks.Callback):
            """Compiles the step as fit traces it (after the callbacks' on_train_begin)."""

            def on_train_batch_begin(self, b: int, logs: Any = None) -> None:
                if hasattr(arm, "step"):
                    return
                m = self.model
                state = (
                    [v.value for v in m.trainable_variables],
                    [v.value for v in m.non_trainable_variables],
                    [v.value for v in m.optimizer.variables],
                    [v.value for v in m.metrics_variables],
                )
                # fit donates the state at its first step: keep a copy to run on.
                arm.state = jax.tree.map(lambda a: jax.numpy.array(a, copy=True), state)
                arm.step = jax.jit(m.train_step, donate_argnums=0).lower(state, arm.data).compile()

        self.model = keras_mlp(width, depth)
        callbacks = [Grab()] if callback is None else [callback, Grab()]
        self.model.fit(x, y, batch_size=batch, epochs=1, callbacks=callbacks, verbose=0)
        self.run(5)

    def run(self, steps: int) -> None:
        import jax

        state = self.state
        for _ in range(steps):
            _, state = self.step(state, self.data)
        jax.block_until_ready(state)
        self.state = state


def _ablation(square: Any) -> Any:
    """A stand-in for ``KerasDbg._observe`` that writes the ring row with the gradients' sums of
    squares only (``square(g)``, or nothing when None): no parameter norms, no ``cond``."""
    from keras import ops

    def observe(self: Any, grads: Any, variables: Any) -> None:
        step = ops.cast(ops.convert_to_tensor(self._optimizer.iterations), "int32")
        n = len(self._model.entries)
        none = ops.full((n,), -1.0, dtype="float32")
        gn = none if square is None else ops.sqrt(ops.stack([ops.sum(square(g)) for g in list(grads)[:n]]))
        self._write_ring(step, step + 1, gn, none, ops.cast(self._optimizer.learning_rate, "float32"))

    return observe


# What ``--ablations`` can add, each traced with the callback's `_observe` replaced (activations off).
ABLATIONS = {
    "rings": lambda: _ablation(None),
    "squares": lambda: _ablation(lambda g: g * g),
    "abs-squares": lambda: _ablation(lambda g: abs(g) * abs(g)),
}


# What ``--ablations`` can also add: the full callback with one of its measures left out (the
# method that builds it replaced by a no-op while the arm's step is traced).
WITHOUT = {
    "no-first-batch": ("_first_batch", lambda self, x, y, y_pred: None),
}


def arms(width: int, depth: int, batch: int, ablations: List[str]) -> Dict[str, Arm]:
    from neuraldbg.keras import KerasDbg, NeuralDbgCallback

    out = {
        "plain": Arm(width, depth, batch),
        "A/A": Arm(width, depth, batch),
        "watched": Arm(width, depth, batch, NeuralDbgCallback(verbose=False)),
        "no-act": Arm(width, depth, batch, NeuralDbgCallback(verbose=False, activations=False)),
    }
    observe = KerasDbg._observe
    for name in ablations:
        if name in WITHOUT:
            attr, stand_in = WITHOUT[name]
            kept = getattr(KerasDbg, attr)
            setattr(KerasDbg, attr, stand_in)
            try:
                out[name] = Arm(width, depth, batch, NeuralDbgCallback(verbose=False))
            finally:
                setattr(KerasDbg, attr, kept)
            continue
        KerasDbg._observe = ABLATIONS[name]()  # type: ignore[method-assign]
        try:
            out[name] = Arm(width, depth, batch, NeuralDbgCallback(verbose=False, activations=False))
        finally:
            KerasDbg._observe = observe  # type: ignore[method-assign]
    return out


class JaxArm:
    """One nnx model's compiled step (``dbg.wrap`` around Adam when watched), its state, one batch."""

    def __init__(
        self, width: int, depth: int, batch: int, watched: bool, small_leaf: int = 0, inputs: bool = False
    ) -> None:
        import jax
        import optax
        from flax import nnx

        import neuraldbg._jax_stats as stats
        from bench.jax_overhead import jax_mlp
        from neuraldbg.jax import NeuralDbg

        mlp, loss_fn = jax_mlp(width, depth)
        rng = np.random.default_rng(0)
        self.data = (
            jax.numpy.asarray(rng.normal(size=(batch, 64)), jax.numpy.float32),
            jax.numpy.asarray(rng.integers(0, 10, size=batch)),
        )
        model = mlp(nnx.Rngs(0))
        tx = optax.adam(1e-3)
        if watched:
            self.dbg = NeuralDbg(model).__enter__()  # open for the whole benchmark
            tx = self.dbg.wrap(tx, learning_rate=1e-3)
        graphdef, state = nnx.split((model, nnx.Optimizer(model, tx, wrt=nnx.Param)))

        def step(state: Any, x: Any, y: Any) -> Any:
            m, o = nnx.merge(graphdef, state)
            loss, grads = nnx.value_and_grad(loss_fn)(m, x, y)
            o.update(m, grads, value=loss, **({"inputs": x} if inputs else {}))
            return loss, nnx.state((m, o))

        default = stats.SMALL_LEAF
        stats.SMALL_LEAF = small_leaf or default
        try:
            self.step = jax.jit(step, donate_argnums=0).lower(state, *self.data).compile()
        finally:
            stats.SMALL_LEAF = default
        self.state = jax.tree.map(lambda a: jax.numpy.array(a, copy=True), state)
        self.run(5)

    def run(self, steps: int) -> None:
        import jax

        state = self.state
        for _ in range(steps):
            _, state = self.step(state, *self.data)
        jax.block_until_ready(state)
        self.state = state


def jax_arms(width: int, depth: int, batch: int, small_leaves: List[int]) -> Dict[str, Any]:
    out: Dict[str, Any] = {
        "plain": JaxArm(width, depth, batch, False),
        "A/A": JaxArm(width, depth, batch, False),
        "watched": JaxArm(width, depth, batch, True),
        "inputs=x": JaxArm(width, depth, batch, True, inputs=True),
    }
    for n in small_leaves:
        out[f"leaf<={n}"] = JaxArm(width, depth, batch, True, n)
    return out


def timed(all_arms: Dict[str, Any], rounds: int, steps: int) -> None:
    """Each arm's step by the process's CPU time (every thread: XLA's and the Python caller's)
    and by wall time, as ratios to ``plain`` (medians of the rounds, 95% intervals)."""
    names = list(all_arms)
    cpu: Dict[str, List[float]] = {k: [] for k in names}
    wall: Dict[str, List[float]] = {k: [] for k in names}
    for r in range(rounds):
        for k in names if r % 2 == 0 else names[::-1]:
            t, w = time.process_time(), time.perf_counter()
            all_arms[k].run(steps)
            cpu[k].append((time.process_time() - t) / steps)
            wall[k].append((time.perf_counter() - w) / steps)
    print(f"{'arm':14} {'step (CPU)':>11}  ratio to plain [95% interval]   {'step (wall)':>11}  ratio to plain")
    for k in names:
        med, lo, hi = interval(list(np.asarray(cpu[k]) / np.asarray(cpu["plain"])))
        wmed, wlo, whi = interval(list(np.asarray(wall[k]) / np.asarray(wall["plain"])))
        print(
            f"{k:14} {np.median(cpu[k]) * 1e3:8.3f} ms  {med:.3f}x [{lo:.3f}, {hi:.3f}]   "
            f"{np.median(wall[k]) * 1e3:8.3f} ms  {wmed:.3f}x [{wlo:.3f}, {whi:.3f}]"
        )


def profiled(all_arms: Dict[str, Any], steps: int) -> None:
    import jax

    by_arm: Dict[str, collections.Counter] = {}
    for k, arm in all_arms.items():
        arm.run(20)
        with tempfile.TemporaryDirectory() as d:
            jax.profiler.start_trace(d, create_perfetto_trace=True)
            arm.run(steps)
            jax.profiler.stop_trace()
            path = sorted(glob.glob(os.path.join(d, "**", "*.trace.json.gz"), recursive=True))[-1]
            with gzip.open(path) as f:
                events = json.load(f)["traceEvents"]
        kinds: collections.Counter = collections.Counter()
        for e in events:
            name = e.get("name", "")
            # Kernels only: the runtime's own spans have spaces, colons or parentheses.
            if e.get("ph") == "X" and not re.search(r"[ :()$]", name):
                kinds[re.sub(r"\.\d+$", "", name)] += e.get("dur", 0) / steps
        by_arm[k] = kinds
    names = list(all_arms)
    kinds = sorted(set().union(*by_arm.values()), key=lambda p: -max(c[p] for c in by_arm.values()))
    print(f"{'kernel kind (us per step)':34}" + "".join(f"{k:>10}" for k in names))
    print(f"{'all kernels':34}" + "".join(f"{sum(by_arm[k].values()):10.0f}" for k in names))
    for p in kinds[:25]:
        print(f"{p[:34]:34}" + "".join(f"{by_arm[k][p]:10.0f}" for k in names))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("framework", nargs="?", choices=("keras", "jax"), default="keras")
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--width", type=int, default=256)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--profile", action="store_true", help="kernel time by kind instead of timing")
    ap.add_argument("--ablations", default="", help=f"comma-separated, of: {', '.join([*ABLATIONS, *WITHOUT])}")
    ap.add_argument("--small-leaf", default="", help="jax: comma-separated SMALL_LEAF values, one watched arm each")
    ap.add_argument("--default-threads", action="store_true", help="XLA's default threads (read before jax loads)")
    a = ap.parse_args()
    if a.framework == "jax":
        all_arms = jax_arms(a.width, a.depth, a.batch, [int(n) for n in a.small_leaf.split(",") if n])
    else:
        all_arms = arms(a.width, a.depth, a.batch, [x for x in a.ablations.split(",") if x])
    threads = "XLA's default threads" if a.default_threads else "one XLA thread"
    print(f"{a.framework} {a.depth + 2}x{a.width}, batch {a.batch}, the compiled step on {threads}")
    if a.profile:
        profiled(all_arms, a.steps)
    else:
        timed(all_arms, a.rounds, a.steps)


if __name__ == "__main__":
    main()
