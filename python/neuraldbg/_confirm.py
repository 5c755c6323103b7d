"""``neuraldbg run --confirm``: each top hypothesis's remedy tried in a fresh run of the script.

The script runs again from its start, in a fresh process (``neuraldbg run`` itself, with the
same seed and step count): once unchanged, and once per mechanical remedy, which the child
applies at the optimizer and model level (:class:`Remedy`, given by the hidden ``--apply``).
A hypothesis is ``confirmed`` only when its failure did not recur with the remedy (nor any other
failure the run confidently blamed on the same cause: one re-run, one verdict on its cause)
*and* the loss ended better than the unchanged re-run's by more than two identical runs differ
(the first run against the unchanged re-run, and never less than :data:`MIN_GAIN` of the loss).

Which remedy a cause calls for is an intervention chosen here, not a diagnosis: the cause
comes from the engine's hypothesis.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Dict, List, Optional, Sequence, Tuple

__all__ = ["REMEDIES", "Confirm", "Remedy"]

# The mechanical remedy of each cause: (kind, value). Causes not here are left untested.
REMEDIES: Dict[str, Tuple[str, Any]] = {
    "learning_rate_too_high": ("lr_scale", 0.1),
    "learning_rate_too_low": ("lr_scale", 10.0),
    "missing_zero_grad": ("zero_grad", None),
    "eval_mode": ("train_mode", None),
    "parameters_not_updated": ("add_parameters", None),
    "poor_initialization": ("reinit", None),
    "dying_relu": ("leaky_relu", None),
    "bad_input_data": ("standardize", None),
    "output_loss_mismatch": ("remove_output_activation", None),
    "numerical_instability": ("clip", 1.0),
}

# The remedies that act on the hypothesis's layer; the others act on the whole model or its
# optimizers, so hypotheses of one cause at different layers share one re-run.
_BY_LAYER = ("reinit", "remove_output_activation")

# Two runs' losses differing by less than this fraction of the loss are not told apart.
MIN_GAIN = 0.01
# Final losses are the mean of this many last steps.
WINDOW = 5
# A failure "recurs" when a run has a hypothesis of it at least this confident.
CONFIDENT = 0.5

_ACTIVATIONS = ("Softmax", "LogSoftmax", "Sigmoid", "Tanh", "Softmax2d", "Hardtanh", "Hardsigmoid")


def _describe(spec: Dict[str, Any]) -> str:
    """The remedy in words, for the verdicts."""
    kind, value, layer = spec["kind"], spec.get("value", 1.0), spec.get("layer")
    if kind == "lr_scale":
        text = f"learning rate x{float(value):g}"
    elif kind == "clip":
        text = f"gradients clipped at norm {float(value):g}"
    else:
        text = {
            "zero_grad": "optimizer.zero_grad() after each step",
            "train_mode": "model.train() before each forward",
            "add_parameters": "parameters missing from the optimizer added to it",
            "reinit": f"the weights of {layer} (or of the layer before it) re-initialized"
            if layer
            else "every layer re-initialized",
            "leaky_relu": "ReLU replaced by LeakyReLU(0.01)",
            "standardize": "inputs standardized (first batch's mean and std)",
            "remove_output_activation": f"output activation {layer} removed" if layer else "output activation removed",
        }.get(kind, kind)
    return f"{text} ({spec['model']})" if spec.get("model") else text


# ------------------------------------------------------------------------- in the child


class Remedy:
    """One remedy, applied by a ``neuraldbg run --apply`` child to the model it names (or
    every model) as it is found and to the optimizers that train it. ``notes`` receives what
    was done, or why it could not be."""

    def __init__(self, spec: Dict[str, Any], notes: List[str]) -> None:
        self.spec = spec
        self.kind = str(spec["kind"])
        self.notes = notes
        self.modules: List[Any] = []
        self.handles: List[Any] = []
        self.done = False

    def _mine(self, name: str) -> bool:
        return self.spec.get("model") in (None, name)

    def model_found(self, name: str, module: Any) -> None:
        if not self._mine(name):
            return
        self.modules.append(module)
        kind, layer = self.kind, self.spec.get("layer")
        if kind == "reinit":
            self._note(_reinit(module, layer))
        elif kind == "leaky_relu":
            self._note(_leaky(module))
        elif kind == "remove_output_activation":
            self._note(_remove_activation(module, layer))
        elif kind == "train_mode":

            def train(m: Any, args: Any) -> None:
                if not m.training:
                    m.train()

            self.handles.append(module.register_forward_pre_hook(train))
            self._note("model.train() before each forward")
        elif kind == "standardize":
            self.handles.append(module.register_forward_pre_hook(_Standardize()))
            self._note("inputs standardized with the first batch's mean and std")

    def optimizer_made(self, optimizer: Any) -> None:
        mine = {id(p) for m in self.modules for p in m.parameters()}
        held = [p for g in optimizer.param_groups for p in g["params"]]
        if not any(id(p) in mine for p in held):
            return
        kind, value = self.kind, self.spec.get("value", 1.0)
        if kind == "lr_scale":
            saved: List[float] = []

            def scale(opt: Any, args: Any, kwargs: Any) -> None:
                # The scheduler's learning rate, scaled for this step only: schedules compose.
                saved[:] = [g["lr"] for g in opt.param_groups]
                for g in opt.param_groups:
                    g["lr"] = g["lr"] * float(value)

            def restore(opt: Any, args: Any, kwargs: Any) -> None:
                for g, lr in zip(opt.param_groups, saved):
                    g["lr"] = lr

            self.handles += [optimizer.register_step_pre_hook(scale), optimizer.register_step_post_hook(restore)]
            self._note(f"learning rate x{float(value):g} in {type(optimizer).__name__}")
        elif kind == "zero_grad":
            self.handles.append(optimizer.register_step_post_hook(lambda opt, a, k: opt.zero_grad()))
            self._note(f"{type(optimizer).__name__}.zero_grad() after each step")
        elif kind == "clip":
            import torch

            def clip(opt: Any, args: Any, kwargs: Any) -> None:
                torch.nn.utils.clip_grad_norm_([p for g in opt.param_groups for p in g["params"]], float(value))

            self.handles.append(optimizer.register_step_pre_hook(clip))
            self._note(f"gradients clipped at norm {float(value):g} before each {type(optimizer).__name__} step")
        elif kind == "add_parameters" and not self.done:
            ids = {id(p) for p in held}
            missing = [p for m in self.modules for p in m.parameters() if id(p) not in ids]
            for p in missing:
                p.requires_grad_(True)
            zero = [g for g in optimizer.param_groups if g.get("lr") == 0]
            for g in zero:
                g["lr"] = optimizer.defaults.get("lr", 1e-3) or 1e-3
            if missing:
                optimizer.add_param_group({"params": missing})
            self.done = True
            if missing or zero:
                self._note(
                    f"{len(missing)} parameter(s) added to {type(optimizer).__name__}, {len(zero)} group(s) with lr 0 given lr"
                )
            else:
                self._note("not applicable: every parameter is in the optimizer with a learning rate")

    def _note(self, text: str) -> None:
        if text not in self.notes:
            self.notes.append(text)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


class _Standardize:
    """A forward pre-hook: the model's first tensor input standardized per feature, with the
    mean and std of the first batch it sees."""

    def __init__(self) -> None:
        self.stats: Optional[Tuple[Any, Any]] = None

    def __call__(self, module: Any, args: Tuple[Any, ...]) -> Any:
        import torch

        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point() or args[0].dim() < 2:
            return None
        x = args[0]
        if self.stats is None:
            with torch.no_grad():
                self.stats = (x.mean(dim=0, keepdim=True), x.std(dim=0, keepdim=True).clamp_min(1e-6))
        mean, std = self.stats
        if mean.shape[1:] != x.shape[1:]:
            return None
        return ((x - mean) / std, *args[1:])


def _resettable(m: Any) -> bool:
    return callable(getattr(m, "reset_parameters", None))


def _reinit(module: Any, layer: Optional[str]) -> str:
    try:
        target = module.get_submodule(layer) if layer else module
    except AttributeError:
        return f"not applicable: no layer {layer!r} in {type(module).__name__}"
    name = layer or type(module).__name__
    resets = [m for m in target.modules() if _resettable(m)]
    if not resets and layer:
        # A parameterless layer (a ReLU whose units are dead) is set by the weights before it:
        # the nearest earlier layer, in the order the model registers them, that can be reset.
        before = []
        for n, m in module.named_modules():
            if n == layer:
                break
            if _resettable(m) and not any(_resettable(c) for c in m.children()):
                before.append((n, m))
        if before:
            name, last = before[-1]
            name = f"{name} (the layer before {layer})"
            resets = [last]
    for m in resets:
        m.reset_parameters()
    if not resets:
        return f"not applicable: {name} has no reset_parameters()"
    return f"{name} re-initialized ({len(resets)} module(s) reset)"


def _leaky(module: Any) -> str:
    import torch

    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.ReLU:
                setattr(parent, name, torch.nn.LeakyReLU(0.01))
                count += 1
    if not count:
        return "not applicable: no nn.ReLU module (a functional relu cannot be replaced)"
    return f"{count} nn.ReLU replaced by LeakyReLU(0.01)"


def _remove_activation(module: Any, layer: Optional[str]) -> str:
    import torch

    names = [n for n, m in module.named_modules() if n and type(m).__name__ in _ACTIVATIONS]
    if layer in names:
        target = layer
    elif names:
        target = names[-1]
    else:
        return "not applicable: no output activation module (a functional one cannot be removed)"
    assert target is not None
    parent_name, _, child = target.rpartition(".")
    parent = module.get_submodule(parent_name) if parent_name else module
    setattr(parent, child, torch.nn.Identity())
    return f"{target} replaced by nn.Identity"


# ------------------------------------------------------------------------- in the parent


def remedy_for(h: Dict[str, Any]) -> Optional[Dict[str, Any]]:
    """The mechanical remedy of a hypothesis (from ``--json``), or None."""
    found = REMEDIES.get(h["cause"])
    if found is None:
        return None
    kind, value = found
    return {
        "model": h.get("model"),
        "kind": kind,
        "value": value,
        "layer": h.get("layer") if kind in _BY_LAYER else None,
    }


def _final_loss(run: Dict[str, Any], model: Optional[str], steps: int) -> Optional[float]:
    """Where the loss got to: the mean of the last steps before ``steps``; infinite when it went
    non-finite; None when no loss was seen."""
    for m in run.get("models", []):
        if model is None or m["name"] == model:
            pairs = [(s, v) for s, v in zip(m["loss_steps"], m["loss"]) if s < steps]
            if not pairs:
                return None
            if any(v is None for _, v in pairs):
                return math.inf
            tail = [v for _, v in pairs[-WINDOW:]]
            return sum(tail) / len(tail)
    return None


def _curve(run: Dict[str, Any], model: Optional[str], steps: int) -> List[Tuple[int, Any]]:
    for m in run.get("models", []):
        if model is None or m["name"] == model:
            return [(s, v) for s, v in zip(m["loss_steps"], m["loss"]) if s < steps]
    return []


def _recurs(run: Dict[str, Any], h: Dict[str, Any], failure: Optional[str] = None) -> bool:
    """Whether ``run`` has ``h``'s failure (or ``failure``) in ``h``'s model, confidently."""
    failure = h["failure"] if failure is None else failure
    return any(
        o["failure"] == failure and o.get("model") == h.get("model") and o["confidence"] >= CONFIDENT
        for o in run.get("hypotheses", [])
    )


def _key(spec: Dict[str, Any]) -> str:
    return json.dumps(spec, sort_keys=True)


def blamed(hyps: Sequence[Dict[str, Any]]) -> Dict[str, List[str]]:
    """For each remedy (by :func:`_key`), the failures the run confidently blamed on its cause:
    a re-run with that remedy is one test of the cause, and it passes only if none of them
    recurs (two hypotheses of one cause cannot be confirmed and refuted by the same run)."""
    out: Dict[str, List[str]] = {}
    for h in hyps:
        spec = remedy_for(h)
        if spec is not None and h["confidence"] >= CONFIDENT:
            failures = out.setdefault(_key(spec), [])
            if h["failure"] not in failures:
                failures.append(h["failure"])
    return out


class Confirm:
    """How ``--confirm`` runs the script again: ``target`` and ``script_args`` as ``neuraldbg
    run`` was given them, the ``-o`` option words, the budget (``steps``, None for the run's
    own; ``top`` hypotheses; ``jobs`` at once), the ``seed`` of every re-run (None: none set)
    and ``env``, variables added to the children's environment."""

    def __init__(
        self,
        target: Tuple[str, str],
        script_args: Sequence[str],
        options: Sequence[str],
        steps: Optional[int],
        top: int,
        jobs: int,
        seed: Optional[int],
        env: Dict[str, str],
    ) -> None:
        self.target = target
        self.script_args = list(script_args)
        self.options = list(options)
        self.steps = steps
        self.top = max(0, int(top))
        self.jobs = max(1, int(jobs))
        self.seed = seed
        self.env = env

    def child_argv(self, folder: str, steps: int, spec: Optional[Dict[str, Any]]) -> List[str]:
        cmd = [sys.executable, "-m", "neuraldbg", "run", "--quiet", "--out", folder, "--json", folder + ".json"]
        cmd += ["--steps", str(steps)]
        if self.seed is not None:
            cmd += ["--seed", str(self.seed)]
        for o in self.options:
            cmd += ["-o", o]
        if spec is not None:
            cmd += ["--apply", json.dumps(spec)]
        cmd += ["-m", self.target[1]] if self.target[0] == "module" else ["--", self.target[1]]
        return cmd + self.script_args

    def _run_child(self, cmd: List[str], folder: str) -> Dict[str, Any]:
        env = dict(os.environ, PYTHONHASHSEED="0")
        for key, value in self.env.items():
            env[key] = os.pathsep.join(v for v in (value, env.get(key)) if v) if key == "PYTHONPATH" else value
        os.makedirs(os.path.dirname(folder) or ".", exist_ok=True)
        with open(folder + ".log", "w", encoding="utf-8") as log:
            proc = subprocess.run(cmd, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            with open(folder + ".json", encoding="utf-8") as f:
                out: Dict[str, Any] = json.load(f)
        except (OSError, ValueError):
            out = {"models": [], "hypotheses": [], "applied": []}
        out["process_exit"] = proc.returncode
        out["log"] = folder + ".log"
        return out

    def run(self, data: Dict[str, Any], out: str) -> None:
        """Adds ``verdict``, ``intervention`` and ``evidence`` to the top hypotheses of ``data``
        (the run's ``--json`` object), ranks the confirmed first, records the runs under
        ``data["confirm"]`` and prints the verdicts."""
        steps = int(self.steps or data["steps"])
        top = self.top
        hyps: List[Dict[str, Any]] = data["hypotheses"]
        if steps < 1:
            print("neuraldbg: --confirm: no optimizer step was observed; nothing to confirm", file=sys.stderr)
            return
        specs: List[Dict[str, Any]] = []
        for h in hyps[:top]:
            spec = remedy_for(h)
            if spec is not None and spec not in specs:
                specs.append(spec)
        folder = os.path.join(out, "confirm")
        jobs: List[Tuple[str, Optional[Dict[str, Any]]]] = [(os.path.join(folder, "unchanged"), None)]
        jobs += [(os.path.join(folder, f"remedy{i + 1}-{s['kind']}"), s) for i, s in enumerate(specs)]
        done = [0]
        lock = threading.Lock()

        def one(job: Tuple[str, Optional[Dict[str, Any]]]) -> Dict[str, Any]:
            result = self._run_child(self.child_argv(job[0], steps, job[1]), job[0])
            with lock:
                done[0] += 1
                print(
                    f"\rneuraldbg: --confirm: {done[0]}/{len(jobs)} runs of {steps} steps done",
                    end="",
                    file=sys.stderr,
                    flush=True,
                )
            return result

        print(
            f"neuraldbg: --confirm: {len(jobs)} runs of {steps} steps ({self.jobs} at once)",
            file=sys.stderr,
            flush=True,
        )
        with ThreadPoolExecutor(max_workers=self.jobs) as pool:
            runs = list(pool.map(one, jobs))
        print(file=sys.stderr)
        unchanged = runs[0]
        results = dict(zip((_key(s) for s in specs), runs[1:]))
        causes = blamed(hyps)
        for rank, h in enumerate(hyps):
            spec = remedy_for(h)
            if rank >= top:
                h.update(verdict="untested", intervention=None, evidence={"why": f"not among the top {top}"})
            elif spec is None:
                h.update(
                    verdict="untested", intervention=None, evidence={"why": f"no mechanical remedy for {h['cause']}"}
                )
            else:
                tried = results[_key(spec)]
                h.update(_verdict(h, spec, data, unchanged, tried, steps, causes.get(_key(spec), [])))
        parted: Dict[Tuple[str, Any], Optional[Dict[str, Any]]] = {}
        for h in hyps:
            spec = remedy_for(h)
            if h.get("verdict") in (None, "untested") or spec is None:
                continue
            key = (_key(spec), h.get("model"))
            if key not in parted:
                parted[key] = _parting(unchanged, results[key[0]], h.get("model"))
            if parted[key] is not None:
                h["evidence"]["parts_from_unchanged"] = parted[key]
        hyps.sort(key=lambda h: 0 if h.get("verdict") == "confirmed" else 1)
        for m in data["models"]:
            _write_confirmation(m, hyps, steps, [(j[1], r) for j, r in zip(jobs, runs)])
        data["confirm"] = {
            "steps": steps,
            "runs": [
                {
                    "folder": j[0],
                    "intervention": None if j[1] is None else _describe(j[1]),
                    "exit_code": r["process_exit"],
                }
                for j, r in zip(jobs, runs)
            ],
        }
        _print_verdicts(hyps[: max(top, 1)] if hyps else [])


def _parting(unchanged: Dict[str, Any], tried: Dict[str, Any], model: Optional[str]) -> Optional[Dict[str, Any]]:
    """Where the run with the remedy parts from the unchanged re-run, by ``neuraldbg diff``:
    the first step their losses differ (``loss_step``) and the first step and layer whose
    health differs (``health``); None when a trace is missing or the diff fails."""
    from ._run import _same_package_env

    def trace(run: Dict[str, Any]) -> Optional[str]:
        found = [m["trace"] for m in run.get("models", []) if model is None or m["name"] == model]
        return found[0] if found and os.path.exists(found[0]) else None

    a, b = trace(unchanged), trace(tried)
    if a is None or b is None:
        return None
    cmd = [sys.executable, "-m", "neuraldbg", "diff", "--json", a, b]
    done = subprocess.run(cmd, stdin=subprocess.DEVNULL, capture_output=True, text=True, env=_same_package_env())
    try:
        d = json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        d = None
    if d is None:
        return None
    return {"loss_step": d["loss_parting_step"], "health": d["parting"]}


def confirmation_path(trace: str) -> str:
    """The file of verdicts and curves ``--confirm`` writes next to a model's trace (the CLI's
    ``explain`` and ``report`` read it: ``Confirmation::path_for`` in the Rust report)."""
    return os.path.splitext(trace)[0] + ".confirm.json"


def _write_confirmation(
    model: Dict[str, Any],
    hyps: List[Dict[str, Any]],
    steps: int,
    runs: List[Tuple[Optional[Dict[str, Any]], Dict[str, Any]]],
) -> None:
    """The verdicts of ``model``'s hypotheses and the loss curves of the runs that bear on it
    (the first run, the unchanged re-run, each remedy applied to it), as docs/trace-format.md
    describes."""
    name = model["name"]
    curves = [{"name": "first run", "intervention": None, "steps": model["loss_steps"], "loss": model["loss"]}]
    for spec, run in runs:
        if spec is not None and spec.get("model") not in (None, name):
            continue
        seen = next((m for m in run.get("models", []) if m["name"] == name), None)
        if seen is None:
            continue
        label = "unchanged re-run" if spec is None else _describe(spec)
        curves.append(
            {
                "name": label,
                "intervention": None if spec is None else label,
                "steps": seen["loss_steps"],
                "loss": seen["loss"],
            }
        )
    keys = ("failure", "cause", "layer", "step", "verdict", "intervention", "evidence")
    page = {
        "format": "neuraldbg-confirm",
        "version": 1,
        "model": name,
        "steps": steps,
        "verdicts": [{k: h.get(k) for k in keys} for h in hyps if h.get("model") == name and "verdict" in h],
        "runs": curves,
    }
    with open(confirmation_path(model["trace"]), "w", encoding="utf-8") as f:
        json.dump(page, f, indent=1)


def _verdict(
    h: Dict[str, Any],
    spec: Dict[str, Any],
    first: Dict[str, Any],
    unchanged: Dict[str, Any],
    tried: Dict[str, Any],
    steps: int,
    also: Sequence[str] = (),
) -> Dict[str, Any]:
    """The verdict on ``h`` from the run with its remedy (``tried``); ``also``: the other
    failures the first run blamed on the same remedy's cause, which must not recur either."""
    model = h.get("model")
    base = _final_loss(unchanged, model, steps)
    again = _final_loss(first, model, steps)
    loss = _final_loss(tried, model, steps)
    spread = (
        abs(base - again)
        if base is not None and again is not None and math.isfinite(base) and math.isfinite(again)
        else 0.0
    )
    others = [f for f in also if f != h["failure"] and _recurs(tried, h, f)]
    evidence: Dict[str, Any] = {
        "failure_recurred": _recurs(tried, h),
        "also_recurred": others,
        "failure_in_unchanged": _recurs(unchanged, h),
        "loss": _json_number(loss),
        "loss_unchanged": _json_number(base),
        "loss_first_run": _json_number(again),
        "spread": spread,
        "applied": tried.get("applied", []),
        "exit_code": tried.get("process_exit"),
    }
    verdict, why = "inconclusive", ""
    skipped = [a for a in tried.get("applied", []) if a.startswith("not applicable")]
    if skipped or not tried.get("applied"):
        verdict, why = "untested", skipped[0] if skipped else "the remedy found nothing to change in this script"
    elif not tried.get("models"):
        why = f"the run with the remedy did not complete (exit {tried.get('process_exit')}; see {tried.get('log')})"
    elif _curve(tried, model, steps) and _curve(tried, model, steps) == _curve(unchanged, model, steps):
        # Applied, but the training did not change: a test that tested nothing refutes nothing.
        verdict, why = "untested", "the remedy left the loss curve exactly as in the unchanged re-run"
    elif not evidence["failure_in_unchanged"]:
        why = "the failure did not recur in the unchanged re-run"
    elif evidence["failure_recurred"]:
        verdict, why = "refuted", "the failure recurred with the remedy"
    elif others:
        verdict, why = (
            "refuted",
            f"{', '.join(others)}, also blamed on {h['cause']}, recurred with the remedy",
        )
    elif base is None or loss is None:
        why = "no loss was observed to compare"
    else:
        gain = (math.inf if math.isfinite(loss) else 0.0) if not math.isfinite(base) else base - loss
        need = max(spread, MIN_GAIN * abs(base)) if math.isfinite(base) else 0.0
        if gain > need:
            verdict, why = (
                "confirmed",
                "the failure did not recur and the loss beat the unchanged re-run by more than the spread",
            )
        else:
            why = "the failure did not recur, but the loss did no better than the unchanged re-run beyond the spread"
    evidence["why"] = why
    return {"verdict": verdict, "intervention": _describe(spec), "evidence": evidence}


def _json_number(v: Optional[float]) -> Optional[float]:
    return None if v is None or not math.isfinite(v) else v


def _loss_text(v: Any) -> str:
    return "non-finite" if v is None else f"{v:.4g}"


def _print_verdicts(hyps: List[Dict[str, Any]]) -> None:
    for h in hyps:
        if "verdict" not in h:
            continue
        line = f"  {h['verdict'].upper():<12} {h['failure']} <- {h['cause']}"
        if h.get("intervention"):
            ev = h["evidence"]
            line += f": {h['intervention']}; loss {_loss_text(ev['loss'])} vs {_loss_text(ev['loss_unchanged'])} unchanged (spread {ev['spread']:.3g})"
        print(line, file=sys.stderr)
        print(f"      {h['evidence']['why']}", file=sys.stderr)
    sys.stderr.flush()
