"""What the JAX and Keras spokes share: a debugger fed with host arrays rather than by torch hooks.

A spoke describes the model once (a ``ModelSpec`` built from parameter paths, see
:func:`model_spec`) and posts one record per optimizer step from wherever the framework hands
the numbers over (a host callback of a compiled step, possibly on a runtime thread). The engine
belongs to the thread that created the debugger (the extension's engine is not shared across
threads), so records wait in a queue until that thread drains them: at once when the callback
runs on it, else at the next read of the results, ``dbg.step`` or the end of the run.
Framework-free: no jax, keras or torch here.
"""

from __future__ import annotations

import collections
import json
import os
import platform
import re
import socket
import threading
import time
import warnings
from typing import Any, Callable, Deque, Dict, Iterable, List, Optional, Sequence, Set, Tuple, Union

import numpy as np

from . import _native
from ._results import Results, newly_confirmed
from .errors import ConfigError, NeuralDbgError, NeuralDbgWarning
from .types import CausalHypothesis

_DEFAULTS: Dict[str, Any] = json.loads(_native.default_config_json())

# Parameter leaf names (flax, Keras) and what they are to their layer.
_WEIGHT_LEAVES = ("kernel", "weight", "depthwise_kernel", "pointwise_kernel", "recurrent_kernel")
_TABLE_LEAVES = ("embedding", "embeddings")
_BIAS_LEAVES = ("bias",)


class ParamEntry:
    """One trainable parameter as a spoke sees it: its layer's path, its own name, its shape,
    and the layer's kind (class name)."""

    __slots__ = ("kind", "layer", "leaf", "rank", "shape")

    def __init__(self, layer: Tuple[str, ...], leaf: str, shape: Sequence[int], kind: str, rank: float) -> None:
        self.layer = layer
        self.leaf = leaf
        self.shape = tuple(int(s) for s in shape)
        self.kind = kind
        # Where the layer comes in the forward order (smaller first).
        self.rank = rank

    @property
    def name(self) -> str:
        return ".".join(self.layer + (self.leaf,))


def natural_key(path: Sequence[str]) -> Tuple[Any, ...]:
    """Sort key of a path that puts ``layers.2`` before ``layers.10``."""
    return tuple(tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", p)) for p in path)


def model_spec(
    entries: List[ParamEntry],
    root_kind: str,
    optimizer: Optional[str],
    extra: Sequence[Tuple[Tuple[str, ...], str, float]] = (),
    *,
    framework: str,
    attrs: Optional[Dict[Tuple[str, ...], List[List[Any]]]] = None,
) -> Dict[str, Any]:
    """The engine's ``ModelSpec`` (a dict for JSON) of parameters named by path: each layer (the
    path without the parameter's own name) is a module, in forward order, the root last; ``extra``
    adds modules without parameters ``(path, kind, rank)`` (activations). Flax and Keras store a
    dense kernel as ``[in, out]`` and a convolution's as ``[..., in, out]``: the fan-in is every
    dimension but the last. ``framework`` (``keras``, ``jax``): the remedies name its functions.
    ``attrs``: a module's numeric attributes by path (a dropout's ``p``)."""
    layers: Dict[Tuple[str, ...], Tuple[float, str]] = {}
    for e in entries:
        layers.setdefault(e.layer, (e.rank, e.kind))
    for path, kind, rank in extra:
        layers.setdefault(path, (rank, kind))
    order = sorted(layers, key=lambda p: (layers[p][0], natural_key(p)))
    index = {p: i for i, p in enumerate(order)}
    attrs = attrs or {}
    modules = [{"name": ".".join(p), "kind": layers[p][1], "attrs": attrs.get(p, []), "executed": True} for p in order]
    root = index.get(())
    if root is None:
        modules.append({"name": "", "kind": root_kind, "attrs": [], "executed": True})
    params = []
    for e in entries:
        leaf = e.leaf.lower()
        role = (
            "weight" if leaf in _WEIGHT_LEAVES or leaf in _TABLE_LEAVES else "bias" if leaf in _BIAS_LEAVES else "other"
        )
        fan_in = None
        if role == "weight" and leaf not in _TABLE_LEAVES and len(e.shape) >= 2:
            fan_in = int(np.prod(e.shape[:-1]))
        params.append(
            {"module": index[e.layer], "name": e.name, "numel": int(np.prod(e.shape)), "role": role, "fan_in": fan_in}
        )
    return {"modules": modules, "params": params, "optimizer": optimizer, "framework": framework}


def spec_order(entries: List[ParamEntry]) -> List[int]:
    """The order the spec lists parameters in: by layer (forward order), then as given."""
    return sorted(range(len(entries)), key=lambda i: (entries[i].rank, natural_key(entries[i].layer), i))


def check_int(name: str, value: Any, lowest: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lowest:
        raise ConfigError(f"{name} must be an integer >= {lowest}, got {value!r}")
    return value


def path_option(name: str, value: Any) -> Optional[str]:
    if value is None:
        return None
    if not isinstance(value, (str, os.PathLike)):
        raise ConfigError(f"{name} must be a file path or None, got {type(value).__qualname__}")
    path = os.fspath(value)
    if not isinstance(path, str) or not path:
        raise ConfigError(f"{name} must be a non-empty file path, got {value!r}")
    return path


class Record:
    """One optimizer step's numbers, as a spoke posts them (parameters in spec order)."""

    __slots__ = ("activations", "grads", "has_loss", "inputs", "loss", "lr", "mean", "measures", "step", "weights")

    def __init__(
        self,
        step: int,
        grads: Optional[np.ndarray] = None,
        weights: Optional[np.ndarray] = None,
        loss: Optional[float] = None,
        lr: Optional[float] = None,
        has_loss: bool = False,
        activations: Optional[np.ndarray] = None,
        inputs: Optional[np.ndarray] = None,
        measures: Optional[Dict[str, np.ndarray]] = None,
    ) -> None:
        self.step = step
        self.activations = activations
        # The input batch's ``min, max, mean, std`` (the engine's input row).
        self.inputs = inputs
        # Per parameter measures of one update, by the engine's names (NaN: not measured), posted
        # with that update's step or the next (the engine reads the first few, not their steps):
        # ``update_ratio`` (how far it moved the weights relative to their size) and
        # ``update_direction`` (the cosine between that move and the gradient).
        self.measures = measures
        # What a spoke knows of the loss instead of its value (Keras: the running mean).
        self.mean: Any = None
        self.grads = grads
        self.weights = weights
        self.loss = loss
        self.lr = lr
        self.has_loss = has_loss


# The last row of a ring buffer: [update count (int32 bits), this marker (int32 bits), ...].
RING_MARKER = 0x4E444247
# Row flags (int32 bits in column 1): the update had a loss, a learning rate, parameter norms;
# a forward pass's input batch was measured; the loss's targets were, samples of the weights
# were taken; the step was compiled with its mode-dependent layers in training, in eval mode (JAX).
HAS_LOSS, HAS_LR, HAS_WEIGHTS, HAS_INPUTS, HAS_TARGETS, HAS_SAMPLES = 1, 2, 4, 8, 16, 32
IN_TRAINING, IN_EVAL = 64, 128
# Statistics of an input batch: min, max, mean, std.
INPUT_STATS = 4
# Columns before the gradient norms: step, flags, loss, learning rate.
RING_HEAD = 4
# Default size of a ring buffer on the device (rows x columns x 4 bytes).
RING_BYTES = 1 << 18
# Models with at most this many parameter elements have their norms taken in the compiled step
# at every step, the unsampled steps' dropped by a select: the conditional that keeps a larger
# model's pass over its parameters to the sampled steps costs a small one more than the pass.
ALWAYS_MEASURED = 1 << 16
# How long lazy reading lets a compiled loop's steps wait before it reads them (seconds), unless
# their ring would fill first: a read costs about the same whatever its number of rows (the
# host's code and data are cold after the steps in between), so fast steps are read in batches
# and slow ones as they come.
READ_INTERVAL = 0.1


def roots(squares: np.ndarray) -> np.ndarray:
    """Norms from sums of squares, in place: the square roots, with -1 (an absent parameter)
    and NaN left as they are."""
    np.sqrt(squares, out=squares, where=squares >= 0)
    return squares


class RingReader:
    """Reads the ring buffers a compiled step keeps in its state, on the device, in step order
    once the device has computed them (any thread; never raises). A buffer is ``[rows + 1,
    width]`` float32: row ``step % rows`` holds that step's numbers (``[step, flags, loss, lr,
    grad norms, parameter norms, input statistics where the flags say]``, the step and flags
    as int32 bits), the last row the number of steps made and :data:`RING_MARKER`.
    ``post(steps, flags, rows)`` takes the new rows of each read at once, in step order: a copy
    of them, with their steps and flags as int arrays (by default the spoke's
    :meth:`Spoke._post_rows`)."""

    def __init__(
        self,
        dbg: Spoke,
        rows: int,
        width: int,
        post: Optional[Callable[[np.ndarray, np.ndarray, np.ndarray], None]] = None,
    ) -> None:
        self.dbg = dbg
        self.post = post if post is not None else dbg._post_rows
        self.rows = rows
        self.width = width
        # The next step to read; steps below it have been posted.
        self.next = 0
        self.pending: Deque[Any] = collections.deque()
        self.last: Any = None
        self.lock = threading.RLock()
        self.missed = 0
        # Lazy reading: buffers met since the last read, how many to let pass at most, when the
        # last read was (``time.monotonic``), the newest unread.
        self.added = 0
        self.every = 1
        self.read_at = time.monotonic()
        self.unread: Any = None
        # Whether the loop donates its state (a buffer was deleted before it was read): lazy
        # reading then waits for the device at each read, before the next step takes the buffer.
        self.donated = False

    # Lazy reading (the caller asks :meth:`due` at each state it meets): a state is read once
    # `interval` seconds have passed since the last read, and at least once in `max_every`
    # states, fewer when a state brings many updates (a ``lax.scan``), so that a read always
    # comes before half the ring is overwritten; 1: every buffer is read as soon as the device
    # is done with it.
    max_every = 1
    interval = READ_INTERVAL

    def due(self) -> bool:
        """Counts a state met: whether lazy reading reads this one (else it is left in
        :attr:`unread`, read by the next :meth:`pump` if no newer one comes)."""
        self.added += 1
        return self.added >= self.every or time.monotonic() - self.read_at >= self.interval

    def fits(self, buf: Any) -> bool:
        """Whether ``buf`` is this ring: ``[rows + 1, width]``, or one such per replica."""
        shape = tuple(getattr(buf, "shape", ()))
        return shape[-2:] == (self.rows + 1, self.width) and len(shape) <= 3

    def add(self, buf: Any) -> None:
        """A device buffer of a newer state (an array with ``is_ready``/``is_deleted``, read
        with ``np.asarray``): read now if the device is done with it, else later. Lazy reading
        waits for the older buffers (the device is done with them by then, a read apart) and
        leaves this one to the next read if the device is still computing it, so that the
        host never waits for the step it just dispatched; once the loop is seen to donate its
        state, it waits for this one too (the next step would delete it unread)."""
        if buf is self.last or not self.fits(buf):
            return
        with self.lock:
            self.last = buf
            self.unread = None
            self.pending.append(buf)
            if self.max_every == 1:
                # Never more than half a ring behind: wait for the oldest buffer rather than lose steps.
                wait = len(self.pending) - self.rows // 2
            else:
                wait = len(self.pending) - (0 if self.donated else 1)
            self.pump(wait=wait)

    def pump(self, wait: int = 0) -> None:
        """Reads the buffers whose computation is done, oldest first, waiting for the first
        ``wait`` of them if they are not (the newest buffer left unread by lazy reading first
        joins them)."""
        with self.lock:
            unread, self.unread = self.unread, None
            if unread is not None and unread is not self.last and hasattr(unread, "is_ready") and self.fits(unread):
                self.last = unread
                self.pending.append(unread)
            while self.pending:
                buf = self.pending[0]
                try:
                    if buf.is_deleted():  # donated to a later step, whose buffer holds these rows
                        self.pending.popleft()
                        if self.max_every > 1 and not self.donated:
                            self.donated = True
                            wait = len(self.pending)
                        continue
                    if wait <= 0 and not buf.is_ready():
                        return
                    v = np.asarray(buf)
                except Exception:  # the step itself failed: the user's code says so
                    self.pending.popleft()
                    continue
                self.pending.popleft()
                wait -= 1
                self.read(v)

    def read(self, v: np.ndarray) -> None:
        if v.ndim == 3:  # one ring per replica (a state under jax.pmap): alike after a pmean, the first
            v = v[0]
        tail = v[self.rows, :2].view(np.int32)
        if int(tail[1]) != RING_MARKER:
            return
        count = int(tail[0])
        first = max(self.next, count - self.rows)
        if first > self.next:
            self.missed += first - self.next
            warnings.warn(
                f"NeuralDBG missed steps {self.next}-{first - 1}: more updates ran between two reads than the "
                f"buffer holds ({self.rows} rows); pass dbg.wrap(tx, buffer=N) with a larger N",
                NeuralDbgWarning,
                stacklevel=4,
            )
        if count > first:
            steps = np.arange(first, count)
            rows = v[steps % self.rows]  # (a copy, in step order)
            kept = rows[:, :1].view(np.int32)[:, 0] == steps
            if not kept.all():  # (a row not written by its step: skipped)
                steps, rows = steps[kept], rows[kept]
            self.post(steps, rows[:, 1:2].view(np.int32)[:, 0], rows)
        if self.max_every > 1 and self.added > 0:
            # Updates per state met since the last read; at most doubling the interval at a time,
            # since the first estimate counts the states met while the step was being traced.
            per_state = max(1, -(-(count - self.next) // self.added))
            self.every = max(1, min(self.max_every, 2 * self.every, (self.rows // 2) // per_state))
        self.added = 0
        self.read_at = time.monotonic()
        self.next = max(self.next, count)


class Spoke(Results):
    """A debugger fed with host arrays by a framework spoke. Subclasses build the model spec,
    post :class:`Record` parts with :meth:`_post`, and call :meth:`_start` / :meth:`_finish`."""

    DEFAULTS: Dict[str, Any] = dict(_DEFAULTS)
    """The engine's default settings."""

    # The spoke's model: ``entries``, the watched parameters in spec order (set by subclasses).
    _model: Any = None
    # Whether a step waits for its loss (posted separately) before it goes to the engine.
    _loss_apart = False
    # Whether a step's gradients may be posted again with newer numbers until the next step's
    # show up (optax.MultiSteps runs the inner update on every micro-batch, with the running
    # mean, and keeps the result of the last one; so does Keras's gradient accumulation off
    # JAX): then a step goes to the engine once a later step's gradients have arrived, or when
    # results are read.
    _last_wins = False

    def __init__(
        self,
        *,
        threshold_vanishing: float = 1e-6,
        threshold_exploding: float = 1e3,
        threshold_saturated: float = 1.0,
        weight_every: int = 10,
        dense_steps: int = 10,
        trace: Union[str, os.PathLike[str], None] = None,
        report: Union[str, os.PathLike[str], None] = None,
        halt_on: Union[bool, float, str, Iterable[str], None] = None,
        on_failure: Optional[Callable[[List[CausalHypothesis]], Any]] = None,
        **engine_options: Any,
    ) -> None:
        from .debugger import _engine, _halt_rule

        self._weight_every = check_int("weight_every", weight_every, 1)
        self._dense_steps = check_int("dense_steps", dense_steps, 0)
        self._trace_path = path_option("trace", trace)
        self._report_path = path_option("report", report)
        if on_failure is not None and not callable(on_failure):
            raise ConfigError(f"on_failure must be callable, got {type(on_failure).__qualname__}")
        self._engine = _engine(threshold_vanishing, threshold_exploding, threshold_saturated, engine_options)
        self._halt = _halt_rule(halt_on)
        self._on_failure = on_failure
        # What a confirmed halt does (the Keras callback stops fit); None: only ``halted`` is set.
        self._on_halt: Optional[Callable[[List[CausalHypothesis]], None]] = None
        self._halted: Optional[List[CausalHypothesis]] = None
        self._owner = threading.get_ident()
        self._inbox: Deque[Record] = collections.deque()
        self._pending: Dict[int, Record] = {}
        # The last step to observe, once training was stopped there (``neuraldbg run --steps``):
        # the updates a compiled loop ran past it are dropped, not observed at the exit.
        self._stopped_at: Optional[int] = None
        self._fed = -1
        self._posted = -1
        self._n_params = 0
        self._active = False
        self._started = False
        self._broken: Optional[str] = None
        self._events_seen = 0
        self._confirmed: Set[Tuple[str, Optional[str]]] = set()

    # ---------------------------------------------------------------- lifecycle

    def _start(self, spec: Dict[str, Any], meta: Dict[str, Any]) -> None:
        """Opens the trace (before anything else, so a bad path leaves nothing behind) and
        registers the model."""
        if self._started:
            raise NeuralDbgError("a debugger watches one training run; create a new one for another run")
        meta = dict(
            producer=f"neuraldbg {_native.__version__} (python)",
            python=platform.python_version(),
            started=time.time(),
            pid=os.getpid(),
            host=socket.gethostname(),
            **meta,
        )
        if self._trace_path is not None:
            directory = os.path.dirname(self._trace_path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self._engine.open_trace(self._trace_path, json.dumps(meta))
        try:
            self._probes: List[Dict[str, Any]] = json.loads(self._engine.register_model(json.dumps(spec)))
        except BaseException:
            self._close_trace()
            raise
        self._n_params = len(spec["params"])
        self._started = True
        self._active = True

    def _finish(self) -> None:
        """Feeds every record still waiting, closes the trace and writes the report; problems
        are warnings, never an exception that would replace the user's own."""
        if not self._active:
            return
        try:
            self._drain(final=True)
        finally:
            self._active = False
            self._close_trace()
            self._write_report()

    def _close_trace(self) -> None:
        try:
            summary = self._engine.close_trace()
        except NeuralDbgError as e:
            warnings.warn(f"NeuralDBG could not close the trace: {e}", NeuralDbgWarning, stacklevel=3)
            return
        if summary is not None and summary[1] == 0:
            warnings.warn(
                f"the trace {summary[0]} holds no step: no optimizer update of the watched model was observed",
                NeuralDbgWarning,
                stacklevel=3,
            )

    def _write_report(self) -> None:
        if self._report_path is None or not self._started:
            return
        try:
            directory = os.path.dirname(self._report_path)
            if directory:
                os.makedirs(directory, exist_ok=True)
            self.save_report(self._report_path)
        except Exception as e:
            warnings.warn(f"NeuralDBG could not write the report: {e}", NeuralDbgWarning, stacklevel=3)

    # ---------------------------------------------------------------- records

    def _sampled(self, step: Any) -> Any:
        """Whether parameter norms are measured at ``step``: a bool for an int, and the same
        test traced for a step count inside a compiled step (a boolean array)."""
        return (step < self._dense_steps) | (step % self._weight_every == 0)

    def _post(self, *records: Record) -> None:
        """Hands over steps' numbers (or part of them: the spoke may post gradients and the
        loss apart). Safe from any thread; never raises."""
        self._inbox.extend(records)
        if threading.get_ident() == self._owner and self._active:
            self._drain()

    def _drain(self, final: bool = False) -> None:
        """Feeds the engine every complete record in step order (the owner thread only)."""
        if threading.get_ident() != self._owner or self._broken is not None:
            return
        pending = self._pending
        inbox = self._inbox
        while inbox:
            r = inbox.popleft()
            if r.step <= self._fed:
                continue  # a part of a step the engine has: too late to count, never in the way
            have = pending.get(r.step)
            if have is None:
                pending[r.step] = r
                continue
            if r.grads is not None:
                have.grads, have.weights, have.lr = r.grads, r.weights, r.lr
            if r.measures is not None:
                have.measures = r.measures
            if r.has_loss:
                have.loss, have.has_loss, have.mean = r.loss, True, r.mean
            if r.activations is not None:
                have.activations = r.activations
            if r.inputs is not None:
                have.inputs = r.inputs
        if self._stopped_at is not None:
            for later in [step for step in pending if step > self._stopped_at]:
                del pending[later]
        ready = []
        steps = sorted(pending)
        # (_last_wins: the newest step with gradients may get newer ones; parts of later steps,
        # such as their inputs, can come first.)
        held = max((s for s in steps if pending[s].grads is not None), default=None) if self._last_wins else None
        for step in steps:
            r = pending[step]
            complete = r.grads is not None and (r.has_loss or not self._loss_apart)
            if held is not None and step >= held:
                complete = False
            if not complete and not final:
                break
            ready.append(pending.pop(step))
        for r in ready:
            if r.grads is None or r.step <= self._fed:
                continue
            try:
                self._engine.observe(
                    r.step,
                    r.grads,
                    weight_norms=r.weights,
                    activations=r.activations,
                    inputs=r.inputs,
                    loss=self._loss_of(r),
                    lr=r.lr,
                    facts=self._step_facts(r),
                    measures=r.measures,
                )
            except Exception as e:  # never end the user's run: stop observing, say why
                self._broken = str(e)
                warnings.warn(f"NeuralDBG stopped observing at step {r.step}: {e}", NeuralDbgWarning, stacklevel=2)
                return
            self._fed = r.step
            self._after_step(r.step)

    def _give_facts(self, facts: Dict[str, Any], what: str) -> None:
        """Facts the engine takes after registration (``Engine.amend_first_batch``: the first
        batch's, a loss learned late), from the owner thread; a problem is a warning."""
        if not facts:
            return
        try:
            self._engine.amend_first_batch(json.dumps(facts))
        except Exception as e:  # a fact, never a reason to stop
            warnings.warn(f"NeuralDBG could not take {what}: {e}", NeuralDbgWarning, stacklevel=3)

    def _post_rows(self, steps: np.ndarray, flags: np.ndarray, rows: np.ndarray) -> None:
        """Rows of a ring buffer (see :class:`RingReader`), each posted as its step's record
        (parts of ``rows``, which the read copied)."""
        self._post(*self._records(steps, flags, rows))

    def _records(self, steps: np.ndarray, flags: np.ndarray, rows: np.ndarray) -> List[Record]:
        """The records of ring rows, their arrays parts of ``rows``."""
        n = self._n_params
        grads, weights, inputs = RING_HEAD, RING_HEAD + n, RING_HEAD + 2 * n
        has_loss = not self._loss_apart
        out = []
        for step, f, row in zip(steps.tolist(), flags.tolist(), rows):
            out.append(
                Record(
                    step,
                    grads=row[grads:weights],
                    weights=row[weights:inputs] if f & HAS_WEIGHTS and self._sampled(step) else None,
                    inputs=row[inputs : inputs + INPUT_STATS] if f & HAS_INPUTS else None,
                    loss=float(row[2]) if f & HAS_LOSS else None,
                    lr=float(row[3]) if f & HAS_LR else None,
                    has_loss=has_loss,
                )
            )
        return out

    def _loss_of(self, r: Record) -> Optional[float]:
        """A step's loss as the engine takes it, in step order (spokes that post something else
        than the value convert it here)."""
        return r.loss

    def _step_facts(self, r: Record) -> Optional[Dict[str, float]]:
        """A step's facts for the engine, derived from its record (none by default)."""
        return None

    def _after_step(self, step: int) -> None:
        """When the engine has recorded new events: newly confirmed hypotheses go to
        ``on_failure``, and one that ``halt_on`` names halts training."""
        if self._halt is None and self._on_failure is None:
            return
        n = self._engine.event_count
        if n == self._events_seen:
            return
        self._events_seen = n
        confirmed, new = newly_confirmed(self._engine, self._confirmed)
        if not new:
            return
        if self._on_failure is not None:
            try:
                self._on_failure(new)
            except Exception as e:  # the user's callback: reported, never raised into training
                warnings.warn(f"on_failure raised {e!r}", NeuralDbgWarning, stacklevel=2)
        if self._halted is None and self._halt is not None:
            hit = [h for h in confirmed if self._halt(h)]
            if hit:
                self._halted = hit
                if self._on_halt is not None:
                    self._on_halt(hit)

    # ---------------------------------------------------------------- results

    @property
    def halted(self) -> Optional[List[CausalHypothesis]]:
        """The hypotheses that halted training (``halt_on``), or None."""
        return self._halted

    def _wait(self) -> None:
        """Waits for the framework to deliver the records of the steps it has run (subclasses)."""

    def _sync(self) -> None:
        if self._active:
            self._wait()
            self._drain(final=self._last_wins)

    @property
    def step(self) -> int:
        """Optimizer updates observed so far (0 before the first one completes)."""
        self._sync()
        last = max([self._fed, *self._pending.keys(), *(r.step for r in list(self._inbox))])
        return last + 1

    @property
    def layers(self) -> List[str]:
        """The watched layers (a parameter's path without its own name), in the order the
        engine reads as the forward order."""
        out: List[str] = []
        for e in self._model.entries:
            name = ".".join(e.layer)
            if name not in out:
                out.append(name)
        return out

    @property
    def error(self) -> Optional[str]:
        """Why observation stopped early (the engine refused a step), or None."""
        return self._broken


def layer_path(parts: Iterable[Any]) -> Tuple[str, ...]:
    """A parameter path's components as strings."""
    return tuple(str(p) for p in parts)
