"""The watched model as the engine sees it: its modules and trainable parameters, the model
description registered with the engine (forward order, kinds, fan-in), and the search for the
module whose own computation first produced a NaN/Inf. Host-side bookkeeping; the only tensor
work is the finiteness check of kept outputs (:func:`~neuraldbg._measure.finite_flags`) and,
once at registration, which weights have identical units (:func:`~neuraldbg._measure.identical_rows`)."""

from __future__ import annotations

from typing import Any, Dict, List, Optional, Tuple

import numpy as np

from ._hooks import is_passive
from ._measure import finite_flags, identical_rows
from ._record import CALL_RECORDER

# Modules that hold a lookup table rather than a transform: their weight scale says nothing
# about signal propagation.
TABLE_MODULES = {"Embedding", "EmbeddingBag"}

# Transforms whose output units are the rows of their weight (dim 0): units that start with
# identical weights compute the same, get the same gradient and never become different.
UNIT_TRANSFORMS = ("Linear", "Conv", "ConvTranspose", "RNN", "LSTM", "GRU", "Bilinear")

# Normalization layers: they keep the layout of the transform before them.
NORMS = ("BatchNorm", "GroupNorm", "InstanceNorm", "LayerNorm", "LocalResponseNorm", "RMSNorm")


class WatchedModel:
    """Modules (``model.named_modules()`` order) and parameters of one model, each parameter
    owned by the first module that holds it directly.

    Every parameter is watched, also one frozen now (``requires_grad=False``): it is observed
    from its first gradient on when it is unfrozen later (fine-tuning schedules), and the
    engine is told which were frozen at the start (not a stalled layer). A parameter held by
    several modules (tied embeddings: ``lm_head.weight is wte.weight``) belongs to its first
    module; the others are ``tied`` to it, so that their names resolve to its layer."""

    def __init__(self, model: Any) -> None:
        import torch

        self.names: List[str] = []
        self.modules: List[Any] = []
        for name, m in model.named_modules():
            self.names.append(name)
            self.modules.append(m)
        self.by_name = {n: i for i, n in enumerate(self.names)}
        # TorchScript modules take no Python hooks: they are watched from around (their
        # parameters' gradients, their callers' calls).
        self.scripted = [isinstance(m, torch.jit.ScriptModule) for m in self.modules]

        self.params: List[Any] = []
        self.param_names: List[str] = []
        self.param_owner: List[int] = []
        # Per parameter: the other modules that hold it too (tied weights).
        self.tied: List[List[int]] = []
        index: Dict[int, int] = {}
        for i, m in enumerate(self.modules):
            for pname, p in m.named_parameters(recurse=False):
                if p is None:
                    continue
                k = index.get(id(p))
                if k is not None:
                    if i != self.param_owner[k] and i not in self.tied[k]:
                        self.tied[k].append(i)
                    continue
                index[id(p)] = len(self.params)
                self.params.append(p)
                self.param_names.append(f"{self.names[i]}.{pname}" if self.names[i] else pname)
                self.param_owner.append(i)
                self.tied.append([])
        self.param_ids = set(index)
        # Engine order (executed modules in forward order, the others after their nearest
        # executed ancestor) and each module's rank in it; set by :meth:`spec`.
        self.spec_order: List[int] = []
        self.rank: Dict[int, int] = {}
        # The same ranks as an array by module index (for the extension's tables).
        self.rank_of = np.full(len(self.modules), -1, dtype=np.int64)

    def spec(self, executed: List[int], optimizer: Optional[str]) -> Dict[str, Any]:
        """The engine's ``ModelSpec`` (as a dict for JSON), given the forward order of the
        first step; fixes :attr:`spec_order` and :attr:`rank`."""
        import torch

        pos = {m: k for k, m in enumerate(executed)}
        by_name = self.by_name
        # Modules that never ran go right after their nearest ancestor that did.
        keys: List[Tuple[float, int]] = []
        for i, name in enumerate(self.names):
            if i in pos:
                keys.append((float(pos[i]), i))
                continue
            anchor = -1.0
            parts = name.split(".")
            for cut in range(len(parts) - 1, -1, -1):
                j = by_name.get(".".join(parts[:cut]))
                if j is not None and j in pos:
                    anchor = float(pos[j])
                    break
            keys.append((anchor + 0.5 + i * 1e-6, i))
        keys.sort()
        self.spec_order = [i for _, i in keys]
        rank = {m: k for k, m in enumerate(self.spec_order)}
        self.rank = rank
        self.rank_of[self.spec_order] = np.arange(len(self.spec_order))

        modules = []
        for i in self.spec_order:
            m = self.modules[i]
            attrs = []
            # Hardtanh's bounds, and the share of units a dropout module zeroes.
            names = ("min_val", "max_val") + (("p",) if "Dropout" in type(m).__name__ else ())
            for a in names:
                v = getattr(m, a, None)
                if isinstance(v, (int, float)):
                    attrs.append([a, float(v)])
            modules.append({"name": self.names[i], "kind": type(m).__name__, "attrs": attrs, "executed": i in pos})
        params = []
        for p, pname, owner, tied in zip(self.params, self.param_names, self.param_owner, self.tied):
            leaf = pname.rsplit(".", 1)[-1]
            role = "weight" if leaf.startswith("weight") else "bias" if leaf.startswith("bias") else "other"
            fan_in = None
            kind = type(self.modules[owner]).__name__
            # A lazy module that has not run yet holds parameters with no shape.
            lazy = isinstance(p, torch.nn.parameter.UninitializedParameter)
            if not lazy and role == "weight" and p.dim() >= 2 and kind not in TABLE_MODULES:
                fan_in = int(p.shape[1]) * int(np.prod(p.shape[2:])) if p.dim() > 2 else int(p.shape[1])
            spec: Dict[str, Any] = {
                "module": rank[owner],
                "name": pname,
                "numel": 0 if lazy else int(p.numel()),
                "role": role,
                "fan_in": fan_in,
            }
            if tied:
                spec["tied"] = [rank[m] for m in tied]
            if not p.requires_grad:
                spec["frozen"] = True
            params.append(spec)
        for k in self._identical_units():
            params[k]["identical_units"] = True
        return {"modules": modules, "params": params, "optimizer": optimizer}

    def _identical_units(self) -> List[int]:
        """The trainable weights of transforms (Linear, Conv, recurrent) whose units all have
        the same weights, not all zero (a constant initialization): read once, one transfer."""
        import torch

        picked: List[int] = []
        for k, (p, pname, owner) in enumerate(zip(self.params, self.param_names, self.param_owner)):
            kind = type(self.modules[owner]).__name__
            if (
                type(p) is torch.nn.Parameter  # (not a lazy, sharded or meta parameter)
                and type(p.data) is torch.Tensor
                and p.requires_grad
                and not p.is_meta
                and pname.rsplit(".", 1)[-1].startswith("weight")
                and kind.startswith(UNIT_TRANSFORMS)
                and p.dim() >= 2
                and p.shape[0] >= 2
                and p[0].numel() >= 2
            ):
                picked.append(k)
        # (One device's weights: a model spread over several is read on its first.)
        picked = [k for k in picked if self.params[k].device == self.params[picked[0]].device]
        try:
            flags = identical_rows([self.params[k] for k in picked])
        except Exception:  # pragma: no cover - a weight we cannot read: no fact
            return []
        return [k for k, same in zip(picked, flags) if same]

    def unit_axes(self, executed: List[int]) -> Dict[int, int]:
        """Per executed module: 1 (channels) when the nearest transform with parameters before
        it in the forward order is a convolution, else -1 (features last). Normalization layers
        in between (Conv -> BatchNorm -> ReLU) keep the convolution's layout. One pass."""
        owners = set(self.param_owner)
        axes: Dict[int, int] = {}
        axis = -1
        for m in executed:
            axes[m] = axis
            if m in owners:
                kind = type(self.modules[m]).__name__
                if not any(n in kind for n in NORMS):
                    axis = 1 if kind.startswith("Conv") else -1
        return axes

    def first_nonfinite(self, refs: List[Tuple[int, Any, Any]]) -> Optional[int]:
        """Index (in the engine's module order) of the module whose own computation first
        produced a NaN/Inf in this step's forward pass.

        Module calls are scanned in completion order. The first call with a non-finite output
        is the origin if its inputs were finite. If its inputs were already non-finite, no
        module that had finished produced them: they came from inline code (``torch.softmax``,
        a division...) of a module still running: the enclosing module (skipping
        ``nn.Sequential``, which has no code of its own), which is reported.

        Runs only on a step whose gradients or loss are not finite (or after a crash), while
        the parameters are still those of the forward pass: one batched finiteness check of
        every kept output, one of the culprit's inputs. Recorded layers that kept only their
        inputs have their output computed again from them.
        """
        calls = []
        for i, out, args in refs:
            if out is None and args is not None:
                # A recorded layer that kept only its inputs (see _hooks.make_record).
                out = CALL_RECORDER.recompute(self.modules[i], args)
            if out is not None:
                calls.append((i, out, args))
        flags = finite_flags([out for _, out, _ in calls])
        for (i, _, args), ok in zip(calls, flags):
            if ok:
                continue
            inputs_finite = all(finite_flags([args]))
            if inputs_finite or i == 0:
                return self.rank.get(i)
            return self.rank.get(self._enclosing(i))
        return None

    def first_nonfinite_summary(self, summary: List[Tuple[int, float, bool, bool]]) -> Optional[int]:
        """:meth:`first_nonfinite` from the device path's summaries of the calls (module index,
        output scale, output finite, inputs finite), in completion order."""
        for i, _, out_ok, in_ok in summary:
            if out_ok:
                continue
            if in_ok or i == 0:
                return self.rank.get(i)
            return self.rank.get(self._enclosing(i))
        return None

    def module_table(self, ranks: np.ndarray, values: np.ndarray) -> np.ndarray:
        """Per engine module, its largest value (NaN: none); a module called several times in
        the step (a shared block) keeps its largest output."""
        table = np.full(len(self.spec_order), np.nan, dtype=np.float32)
        np.fmax.at(table, ranks, values)
        return table

    def replayable(self) -> bool:
        """Whether a forward pass of this model can be computed again without writing its
        parameters: not with an ``nn.Embedding`` that renormalizes its weight in place when
        called (``max_norm``)."""
        return not any(
            type(m).__name__ in TABLE_MODULES and getattr(m, "max_norm", None) is not None for m in self.modules
        )

    def replay(self, model: Any, calls: List[Tuple[Any, Any]]) -> Optional[List[Tuple[int, Any, Any]]]:
        """The module calls of forward passes that were not recorded, found by computing them
        again: ``model.forward`` on each call's ``(args, kwargs)`` (as the model's forward
        pre-hook saw them), no grad, with a temporary forward hook on every module. Returns
        ``(index, output, args)`` of every module call in completion order (as kept
        references are; :meth:`first_nonfinite` scans them), or None when a call raised.

        Runs only on a step that went non-finite, while the parameters are still those of the
        forward pass (before the optimizer step). It leaves the model as it was: every module runs on copies of its buffers (BatchNorm's running
        statistics are not updated twice, and tensors autograd saved are not written), and the
        CPU random generator is restored (the loop's random stream is not shifted; dropout
        masks differ from the original pass, which changes no value from finite to
        non-finite). What the replay cannot undo is the model's own Python code: forward hooks
        other than ours (the user's) run once more, and a forward that counts its calls counts
        this one (on a failing step only)."""
        import torch

        refs: List[Tuple[int, Any, Any]] = []
        handles = []
        saved: List[Tuple[Dict[str, Any], Dict[str, Any]]] = []
        rng = torch.get_rng_state()
        try:
            for i, m in enumerate(self.modules):
                buffers = m._buffers
                if buffers:
                    saved.append((buffers, dict(buffers)))
                    for name, b in list(buffers.items()):
                        if b is not None:
                            buffers[name] = b.detach().clone()
                if i and not self.scripted[i]:
                    handles.append(m.register_forward_hook(_replay_hook(i, refs)))
            with torch.no_grad():
                for args, kwargs in calls:
                    out = model.forward(*args, **(kwargs or {}))
                    refs.append((0, out, args))
            return refs
        except Exception:
            return None
        finally:
            for h in handles:
                h.remove()
            for buffers, original in saved:
                buffers.update(original)
            torch.set_rng_state(rng)

    def _parent(self, i: int) -> int:
        name = self.names[i]
        parent = name.rsplit(".", 1)[0] if "." in name else ""
        return self.by_name.get(parent, 0)

    def _enclosing(self, i: int) -> int:
        p = self._parent(i)
        while p != 0 and type(self.modules[p]).__name__ == "Sequential" and is_passive(self.modules[p]):
            p = self._parent(p)
        return p


def _replay_hook(index: int, refs: List[Tuple[int, Any, Any]]) -> Any:
    def hook(module: Any, args: Any, output: Any) -> None:
        refs.append((index, output, args))

    return hook


def learn_order(refs: List[Tuple[int, Any, Any]]) -> Tuple[List[int], set]:
    """The modules of a forward's recorded calls, each once, in the order they completed."""
    order: List[int] = []
    done = set()
    for i, _, _ in refs:
        if i not in done:
            done.add(i)
            order.append(i)
    return order, done
