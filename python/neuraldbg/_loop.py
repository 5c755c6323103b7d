"""Facts about the training loop that only the framework knows, for the engine's loop-mistake
causes. Facts, never judgements: which mode the model ran in, whether a step's gradients were
added onto the previous step's, which parameters each optimizer holds and at what learning
rate, and what the loss did with the model's output. The engine decides what they mean.

Cost: per step, a bool read per forward pass and one tensor hook on one parameter, or, where
the backward tap reads the gradients, the same look at that parameter's gradient as each
backward starts and returns (a pointer and version-counter comparison, no device work).
Once, at the first step: a walk of at most a few dozen autograd nodes from the loss to the
model's output and to any parameter it penalizes directly (a weight penalty written into the
loss), the output's and target's min/max and the target's variance (one host read).
"""

from __future__ import annotations

import gc
import math
import re
from typing import AbstractSet, Any, Callable, Dict, Iterator, List, NamedTuple, Optional, Set, Tuple

from ._distributed import has_shards

# Autograd node names end in "Backward0", "Backward1"...: the operation's name is before it.
_BACKWARD = re.compile(r"Backward\d*$")

# Operations that only index, reshape or copy their one input.
_VIEWS = frozenset(
    {
        "Select",
        "Slice",
        "View",
        "Reshape",
        "Unsqueeze",
        "Squeeze",
        "Permute",
        "Transpose",
        "T",
        "Clone",
        "Contiguous",
        "Flatten",
        "Unflatten",
        "Index",
        "Narrow",
        "Alias",
        "ToCopy",
    }
)

# Autograd nodes visited at most when looking for the model's output from the loss.
_WALK_LIMIT = 64

# Autograd nodes visited at most when looking below the model's output (once, on the first
# step): for parameters it does not hold, and for how it reads its recurrent layers.
_BELOW_WALK_LIMIT = 50_000

# Features of a table whose per-feature scales are told to the engine: tabular data has a few
# dozen; a flattened image (784 pixels for MNIST) is no table.
MAX_FEATURES = 256

# Operations a weight penalty is written with (``l2 * sum(w.pow(2).sum() for w in weights)``,
# ``torch.norm(w)``, ``w.abs().sum()``): sums, scalings and norms of a parameter.
_PENALTY_OPS = frozenset({"Add", "Sub", "Mul", "Div", "Sum", "Mean", "Pow", "Abs", "Norm", "LinalgVectorNorm", "Sqrt"})
_NORM_OPS = frozenset({"Pow", "Abs", "Norm", "LinalgVectorNorm"})


def op_name(fn: Any) -> str:
    """The operation an autograd node differentiates (``SoftmaxBackward0`` -> ``Softmax``)."""
    return _BACKWARD.sub("", type(fn).__name__)


class LoopFacts:
    """Collects the loop facts of one watched model."""

    def __init__(
        self, params: List[Any], guard: Optional[Callable[[Callable[..., Any]], Callable[..., Any]]] = None
    ) -> None:
        self.params = params
        # Wraps the probe's tensor hook in the collector's guard (see _guard.py).
        self.guard = guard
        # The grad-enabled forward passes of the current step, and how many ran in eval mode.
        self.grad_forwards = 0
        self.eval_forwards = 0
        # Gradient accumulation: one parameter is watched. After each optimizer step, its
        # .grad tensor (pointer and version counter) is remembered; when the next backward
        # reaches that parameter, its .grad is still that very tensor, unmodified, only if
        # nothing zeroed it (zero_() bumps the version, set_to_none drops it).
        self.probe: Any = None
        self.probe_handle: Any = None
        self.after_step_grad: Optional[Tuple[int, int]] = None
        self.accumulated: Optional[bool] = None
        # Whether gradients outlive a step: the watched parameter still had a .grad when its
        # next backward started (zero_grad(set_to_none=False), or none at all), so an
        # all-zero gradient may be a leftover of a module that did not run. False: each step's
        # gradients are made anew (set_to_none=True), a zero is a real one. None: not seen.
        self.grads_kept: Optional[bool] = None
        self.armed = False
        # Run-level facts, described once.
        self.loss: Optional[Dict[str, Any]] = None
        self.loss_tried = False
        # Parameters the first step's output depended on that are not the model's (see
        # :func:`_stray_parameters`), until registration asks the optimizers about them.
        self.stray: List[Any] = []
        self.first_output: Any = None
        # Per feature of the first input batch of a table (see :meth:`note_input`): a device
        # tensor until registration reads it; False once an input was seen that is no table.
        self.feature_scales: Any = None
        # The shape of the first input of each module that reads its input's first dimension
        # as the sequence (see :meth:`sequence_first_hook`), by module name.
        self.sequence_first: Dict[str, List[int]] = {}
        # Each recurrent module's first output with autograd (see :meth:`recurrent_hook`), by
        # module name, until the first loss is described; then which of its time steps the
        # model reads (:func:`_sequence_readouts`), until registration takes them.
        self.recurrent: Dict[str, _Recurrent] = {}
        self.readouts: List[Dict[str, Any]] = []
        self.optimizer: Any = None
        # Every optimizer of the model's parameters tells the engine which it holds and at
        # what lr, once (a model trained by several: an encoder's and a decoder's, a head's, one
        # that starts stepping later). Those seen before registration wait for it here.
        self.waiting: List[Any] = []

    # ------------------------------------------------------------------ per step

    def install_probe(self, hook: bool = True, by_hand: bool = False) -> None:
        """Watches one parameter the stepping optimizer holds (its ``zero_grad()`` clears
        exactly those), from the first optimizer step on, or (``by_hand``: a loop that updates
        the weights itself, whose ``model.zero_grad()`` clears them all) one of the model's:
        by a tensor hook, or (``hook`` False) through :meth:`before_backward` and
        :meth:`after_backward`, called around each backward pass."""
        opt = self.optimizer
        if (opt is None and not by_hand) or self.probe is not None:
            return
        held = None if opt is None else {id(p) for g in opt.param_groups for p in g["params"]}
        for p in self.params:
            # (An optimizer may hold frozen parameters too: they never get a gradient.)
            if (held is None or id(p) in held) and getattr(p, "is_leaf", False) and getattr(p, "requires_grad", False):
                self.probe = p
                if hook:
                    self.hook_probe()
                return

    def hook_probe(self) -> None:
        """The probe's tensor hook, from now on (see :meth:`install_probe`)."""
        if self.probe is not None and self.probe_handle is None:
            hook = self._on_probe_grad if self.guard is None else self.guard(self._on_probe_grad)
            self.probe_handle = self.probe.register_hook(hook)

    def remove(self) -> None:
        if self.probe_handle is not None:
            try:
                self.probe_handle.remove()
            except Exception:  # pragma: no cover - removal must never raise
                pass
            self.probe_handle = None
        self.first_output = None
        self.feature_scales = None
        self.recurrent = {}
        self.optimizer = None
        self.waiting = []
        self.stray = []

    def on_forward(self, training: bool, grad_enabled: bool) -> None:
        if grad_enabled:
            self.grad_forwards += 1
            self.eval_forwards += not training

    def _on_probe_grad(self, grad: Any) -> None:
        # Runs before autograd adds `grad` into .grad: .grad is what the step starts from.
        if not self.armed:
            return
        self.armed = False
        try:
            old = self.probe.grad
            self._seen(old, None if old is None else _grad_key(old))
        except Exception:  # pragma: no cover - never break the user's backward
            self.accumulated = None

    def _seen(self, old: Any, key: Optional[Tuple[int, int]]) -> None:
        """The probe's backward found ``old`` in its .grad (``key``: its identity then)."""
        self.grads_kept = old is not None
        before = self.after_step_grad
        self.accumulated = old is not None and before is not None and key == before

    def before_backward(self) -> Any:
        """Without the tensor hook: what the probe's .grad is as a backward pass starts (None
        when nothing is to be learned from this backward)."""
        if not self.armed or self.probe is None:
            return None
        old = self.probe.grad
        return old, None if old is None else _grad_key(old)

    def after_backward(self, before: Any) -> None:
        """The backward pass :meth:`before_backward` saw start has returned: if it reached the
        probe (its .grad is another tensor now, or was added to), what it found there."""
        old, key = before
        try:
            if not grad_changed(self.probe, old, None if key is None else key[1]):
                return  # not reached
            self.armed = False
            self._seen(old, key)
        except Exception:  # pragma: no cover - never break the user's backward
            self.armed = False
            self.accumulated = None

    def after_optimizer_step(self) -> None:
        """The optimizer stepped (or a step stepped by hand ended with its backward): remember
        the gradient it used (after any clipping)."""
        p = self.probe
        if p is None:
            return
        g = p.grad
        self.after_step_grad = None if g is None else _grad_key(g)
        self.armed = self.after_step_grad is not None or g is None

    def forget_gradient(self) -> None:
        """The gradient :meth:`after_optimizer_step` remembered is not the step's (read after
        the loop went on): the next backward tells nothing."""
        self.after_step_grad = None
        self.armed = False

    def step_facts(self) -> Dict[str, float]:
        """The facts of the step being observed; resets the per-step state."""
        facts: Dict[str, float] = {}
        if self.grad_forwards:
            facts["training"] = 0.0 if self.eval_forwards else 1.0
        if self.accumulated is not None:
            facts["grad_accumulated"] = 1.0 if self.accumulated else 0.0
        self.grad_forwards = self.eval_forwards = 0
        self.accumulated = None
        return facts

    # ------------------------------------------------------------------ run level

    def base_lr(self, opt: Any) -> Optional[float]:
        """The lr optimizer ``opt`` was built with, where a scheduler has set another since: its
        first group's ``initial_lr`` (which torch's ``LRScheduler`` writes when it is made),
        when that differs from the group's ``lr``; else None."""
        try:
            group = opt.param_groups[0]
        except Exception:  # None, or an optimizer we cannot read
            return None
        base, lr = _float(group.get("initial_lr")), _float(group.get("lr"))
        return base if base is not None and base > 0 and base != lr else None

    def param_lrs(self, opt: Any) -> Optional[List[Optional[float]]]:
        """Per watched parameter: the lr of the param group of optimizer ``opt`` that holds it,
        None where it holds none (None overall when ``opt`` is None or its lrs cannot be
        read)."""
        if opt is None:
            return None
        group_lr: Dict[int, Optional[float]] = {}
        try:
            for g in opt.param_groups:
                lr = _float(g.get("lr"))
                for p in g["params"]:
                    group_lr[id(p)] = lr
        except Exception:  # pragma: no cover - an optimizer we cannot read
            return None
        # A group whose lr cannot be read on the host (a device tensor) counts as held at the
        # optimizer's first readable lr; with none readable, the facts are not known.
        fallback = _first_lr(opt)
        if fallback is None:
            return None
        out: List[Optional[float]] = []
        for p in self.params:
            if id(p) not in group_lr:
                out.append(None)
            else:
                lr = group_lr[id(p)]
                out.append(lr if lr is not None else fallback)
        return out

    def maximized(self, opt: Any) -> Set[int]:
        """The watched parameters optimizer ``opt`` moves up their gradients on purpose (a param
        group with ``maximize=True``)."""
        ids: Set[int] = set()
        try:
            for g in opt.param_groups:
                if g.get("maximize") is True:
                    ids.update(id(p) for p in g["params"])
        except Exception:  # pragma: no cover - an optimizer we cannot read
            return set()
        return {i for i, p in enumerate(self.params) if id(p) in ids}

    def param_weight_decays(self, opt: Any) -> Optional[List[float]]:
        """Per watched parameter: the weight decay optimizer ``opt`` adds to its gradient (its
        param group's ``weight_decay``), 0 where it holds none or decays the weights apart
        from the gradient (``AdamW``, ``decoupled_weight_decay``); None when ``opt`` is None
        or its groups cannot be read."""
        if opt is None:
            return None
        decay: Dict[int, float] = {}
        try:
            decoupled_kind = type(opt).__name__ == "AdamW"
            for g in opt.param_groups:
                wd = _float(g.get("weight_decay", 0.0))
                if wd is None or not wd > 0.0 or decoupled_kind or g.get("decoupled_weight_decay"):
                    continue
                for p in g["params"]:
                    decay[id(p)] = wd
        except Exception:  # pragma: no cover - an optimizer we cannot read
            return None
        return [decay.get(id(p), 0.0) for p in self.params]

    def describe_loss(self, loss: Any, output_fns: List[Any]) -> None:
        """What the loss did with the model's output, from the loss's autograd graph (first
        step only, before backward frees the saved tensors)."""
        if self.loss_tried:
            return
        self.loss_tried = True
        try:
            self.loss = _describe(loss, output_fns, self.first_output)
        except Exception:  # pragma: no cover - a graph we cannot read: no facts
            self.loss = None
        self.first_output = None
        recurrent, self.recurrent = self.recurrent, {}
        try:
            self.readouts = _sequence_readouts(output_fns, recurrent) if recurrent else []
        except Exception:  # pragma: no cover - an optional fact
            self.readouts = []
        try:
            # (Sharded parameters run as other, unsharded ones in the forward: not strays.)
            if not has_shards(self.params):
                self.stray = _stray_parameters(output_fns, {id(p) for p in self.params})
        except Exception:  # pragma: no cover - an optional fact
            self.stray = []

    def unregistered_params(self) -> Optional[List[List[int]]]:
        """The shapes of the parameters the first step's output depended on that are not the
        model's and that no optimizer holds (at registration: the optimizers that stepped so
        far, then, for what is left, every optimizer that exists); None when there are none."""
        stray, self.stray = self.stray, []
        for opt in [self.optimizer, *self.waiting]:
            if stray and opt is not None:
                held = _held_by(opt)
                stray = [p for p in stray if id(p) not in held]
        for o in live_optimizers() if stray else ():
            held = _held_by(o)
            stray = [p for p in stray if id(p) not in held]
        return [list(p.shape) for p in stray[:64]] or None

    def note_input(self, x: Any) -> None:
        """The first input batch (before registration): for a table, a 2-D batch of at most
        :data:`MAX_FEATURES` float features, the largest magnitude of each feature, left on
        its device until :meth:`input_feature_scales` reads it. Later batches change nothing."""
        if self.feature_scales is not None:
            return
        self.feature_scales = False
        if x.dim() == 2 and 2 <= x.shape[1] <= MAX_FEATURES and x.shape[0] >= 2 and x.is_floating_point():
            self.feature_scales = x.detach().abs().amax(dim=0)

    def sequence_first_hook(self, name: str) -> Callable[..., None]:
        """A forward pre-hook for module ``name``, one that reads its input's first dimension
        as the sequence (``batch_first=False``): notes the shape of the first input it is
        given (outside a compiled graph), then nothing."""
        from torch.compiler import is_compiling

        seen = self.sequence_first

        def hook(module: Any, args: Any) -> None:
            if name in seen or is_compiling():
                return
            shape = getattr(args[0], "shape", None) if args else None
            if shape is not None:
                seen[name] = [int(s) for s in shape]

        return hook

    def sequence_first_inputs(self) -> Optional[List[Dict[str, Any]]]:
        """The engine's ``sequence_first_inputs``: each module noted by
        :meth:`sequence_first_hook` with the shape of its first input; None when none ran."""
        return [{"module": m, "shape": s} for m, s in self.sequence_first.items()] or None

    def recurrent_hook(self, name: str) -> Callable[..., None]:
        """A forward hook for recurrent module ``name`` (``nn.RNN``, ``nn.LSTM``, ``nn.GRU``):
        on its first call with autograd on a batch of sequences (outside a compiled graph),
        notes the autograd nodes of its output and of its final state, its time axis, its
        steps and whether it runs both ways; then nothing."""
        from torch.compiler import is_compiling

        seen = self.recurrent

        def hook(module: Any, args: Any, output: Any) -> None:
            if name in seen or is_compiling() or not isinstance(output, tuple) or len(output) != 2:
                return
            out, state = output
            fn, shape = getattr(out, "grad_fn", None), getattr(out, "shape", None)
            if fn is None or shape is None or len(shape) != 3:  # (a PackedSequence, one unbatched sequence)
                return
            axis = 1 if getattr(module, "batch_first", False) else 0
            states = [getattr(s, "grad_fn", None) for s in (state if isinstance(state, tuple) else (state,))]
            seen[name] = _Recurrent(
                fn, [f for f in states if f is not None], axis, int(shape[axis]), bool(module.bidirectional)
            )

        return hook

    def sequence_readouts(self) -> Optional[List[Dict[str, Any]]]:
        """The engine's ``sequence_readouts`` (see :func:`_sequence_readouts`); None when
        there are none."""
        found, self.readouts = self.readouts, []
        return found or None

    def input_feature_scales(self) -> Optional[List[Optional[float]]]:
        """The first table batch's per-feature largest magnitudes, read now (at
        registration), None for a feature whose values were not all finite; None when the
        first input was no table."""
        t, self.feature_scales = self.feature_scales, False
        if t is None or t is False:
            return None
        try:
            return [v if math.isfinite(v) else None for v in map(float, t.float().tolist())]
        except Exception:  # pragma: no cover - an optional fact
            return None

    def loss_facts(self) -> Optional[Dict[str, Any]]:
        """The loss's description for the engine (at registration), its output and target
        ranges read now: on a GPU they were copied to the host without waiting when the loss
        appeared, and by the end of the first step the copy is normally done."""
        d = self.loss
        if d is None:
            return None
        pending = d.pop("_ranges", None)
        if pending is not None:
            host, event = pending
            try:
                if event is not None and not event.query():
                    event.synchronize()  # (the first step only, once)
                lo, hi, tlo, thi, clo, chi, tvar, entropy, entropy_se, own, spread, labels = (
                    float(v) for v in host.tolist()
                )
            except Exception:  # pragma: no cover - ranges are optional facts
                lo = hi = tlo = thi = clo = chi = tvar = entropy = entropy_se = own = spread = labels = math.nan
            if math.isfinite(lo) and math.isfinite(hi):
                d["output_range"] = [lo, hi]
            if math.isfinite(tlo) and math.isfinite(thi):
                d["target_range"] = [tlo, thi]
            if math.isfinite(clo) and math.isfinite(chi):
                d["class_range"] = [clo, chi]
            if math.isfinite(tvar):
                d["target_var"] = tvar
            if math.isfinite(entropy):
                d["class_entropy"] = entropy
            if math.isfinite(entropy) and math.isfinite(entropy_se):
                d["class_entropy_se"] = entropy_se
            if math.isfinite(spread):
                d["output_batch_spread"] = spread
            if math.isfinite(labels):
                d["labels_per_sample"] = int(labels)
            if math.isfinite(own):
                d["target_entropy"] = own
        return d


def grad_changed(p: Any, before: Any, version: Optional[int]) -> bool:
    """Whether a backward pass gave ``p`` a gradient: its ``.grad`` is another tensor than
    ``before`` (what it was as the backward started), or ``before`` at another version than
    ``version`` (accumulated into; an unknown version counts as changed)."""
    now = p.grad
    return now is not before or (before is not None and (version is None or before._version != version))


def _grad_key(g: Any) -> Optional[Tuple[int, int]]:
    """Identity and version counter of a gradient tensor (None when it has neither, e.g. a
    tensor subclass without storage: no fact then)."""
    try:
        return (g.data_ptr(), g._version)
    except Exception:
        try:
            return (id(g), g._version)
        except Exception:
            return None


def _float(v: Any) -> Optional[float]:
    if isinstance(v, (int, float)):
        return float(v)
    try:
        import torch

        if isinstance(v, torch.Tensor) and v.numel() == 1 and v.device.type == "cpu":
            return float(v)
    except Exception:  # pragma: no cover
        pass
    return None


def _first_lr(opt: Any) -> Optional[float]:
    for g in opt.param_groups:
        lr = _float(g.get("lr"))
        if lr is not None:
            return lr
    return None


def _describe(loss: Any, output_fns: List[Any], output: Any) -> Optional[Dict[str, Any]]:
    """The loss's facts: the path of operations from the loss to the model's output (without
    it there are none), then each further fact on its own (:data:`_LOSS_FACTS`): one that
    cannot be read on this graph or device loses only itself."""
    fn = getattr(loss, "grad_fn", None)
    if fn is None or not output_fns:
        return None
    outputs = {id(t): t for t in output_fns}
    path = _path_to_output(fn, outputs)
    if path is None:
        return None
    d: Dict[str, Any] = {"ops": [op_name(n) for n in path[:-1]], "output_op": op_name(_producer(path[-1]))}
    for fact in _LOSS_FACTS:
        try:
            fact(d, path, output, outputs)
        except Exception:  # an optional fact: the others stand
            pass
    return d


class _Recurrent(NamedTuple):
    """A recurrent module's first output, as :meth:`LoopFacts.recurrent_hook` noted it."""

    output_fn: Any
    state_fns: List[Any]
    axis: int
    steps: int
    bidirectional: bool


def _sequence_readouts(output_fns: List[Any], recurrent: Dict[str, _Recurrent]) -> List[Dict[str, Any]]:
    """Each recurrent module whose output the model's output reads only at chosen time steps
    (``out[:, -1]``, ``out[:, 0]``: a select along its time axis) and whose final state it does
    not read: the module's name, its steps, the steps read (from 0) and whether it runs both
    ways. A walk below the model's output that stops at each module's output; nothing when it
    could not be walked to its end."""
    owner = {id(r.output_fn): name for name, r in recurrent.items()}
    state_owner = {id(f): name for name, r in recurrent.items() for f in r.state_fns}
    # Per module: the steps read so far, None once it is read otherwise.
    reads: Dict[str, Optional[Set[int]]] = {}
    try:
        for node in _nodes_below(output_fns, stop=owner.keys()):
            if id(node) in state_owner:
                reads[state_owner[id(node)]] = None
            for nxt, _ in getattr(node, "next_functions", ()):
                name = owner.get(id(nxt))
                if name is None:
                    continue
                step = _selected_step(node, recurrent[name])
                got = reads.setdefault(name, set())
                if step is None:
                    reads[name] = None
                elif got is not None:
                    got.add(step)
    except _WalkTooLong:
        return []
    return [
        {
            "module": name,
            "steps": recurrent[name].steps,
            "steps_read": sorted(got),
            "bidirectional": recurrent[name].bidirectional,
        }
        for name, got in reads.items()
        if got
    ]


def _selected_step(node: Any, r: _Recurrent) -> Optional[int]:
    """The time step autograd node ``node`` selects from a recurrent output (a ``Select``
    along its time axis), from 0; None when it reads the output otherwise."""
    if op_name(node) != "Select" or int(node._saved_dim) % 3 != r.axis:
        return None
    index = int(node._saved_index)
    index -= (1 << 64) if index >= (1 << 63) else 0  # (a negative index, saved as unsigned)
    index += r.steps if index < 0 else 0
    return index if 0 <= index < r.steps else None


def _stray_parameters(output_fns: List[Any], own: Set[int]) -> List[Any]:
    """The ``nn.Parameter`` leaves below the model's output nodes (what the output depends on)
    that are not among the model's parameters (``own``: their ids): layers kept in a plain
    Python list or built inside ``forward()``, which ``model.parameters()`` never returns. Not
    tensors that merely require a gradient (an input made to, for adversarial examples), and
    not what the loss adds beside the output (a teacher's logits, a penalty)."""
    import torch

    found: Dict[int, Any] = {}
    try:
        for node in _nodes_below(output_fns):
            v = getattr(node, "variable", None) if op_name(node) == "AccumulateGrad" else None
            if isinstance(v, torch.nn.Parameter) and id(v) not in own:
                found[id(v)] = v
    except _WalkTooLong:  # (what was found so far stands)
        pass
    return list(found.values())


class _WalkTooLong(Exception):
    """:func:`_nodes_below` met more than :data:`_BELOW_WALK_LIMIT` nodes."""


def _nodes_below(output_fns: List[Any], stop: AbstractSet[int] = frozenset()) -> Iterator[Any]:
    """Each autograd node below the model's output nodes (what the output depends on), once,
    depth first, not below the nodes whose ids are in ``stop``; raises :class:`_WalkTooLong`
    past :data:`_BELOW_WALK_LIMIT` of them (once, at the first step)."""
    stack = [f for f in output_fns if f is not None]
    seen = {id(f) for f in stack}
    while stack:
        node = stack.pop()
        yield node
        if id(node) in stop:
            continue
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is not None and id(nxt) not in seen:
                if len(seen) >= _BELOW_WALK_LIMIT:
                    raise _WalkTooLong
                seen.add(id(nxt))
                stack.append(nxt)


def live_optimizers() -> Iterator[Any]:
    """Every torch optimizer that exists now, including those that have not stepped. Scans
    every live object: only where a fact cannot be had otherwise."""
    from torch.optim import Optimizer

    for o in gc.get_objects():  # (by type: an object's __class__ may warn, torch.distributed.reduce_op's does)
        if issubclass(type(o), Optimizer):
            yield o


def _held_by(opt: Any) -> Set[int]:
    """The ids of the tensors optimizer ``opt`` holds (none when it cannot be read)."""
    try:
        return {id(p) for g in opt.param_groups for p in g["params"]}
    except Exception:  # pragma: no cover - an optimizer we cannot read
        return set()


def _path_to_output(fn: Any, targets: Dict[int, Any]) -> Optional[List[Any]]:
    """Depth-first from the loss's node to the first model output's, the nodes on the way."""
    stack: List[Tuple[Any, List[Any]]] = [(fn, [fn])]
    seen = {id(fn)}
    visited = 0
    while stack and visited < _WALK_LIMIT:
        node, trail = stack.pop()
        visited += 1
        if id(node) in targets:
            return trail
        for nxt, _ in reversed(getattr(node, "next_functions", ())):
            if nxt is not None and id(nxt) not in seen:
                seen.add(id(nxt))
                stack.append((nxt, trail + [nxt]))
    return None


def _producer(node: Any) -> Any:
    """The operation that produced the output's values: past indexing and reshaping
    (``torch.sigmoid(z)[:, 0]`` is a sigmoid output)."""
    for _ in range(8):
        if op_name(node) not in _VIEWS:
            break
        nxt = [f for f, _ in getattr(node, "next_functions", ()) if f is not None]
        if len(nxt) != 1:
            break
        node = nxt[0]
    return node


def _output_shape(d: Dict[str, Any], path: List[Any], output: Any, outputs: Dict[int, Any]) -> None:
    import torch

    if isinstance(output, torch.Tensor):
        d["output_numel"] = int(output.numel())
        d["output_shape"] = [int(s) for s in output.shape]
        if output.dim() >= 1:
            d["output_units"] = int(output.shape[-1])


def _comparison(d: Dict[str, Any], path: List[Any], output: Any, outputs: Dict[int, Any]) -> None:
    """What the loss compared with the target (the first node on the path that saved its
    input: MseLoss, SmoothL1Loss, NllLoss...; Abs for a written-out L1), and for a negative
    log-likelihood its classes (dim 1 of its input, torch's class axis: the channels of a
    segmentation map, the similarities of a contrastive loss); its reduction, and a softmax
    taken over the batch."""
    import torch

    for node in path[:-1]:
        saved = getattr(node, "_saved_self", None)
        if isinstance(saved, torch.Tensor):
            d["compared_numel"] = int(saved.numel())
            if op_name(node).startswith("NllLoss") and saved.dim() >= 1:
                d["class_units"] = int(saved.shape[1] if saved.dim() >= 2 else saved.shape[0])
            break
    reduction = next((r for r in (getattr(n, "_saved_reduction", None) for n in path[:-1]) if r is not None), None)
    if reduction in _REDUCTIONS:
        d["reduction"] = _REDUCTIONS[reduction]
    if any(_normalizes_dim0(n) for n in path[:-1]):
        d["softmax_over_batch"] = True


def _penalties(d: Dict[str, Any], path: List[Any], output: Any, outputs: Dict[int, Any]) -> None:
    penalized = _penalized_parameters(path[0], outputs)
    if penalized:
        d["penalized_params"] = penalized


def _ranges(d: Dict[str, Any], path: List[Any], output: Any, outputs: Dict[int, Any]) -> None:
    """Output and target ranges, the targets' variance, their classes' entropy and the output's
    spread across the batch: reduced
    on the device into one vector, read at registration (``LoopFacts.loss_facts``), not here
    in the middle of the first step. A value that cannot be computed is NaN (only it lost)."""
    import torch

    target = _target(path, output)
    # The tensors whose (min, max) are wanted, or None: the output, a float target, class indices.
    bounded: List[Any] = [
        output if isinstance(output, torch.Tensor) and output.is_floating_point() and output.numel() else None,
        target if isinstance(target, torch.Tensor) and target.is_floating_point() and target.numel() else None,
        target if isinstance(target, torch.Tensor) and not target.is_floating_point() and target.numel() > 1 else None,
    ]
    device = next((t.device for t in bounded if t is not None), None)
    if device is None:
        return

    def nan(n: int) -> List[Any]:  # (made on the device: a copy from the host would wait for its queue)
        return list(torch.full((n,), float("nan"), device=device).unbind())

    def on_device(compute: Callable[[Any], List[Any]], t: Any, n: int) -> List[Any]:
        """``compute(t)``, or ``n`` NaNs where ``t`` is absent or elsewhere, or the statistic
        is one this tensor or device does not allow."""
        if t is None or t.device != device:
            return nan(n)
        try:
            return compute(t)
        except Exception:
            return nan(n)

    def aminmax(t: Any) -> List[Any]:
        return list(torch.aminmax(t.detach().float()))

    def variance(t: Any) -> List[Any]:
        return [t.detach().float().var()]

    values: List[Any] = []
    for t in bounded:
        values.extend(on_device(aminmax, t, 2))
    # The targets' variance: the loss of predicting their mean, for a regression loss.
    regressed = bounded[1] if bounded[1] is not None and bounded[1].numel() > 1 else None
    values.extend(on_device(variance, regressed, 1))
    binary = any(op.startswith("BinaryCrossEntropy") for op in d["ops"])
    classes = int(d.get("class_units", d.get("output_units")) or 0)
    # (A weighted loss's constant guess is not at the frequencies' entropy, nor its exact
    # prediction at the targets' own.)
    if _weighted(path):
        values.extend(nan(3))
    elif binary:
        values.extend(on_device(_binary_entropy, bounded[1], 3))
    else:
        indices = bounded[2] if classes >= 2 else None
        values.extend(on_device(lambda t: _class_entropy(t, classes), indices, 2) + nan(1))
    values.append(_batch_spread(bounded[0], device))
    # A binary cross-entropy's labels: the most marked present (>= 0.5) in one sample.
    labels = bounded[1] if binary and bounded[1] is not None and bounded[1].dim() >= 2 else None
    values.extend(on_device(lambda t: [(t.detach() >= 0.5).sum(-1).amax().float()], labels, 1))
    stacked = torch.stack(values)
    if stacked.device.type == "cuda":
        host = torch.empty(len(values), dtype=torch.float32, pin_memory=True)
        host.copy_(stacked, non_blocking=True)
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(stacked.device))
        d["_ranges"] = (host, event)
    else:
        d["_ranges"] = (stacked, None)


def _weighted(path: List[Any]) -> bool:
    """Whether the loss weighs its classes (``CrossEntropyLoss(weight=...)``) or its positives
    (``BCEWithLogitsLoss(pos_weight=...)``) unequally: the tensors its node saved."""
    import torch

    return any(
        isinstance(getattr(n, attr, None), torch.Tensor)
        for n in path[:-1]
        for attr in ("_saved_weight", "_saved_pos_weight")
    )


def _target(path: List[Any], output: Any) -> Any:
    """The tensor the loss compared the output with: saved by the loss's node, or the other
    operand of a written-out loss (``((out - y) ** 2).mean()``)."""
    import torch

    target = next(
        (t for t in (getattr(n, "_saved_target", None) for n in path[:-1]) if isinstance(t, torch.Tensor)),
        None,
    )
    if target is None and isinstance(output, torch.Tensor):
        target = _written_out_target(path, output)
    return target


# The loss's facts besides its path, each read on its own by :func:`_describe`.
_LOSS_FACTS: Tuple[Callable[[Dict[str, Any], List[Any], Any, Dict[int, Any]], None], ...] = (
    _output_shape,
    _comparison,
    _penalties,
    _ranges,
)


def _class_entropy(indices: Any, classes: int) -> List[Any]:
    """The entropy (nats) of how often each class occurs among class-index targets, and its
    standard error as an estimate from this batch: the loss of a model that predicts those
    frequencies and nothing of the input. Indices outside ``[0, classes)`` (an
    ``ignore_index``) are not counted."""
    import torch

    idx = indices.detach().flatten()
    kept = ((idx >= 0) & (idx < classes)).float()
    counts = torch.zeros(classes, device=idx.device).index_add_(0, idx.clamp(0, classes - 1), kept)
    return _entropy_and_error(counts / counts.sum().clamp(min=1.0), counts.sum())


def _binary_entropy(targets: Any) -> List[Any]:
    """A binary cross-entropy's counterpart of :func:`_class_entropy`: the entropy of how often
    a target is 1, over all of the batch's targets, where every one is 0 or 1, and its standard
    error; then the targets' own entropy, the mean of each target's binary entropy (nats): the
    loss of a model that predicts every one exactly, exactly 0 for 0/1 targets (NaN where a
    target is outside [0, 1]). Soft targets have no frequencies' entropy: their constant
    guess is judged by their own."""
    import torch

    t = targets.detach().float()
    p = t.mean()
    h, se = _entropy_and_error(torch.stack([p, 1 - p]), torch.tensor(float(t.numel()), device=t.device))
    nan = torch.full_like(h, float("nan"))
    own = -(torch.special.xlogy(t, t) + torch.special.xlogy(1 - t, 1 - t)).mean()
    own = torch.where(((t >= 0) & (t <= 1)).all(), own, nan)
    return [torch.where(own == 0, h, nan), se, own]


def _entropy_and_error(p: Any, n: Any) -> List[Any]:
    """The entropy of frequencies ``p`` measured on ``n`` samples, and its standard error
    (the delta method: the variance of ``-ln p`` over the samples, over ``n``)."""
    import torch

    logs = torch.log(torch.where(p > 0, p, torch.ones_like(p)))
    h = -(p * logs).sum()
    se = (((p * logs * logs).sum() - h * h).clamp(min=0.0) / n.clamp(min=1.0)).sqrt()
    return [h, se]


def _batch_spread(output: Any, device: Any) -> Any:
    """How far the output varies across the batch (its first dimension), on the device: the
    largest range over the batch of any one output element, over the output's largest
    magnitude; 0 when every sample got the same output, NaN for fewer than 2 samples."""
    import torch

    if output is None or output.device != device or output.dim() < 1 or output.shape[0] < 2:
        return torch.full((), float("nan"), device=device)
    try:
        flat = output.detach().float().flatten(1) if output.dim() > 1 else output.detach().float()[:, None]
        lo, hi = torch.aminmax(flat, dim=0)
        scale = flat.abs().max()
        spread = (hi - lo).max()
        # (An output of zeros everywhere is the same for every sample: 0, not 0/0.)
        return torch.where(scale > 0, spread / scale.clamp(min=torch.finfo(torch.float32).tiny), spread * 0)
    except Exception:  # pragma: no cover - a device without these ops: this fact only is lost
        return torch.full((), float("nan"), device=device)


# torch's reduction codes, as autograd saves them (``_saved_reduction``).
_REDUCTIONS = {0: "none", 1: "mean", 2: "sum"}


def _penalized_parameters(fn: Any, outputs: Dict[int, Any]) -> int:
    """How many parameters the loss penalizes directly: leaves it reaches from its root through
    sums, scalings and a norm only (``loss + 0.1 * sum(w.pow(2).sum() ...)``), never through
    the model's output (the nodes ``outputs``) or any other computation."""
    found = set()
    stack: List[Tuple[Any, bool]] = [(fn, False)]
    seen = {id(fn)}
    while stack and len(seen) < 16 * _WALK_LIMIT:
        node, normed = stack.pop()
        for nxt, _ in getattr(node, "next_functions", ()):
            if nxt is None or id(nxt) in seen or id(nxt) in outputs:
                continue
            seen.add(id(nxt))
            name = op_name(nxt)
            if name == "AccumulateGrad":
                if normed:
                    found.add(id(getattr(nxt, "variable", nxt)))
            elif name in _PENALTY_OPS:
                stack.append((nxt, normed or name in _NORM_OPS))
    return len(found)


def _normalizes_dim0(node: Any) -> bool:
    """Whether ``node`` is a softmax or log-softmax taken over the first (batch) dimension of a
    tensor of two or more: every class's probability then depends on the other samples."""
    if op_name(node) not in ("Softmax", "LogSoftmax"):
        return False
    dim, result = getattr(node, "_saved_dim", None), getattr(node, "_saved_result", None)
    if not isinstance(dim, int) or result is None or result.dim() < 2:
        return False
    if dim >= 2**63:  # (a negative dim, as autograd saves it: unsigned)
        dim -= 2**64
    return dim % result.dim() == 0


def _written_out_target(path: List[Any], output: Any) -> Any:
    """The target of a regression loss written out as ``(output - target)`` squared or absolute
    (``torch.mean((y - out) ** 2)``): recovered from the difference the square or the absolute
    value saved, and the output. None for anything else (a target the output was broadcast
    against, a scaled difference, views that change the values)."""
    import torch

    for k in range(1, len(path) - 1):
        node, consumer = path[k], path[k - 1]
        if op_name(node) != "Sub" or op_name(consumer) not in ("Pow", "Abs"):
            continue
        if any(op_name(n) not in _VIEWS for n in path[k + 1 : -1]):
            return None
        diff = getattr(consumer, "_saved_self", None)
        alpha = getattr(node, "_saved_alpha", 1)
        if not isinstance(diff, torch.Tensor) or diff.numel() != output.numel() or alpha != 1:
            return None
        side = [i for i, (f, _) in enumerate(node.next_functions) if f is path[k + 1]]
        out = output.detach().reshape(diff.shape)
        if side == [0]:  # output - target
            return out - diff.detach()
        if side == [1]:  # target - output
            return diff.detach() + out
        return None
    return None


def unscaled_loss(tensors: Any) -> Any:
    """The loss whose backward runs, without GradScaler's scale (``scaler.scale(loss)``
    multiplies by a constant 1-element tensor), so it keeps its own scale."""
    import torch

    fn = tensors.grad_fn
    if type(fn).__name__ != "MulBackward0":
        # Being differentiated: its graph lets go of its saved tensors in this backward, and
        # it is read under no_grad (or by the host reader), so no detach is needed.
        return tensors
    loss = tensors.detach()
    try:
        other = getattr(fn, "_saved_other", None)
    except RuntimeError:  # freed by its backward already
        other = None
    if isinstance(other, torch.Tensor) and other.numel() == 1 and not other.requires_grad:
        loss = loss / other.detach()
    return loss.reshape(())
