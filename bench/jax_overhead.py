"""What watching costs in JAX and Keras: a jitted flax nnx MLP step (``dbg.wrap(optax.adam)``) and
a Keras 3 ``fit`` on the JAX backend (``NeuralDbgCallback``), each against the same thing
unwatched, in the same process.

JAX: copies of one model, one optimizer plain and others wrapped (their debuggers open for the
whole run; ``read-each`` reads the ring at every state rather than lazily; ``wait-read`` reads
lazily but waits for the device at each read, as the spoke does for a loop that donates its
state and as it did for every loop up to commit 3bcfa1a; ``every-8`` reads lazily every 8
steps, as the spoke did before it read at 0.1 s intervals), each with its own ``nnx.jit`` (models
sharing one share its cache, where the model created later paid 5-10% on the 4x64 step), compiled
before timing; rounds of ``--steps`` steps alternate between the arms in
a shuffled order, each round ending with ``block_until_ready``. Keras: copies of one compiled
model, each fit for ``--epochs`` epochs per round (shuffled order; ``A/A`` is a second plain
model, ``no-act`` the callback with ``activations=False``, ``before`` is the callback of ``--before REV``, as
``before`` in JAX is its ``dbg.wrap``; ``--before same`` makes that arm the current spoke, its
A/A: before the JAX arms had a jit each, the arm created last read 5-7% slower with the same
code); the same MLP is also trained the functional way (``nnx.split`` once, a ``jax.jit`` step
over the parameters and optax's state: ``jax.jit functional``), plain, A/A, watched and
``before``; the
time of every epoch after the first (compilation excluded) is taken from a timing callback, with
the calling thread's CPU time over the same epochs, and the whole fit (compilation and the end-of-run report included) is given too, over all
rounds and for the first fit of each model alone (one sample each: every arm compiles there). Each figure is the
median of the per-round ratios watched/unwatched, with a 95% bootstrap interval, and the
ratio of the fastest rounds.

    .venv/bin/python bench/jax_overhead.py [--rounds 15] [--steps 200] [--epochs 3] [--small]
        [--only jax|keras] [--before REV] [--keras-rounds N] [--jit-compile true|false] [--keras-split]

``KERAS_BACKEND=tensorflow`` (or ``torch``) runs the Keras arms on that backend; ``--jit-compile``
is passed to ``model.compile`` (default ``auto``: Keras' choice, XLA on JAX, on TensorFlow only
with a GPU).
"""

from __future__ import annotations

import argparse
import math
import os
import random
import time
from typing import Any, Callable, Dict, List, Tuple

os.environ.setdefault("KERAS_BACKEND", "jax")

import numpy as np


def interval(ratios: List[float], seed: int = 0) -> Tuple[float, float, float]:
    r = np.asarray(ratios)
    rng = np.random.default_rng(seed)
    meds = [float(np.median(rng.choice(r, size=r.size))) for _ in range(2000)]
    return float(np.median(r)), float(np.percentile(meds, 2.5)), float(np.percentile(meds, 97.5))


def paired(arms: Dict[str, Callable[[], float]], rounds: int) -> Tuple[Dict[str, List[float]], Dict[str, List[float]]]:
    """Wall time and the calling thread's CPU time of each arm's rounds."""
    times: Dict[str, List[float]] = {k: [] for k in arms}
    cpu: Dict[str, List[float]] = {k: [] for k in arms}
    names = list(arms)
    for _ in range(rounds):
        random.shuffle(names)
        for k in names:
            c = time.thread_time()
            times[k].append(arms[k]())
            cpu[k].append(time.thread_time() - c)
    return times, cpu


def report(label: str, times: Dict[str, List[float]], per: int) -> None:
    base = np.asarray(times["plain"])
    for k, v in times.items():
        if k == "plain":
            continue
        med, lo, hi = interval(list(np.asarray(v) / base))
        # The fastest round of each arm: what a loaded machine disturbs least.
        best = float(np.min(v) / np.min(base))
        print(
            f"{label:<34} {k:<13} plain {np.median(base) / per * 1e3:8.3f} ms/step  "
            f"watched {np.median(v) / per * 1e3:8.3f} ms/step  ratio {med:.3f}x [{lo:.3f}, {hi:.3f}]  "
            f"fastest rounds {best:.3f}x"
        )


def jax_mlp(width: int, depth: int) -> Tuple[Any, Callable[..., Any]]:
    """The flax nnx MLP both JAX benchmarks watch (gelu, 64 inputs, 10 classes) and its loss."""
    import jax
    import optax
    from flax import nnx

    class MLP(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.inp = nnx.Linear(64, width, rngs=rngs)
            self.hidden = nnx.List([nnx.Linear(width, width, rngs=rngs) for _ in range(depth)])
            self.out = nnx.Linear(width, 10, rngs=rngs)

        def __call__(self, x: Any) -> Any:
            x = jax.nn.gelu(self.inp(x))
            for layer in self.hidden:
                x = jax.nn.gelu(layer(x))
            return self.out(x)

    def loss_fn(model: Any, x: Any, y: Any) -> Any:
        return optax.softmax_cross_entropy_with_integer_labels(model(x), y).mean()

    return MLP, loss_fn


# ``model.compile(jit_compile=...)`` of the Keras arms (``--jit-compile``).
JIT_COMPILE: Any = "auto"


def keras_mlp(width: int, depth: int) -> Any:
    """The compiled Keras MLP both Keras benchmarks fit (ReLU, 64 inputs, 10 classes, Adam)."""
    import keras

    keras.utils.set_random_seed(0)
    model = keras.Sequential(
        [keras.Input((64,))]
        + [keras.layers.Dense(width, activation="relu") for _ in range(depth + 1)]
        + [keras.layers.Dense(10)]
    )
    model.compile(
        optimizer=keras.optimizers.Adam(1e-3),
        loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True),
        jit_compile=JIT_COMPILE,
    )
    return model


def bench_jax(width: int, depth: int, batch: int, steps: int, rounds: int, before: Any = None) -> None:
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    from neuraldbg.jax import NeuralDbg

    MLP, loss_fn = jax_mlp(width, depth)

    def train_step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        loss, grads = nnx.value_and_grad(loss_fn)(model, x, y)
        optimizer.update(model, grads, value=loss)
        return loss

    # Each optimizer its own jitted step, as in a program that trains one model (see above).
    jitted: Dict[int, Any] = {}

    def step(model: Any, optimizer: Any, x: Any, y: Any) -> Any:
        if id(optimizer) not in jitted:
            jitted[id(optimizer)] = nnx.jit(train_step)
        return jitted[id(optimizer)](model, optimizer, x, y)

    def floor(tx: Any) -> Any:
        """The same gradient norms and one no-op host callback per update, without neuraldbg:
        what any per-step host callback costs in JAX (the spoke's design before its ring buffer)."""

        def init(p: Any) -> Any:
            return (tx.init(p), jnp.zeros((), jnp.int32))

        def update(u: Any, s: Any, p: Any = None, **kw: Any) -> Any:
            new, inner = tx.update(u, s[0], p)
            norms = jnp.sqrt(jnp.stack([jnp.sum(jnp.square(leaf)) for leaf in jax.tree.leaves(u)]))
            ack = jax.pure_callback(lambda a: np.zeros((), np.int32), jax.ShapeDtypeStruct((), jnp.int32), norms)
            return new, (inner, ack)

        return optax.GradientTransformationExtraArgs(init, update)

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, size=batch))
    plain_model = MLP(nnx.Rngs(0))
    watched_model = MLP(nnx.Rngs(0))
    plain_opt = nnx.Optimizer(plain_model, optax.adam(1e-3), wrt=nnx.Param)
    dbg = NeuralDbg(watched_model)
    dbg.__enter__()
    watched_opt = nnx.Optimizer(watched_model, dbg.wrap(optax.adam(1e-3), learning_rate=1e-3), wrt=nnx.Param)

    def arm(model: Any, opt: Any) -> Callable[[], float]:
        def run() -> float:
            fn = jitted[id(opt)]
            t = time.perf_counter()
            loss = None
            for _ in range(steps):
                loss = fn(model, opt, x, y)
            jax.block_until_ready(loss)
            return time.perf_counter() - t

        return run

    floor_model = MLP(nnx.Rngs(0))
    floor_opt = nnx.Optimizer(floor_model, floor(optax.adam(1e-3)), wrt=nnx.Param)
    # read-each: the ring read at every state, as soon as the device is done with it (no lazy reading).
    eager_model = MLP(nnx.Rngs(0))
    eager_dbg = NeuralDbg(eager_model)
    eager_dbg.__enter__()
    eager_opt = nnx.Optimizer(eager_model, eager_dbg.wrap(optax.adam(1e-3), learning_rate=1e-3), wrt=nnx.Param)
    eager_dbg._rings[0].max_every = 1
    # wait-read: lazy reading that waits for the device at each read (what a donating loop gets).
    waiting_model = MLP(nnx.Rngs(0))
    waiting_dbg = NeuralDbg(waiting_model)
    waiting_dbg.__enter__()
    waiting_opt = nnx.Optimizer(waiting_model, waiting_dbg.wrap(optax.adam(1e-3), learning_rate=1e-3), wrt=nnx.Param)
    waiting_dbg._rings[0].donated = True
    # every-8: lazy reading at most 16 states apart (every 8 steps: nnx.jit flattens the state
    # twice a call) and at no interval, the reading before 0.1 s intervals.
    counted_model = MLP(nnx.Rngs(0))
    counted_dbg = NeuralDbg(counted_model)
    counted_dbg.__enter__()
    counted_opt = nnx.Optimizer(counted_model, counted_dbg.wrap(optax.adam(1e-3), learning_rate=1e-3), wrt=nnx.Param)
    counted_dbg._rings[0].max_every = 16
    counted_dbg._rings[0].interval = math.inf
    models = [
        (plain_model, plain_opt),
        (watched_model, watched_opt),
        (floor_model, floor_opt),
        (eager_model, eager_opt),
        (waiting_model, waiting_opt),
        (counted_model, counted_opt),
    ]
    dbgs = [dbg, eager_dbg, waiting_dbg, counted_dbg]
    if before is not None:  # the spoke of the --before revision
        before_model = MLP(nnx.Rngs(0))
        dbgs.append(before.NeuralDbg(before_model))
        dbgs[-1].__enter__()
        before_opt = nnx.Optimizer(before_model, dbgs[-1].wrap(optax.adam(1e-3), learning_rate=1e-3), wrt=nnx.Param)
        models.append((before_model, before_opt))
    for m, o in models:
        jax.block_until_ready(step(m, o, x, y))  # compile
    arms = {
        "plain": arm(plain_model, plain_opt),
        "A/A": arm(plain_model, plain_opt),
        "callback": arm(floor_model, floor_opt),
        "neuraldbg": arm(watched_model, watched_opt),
        "read-each": arm(eager_model, eager_opt),
        "wait-read": arm(waiting_model, waiting_opt),
        "every-8": arm(counted_model, counted_opt),
    }
    if before is not None:
        arms["before"] = arm(*models[-1])
    times, cpu = paired(arms, rounds)
    for d in dbgs:
        d.__exit__(None, None, None)
    report(f"jax nnx MLP {depth + 2}x{width}, batch {batch}", times, steps)
    # The Python side of a step (flax's graph handling, dispatch, a synchronous step's callback,
    # our reading) runs on this thread: its CPU time is what other processes disturb least.
    report("  the same, calling thread's CPU time", cpu, steps)


def load_before(rev: str, name: str) -> Any:
    """``neuraldbg.<name>`` (``jax`` or ``keras``) as it was at git revision ``rev``, loaded
    beside the current one (as ``neuraldbg._<name>_before``, sharing the rest of the package):
    the before arm of a change. ``same``: the current module itself, the before arm's own A/A."""
    import importlib
    import importlib.util
    import subprocess

    if rev == "same":
        return importlib.import_module(f"neuraldbg.{name}")

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    source = subprocess.run(
        ["git", "-C", root, "show", f"{rev}:python/neuraldbg/{name}.py"], capture_output=True, text=True, check=True
    ).stdout
    import neuraldbg

    spec = importlib.util.spec_from_loader(f"neuraldbg._{name}_before", loader=None)
    assert spec is not None
    module = importlib.util.module_from_spec(spec)
    module.__package__ = "neuraldbg"
    exec(compile(source, f"{rev}:{name}.py", "exec"), module.__dict__)
    if "updates=ratios" in source:  # (a spoke from before Record's `measures`: its step sizes as they went then)
        from neuraldbg._spoke import Record

        def record(step: int, updates: Any = None, **kwargs: Any) -> Any:
            return Record(step, measures=None if updates is None else {"update_ratio": updates}, **kwargs)

        module.Record = record
    setattr(neuraldbg, f"_{name}_before", module)
    return module


def bench_jax_split(width: int, depth: int, batch: int, steps: int, rounds: int, before: Any = None) -> None:
    """The same MLP trained the functional way flax recommends for speed (``nnx.split`` once, a
    ``jax.jit`` step over the parameters and optax's state, ``nnx.merge`` inside): no nnx graph
    handling around the call, so what watching costs on the device and on the host shows whole."""
    import jax
    import jax.numpy as jnp
    import optax
    from flax import nnx

    MLP, loss_fn = jax_mlp(width, depth)
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.normal(size=(batch, 64)), jnp.float32)
    y = jnp.asarray(rng.integers(0, 10, size=batch))

    def make(tx: Any) -> Callable[[], float]:
        model = MLP(nnx.Rngs(0))
        graphdef, params = nnx.split(model, nnx.Param)

        @jax.jit
        def step(p: Any, s: Any, x: Any, y: Any) -> Any:
            loss, grads = jax.value_and_grad(lambda q: loss_fn(nnx.merge(graphdef, q), x, y))(p)
            updates, s = tx.update(grads, s, p, value=loss)
            return optax.apply_updates(p, updates), s, loss

        state = [params, tx.init(params)]
        jax.block_until_ready(step(*state, x, y))  # compile

        def run() -> float:
            t = time.perf_counter()
            loss = None
            for _ in range(steps):
                state[0], state[1], loss = step(*state, x, y)
            jax.block_until_ready(loss)
            return time.perf_counter() - t

        return run

    dbgs = []

    def watched(module: Any) -> Any:
        dbg = module.NeuralDbg(MLP(nnx.Rngs(0)))
        dbg.__enter__()
        dbgs.append(dbg)
        return dbg.wrap(optax.adam(1e-3), learning_rate=1e-3)

    import neuraldbg.jax

    arms = {
        "plain": make(optax.adam(1e-3)),
        "A/A": make(optax.adam(1e-3)),
        "neuraldbg": make(watched(neuraldbg.jax)),
    }
    if before is not None:
        arms["before"] = make(watched(before))
    times, cpu = paired(arms, rounds)
    for d in dbgs:
        d.__exit__(None, None, None)
    report(f"jax.jit functional {depth + 2}x{width}, batch {batch}", times, steps)
    report("  the same, calling thread's CPU time", cpu, steps)


def split_callbacks() -> Dict[str, Callable[[], Any]]:
    """``--keras-split``: where a watched fit's extra time goes. ``empty``: an async-safe
    callback whose batch hooks do nothing (Keras' own cost of a callback at every batch);
    ``host-only``: the callback with nothing added to the compiled step (its ``_observe`` and
    ``_write_activations`` no-ops: the host's bookkeeping alone); ``device-only``: the
    callback's compiled step with its batch hooks no-ops (nothing read or posted)."""
    import keras

    from neuraldbg.keras import NeuralDbgCallback

    class Empty(keras.callbacks.Callback):
        async_safe = True

        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            pass

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            pass

    class HostOnly(NeuralDbgCallback):  # type: ignore[misc]
        def _begin(self) -> Any:
            dbg = super()._begin()
            if dbg is not None:
                dbg._observe = lambda *a, **k: None  # type: ignore[method-assign]
                dbg._write_activations = lambda *a, **k: None  # type: ignore[method-assign]
            return dbg

    class DeviceOnly(NeuralDbgCallback):  # type: ignore[misc]
        def on_train_batch_begin(self, batch: int, logs: Any = None) -> None:
            pass

        def on_train_batch_end(self, batch: int, logs: Any = None) -> None:
            pass

    return {
        "empty": Empty,
        "host-only": lambda: HostOnly(verbose=False),
        "device-only": lambda: DeviceOnly(verbose=False),
    }


def bench_keras(
    width: int, depth: int, batch: int, epochs: int, rounds: int, n: int, before: Any = None, split: bool = False
) -> None:
    import keras

    from neuraldbg.keras import NeuralDbgCallback

    rng = np.random.default_rng(0)
    x = rng.normal(size=(n, 64)).astype("float32")
    y = rng.integers(0, 10, size=n)

    class EpochTimes(keras.callbacks.Callback):
        def __init__(self) -> None:
            super().__init__()
            self.times: List[float] = []
            self.cpu: List[float] = []

        def on_epoch_begin(self, epoch: int, logs: Any = None) -> None:
            self.t = time.perf_counter()
            self.c = time.thread_time()

        def on_epoch_end(self, epoch: int, logs: Any = None) -> None:
            self.times.append(time.perf_counter() - self.t)
            self.cpu.append(time.thread_time() - self.c)

    # no-act: activations=False; before: the callback of the --before revision.
    extra = split_callbacks() if split else {}
    kinds = ["plain", "A/A", "neuraldbg", "no-act"] + (["before"] if before is not None else []) + list(extra)
    models = {k: keras_mlp(width, depth) for k in kinds}
    steady: Dict[str, List[float]] = {k: [] for k in models}
    cpu: Dict[str, List[float]] = {k: [] for k in models}
    whole: Dict[str, List[float]] = {k: [] for k in models}
    names = list(models)
    for _ in range(rounds):
        random.shuffle(names)
        for k in names:
            timer = EpochTimes()
            cbs: List[Any] = [timer]
            if k == "before":
                cbs.append(before.NeuralDbgCallback(verbose=False))
            elif k in extra:
                cbs.append(extra[k]())
            elif k not in ("plain", "A/A"):
                cbs.append(NeuralDbgCallback(verbose=False, activations=k != "no-act"))
            t = time.perf_counter()
            models[k].fit(x, y, batch_size=batch, epochs=epochs, callbacks=cbs, verbose=0)
            whole[k].append(time.perf_counter() - t)
            steady[k].append(float(np.sum(timer.times[1:])))
            cpu[k].append(float(np.sum(timer.cpu[1:])))
    per = n // batch
    report(f"keras fit {depth + 2}x{width}, batch {batch}, epochs 2+", steady, per * (epochs - 1))
    report("  the same, calling thread's CPU time", cpu, per * (epochs - 1))
    report("keras fit, whole fit (compile incl.)", whole, per * epochs)
    first = {k: v[0] for k, v in whole.items()}
    print(
        "keras fit, first fit of each model (compiles, one sample): "
        + "  ".join(f"{k} {first[k] / first['plain']:.3f}x" for k in first if k != "plain")
        + f"  (plain {first['plain']:.2f} s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--only", choices=("jax", "keras"), default=None)
    ap.add_argument("--small", action="store_true", help="only the models with small steps (where the cost shows)")
    ap.add_argument(
        "--before",
        default=None,
        help="a git revision: adds its spokes as the arms `before` (`same`: the current spokes, an A/A of that arm)",
    )
    ap.add_argument("--keras-rounds", type=int, default=None, help="Keras rounds (default: half of --rounds)")
    ap.add_argument("--jit-compile", choices=("auto", "true", "false"), default="auto", help="Keras' jit_compile")
    ap.add_argument(
        "--keras-split",
        action="store_true",
        help="Keras: add the arms empty, host-only and device-only (see split_callbacks)",
    )
    args = ap.parse_args()
    random.seed(0)
    global JIT_COMPILE
    JIT_COMPILE = {"auto": "auto", "true": True, "false": False}[args.jit_compile]
    import jax

    print(f"jax {jax.__version__} on {jax.default_backend()}, {os.cpu_count()} CPUs")
    if args.only in (None, "keras"):
        import keras

        print(f"keras {keras.__version__} on {keras.backend.backend()}, jit_compile {args.jit_compile}")
    if args.only in (None, "jax"):
        before = load_before(args.before, "jax") if args.before else None
        bench_jax(64, 2, 32, args.steps, args.rounds, before)
        bench_jax(256, 4, 128, args.steps, args.rounds, before)
        bench_jax_split(64, 2, 32, args.steps * 5, args.rounds, before)
        bench_jax_split(256, 4, 128, args.steps, args.rounds, before)
        if not args.small:
            bench_jax(1024, 4, 256, max(args.steps // 10, 5), args.rounds, before)
    if args.only in (None, "keras"):
        before = load_before(args.before, "keras") if args.before else None
        rounds = args.keras_rounds or max(args.rounds // 2, 3)
        bench_keras(256, 4, 128, args.epochs, rounds, 128 * 100, before, args.keras_split)
        if not args.small:
            bench_keras(1024, 4, 256, args.epochs, rounds, 256 * 20, before, args.keras_split)


if __name__ == "__main__":
    main()
