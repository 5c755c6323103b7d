"""Type stubs of the Rust extension module (crates/neuraldbg-py)."""

import os
from typing import Callable, Dict, List, Optional, Sequence, Tuple, Type, Union

import numpy as np
import numpy.typing as npt
from typing_extensions import final

from ._plain import PlainFacts, PlainHost

__all__ = [
    "GRAD_MISSING",
    "GRAD_NONFINITE",
    "GRAD_ZERO",
    "Engine",
    "LayerRecord",
    "OutputMaxima",
    "PlainStep",
    "SlotRecord",
    "TensorReader",
    "__version__",
    "cli_main",
    "default_config_json",
]
__version__: str

# Bits of ``TensorReader.grad_norms``'s answer: a norm is not finite, exactly zero, missing.
GRAD_NONFINITE: int
GRAD_ZERO: int
GRAD_MISSING: int

def default_config_json() -> str:
    """The engine's default configuration as a JSON object."""

def cli_main(argv: Sequence[str]) -> int:
    """Runs the ``neuraldbg`` command line (program name first); returns its exit code."""

@final
class Engine:
    """The NeuralDBG engine for one watched model."""

    def __new__(cls, config_json: str) -> "Engine": ...
    @staticmethod
    def load_trace(path: Union[str, os.PathLike[str]]) -> Tuple["Engine", str]:
        """Replays a trace into a new engine: ``(engine, facts_json)`` (TraceError if it cannot
        be read)."""
    def open_trace(
        self,
        path: Union[str, os.PathLike[str]],
        meta_json: str = "{}",
        sync_interval: Optional[float] = None,
    ) -> None:
        """Starts recording the engine's inputs to a trace file (ConfigError if it cannot be
        created). ``sync_interval``: seconds between syncs to disk (0: every step; inf: only
        on close; None: the default)."""
    def record_unobserved(self, first: int, last: Optional[int], reason: str) -> None:
        """Records in the open trace (if any) that steps ``first..=last`` (None: to the end)
        were not observed, and why."""
    def close_trace(self) -> Optional[Tuple[str, int, int, bool]]:
        """Closes the trace: ``(path, steps, bytes, has_header)``, or None if none was open."""
    def register_model(self, spec_json: str) -> str:
        """Registers the model (JSON ModelSpec); returns the activation probes as JSON."""
    def amend_param_lr(self, lrs: Optional[Sequence[Optional[float]]]) -> bool:
        """Another optimizer was seen stepping the model: merges its per-parameter lrs (None
        where it holds the parameter in no group; ``lrs`` None: its lrs cannot be read) into the
        registered model's and, when they changed it, records them in the open trace (if any).
        Returns whether the facts changed (EngineError if no model is registered or the length
        is wrong)."""
    def amend_first_batch(self, facts_json: str) -> bool:
        """The first training batch's facts (JSON: ``target_range``, ``target_var``,
        ``output_range``, ``input_feature_scales``), read after the model was registered: fills
        those the model lacks (target and output facts need its loss) and, when that changed
        it, records them in the open trace (if any). Returns whether the facts changed
        (ModelError for facts that are not what they say, EngineError if no model is
        registered)."""
    @property
    def registered(self) -> bool: ...
    @property
    def steps_observed(self) -> int: ...
    @property
    def last_step(self) -> Optional[int]: ...
    @property
    def event_count(self) -> int:
        """Number of events so far (cheap: for noticing new ones)."""
    @property
    def activation_pending(self) -> bool:
        """Whether an activation module shows an unconfirmed new state (measure densely)."""
    def observe(
        self,
        step: int,
        grad_norms: npt.NDArray[np.float32],
        weight_norms: Optional[npt.NDArray[np.float32]] = None,
        activations: Optional[npt.NDArray[np.float32]] = None,
        inputs: Optional[Union[npt.NDArray[np.float32], Sequence[float]]] = None,
        loss: Optional[float] = None,
        lr: Optional[float] = None,
        nonfinite_module: Optional[int] = None,
        outputs_checked: bool = False,
        facts: Optional[Dict[str, float]] = None,
        measures: Optional[Dict[str, npt.NDArray[np.float32]]] = None,
    ) -> bool:
        """Feeds one step; returns :attr:`activation_pending` after it."""
    def events_json(self) -> str: ...
    def explain_json(self, failure: Optional[str] = None) -> str: ...
    def evidence_json(self) -> str: ...
    def root_causes_json(self) -> str: ...
    def couplings_json(self, window: int) -> str: ...
    def causal_chain_json(self, failure: str) -> str: ...
    def mermaid(self) -> str: ...
    def report_html(self, title: str, sections: str = "all", failure: Optional[str] = None) -> str:
        """The self-contained HTML report of the run (``sections``: all, verdict_heatmap or
        verdict)."""
    def history(
        self, name: Optional[str], metric: str, reduce: str = "last"
    ) -> Tuple[npt.NDArray[np.uint64], npt.NDArray[np.float64]]: ...
    def history_table(
        self,
    ) -> Tuple[
        List[Tuple[str, Optional[str], str]],
        npt.NDArray[np.uint32],
        npt.NDArray[np.uint64],
        npt.NDArray[np.uint64],
        npt.NDArray[np.float64],
        npt.NDArray[np.float64],
        npt.NDArray[np.float64],
    ]:
        """Every history series as one long table: the series keys ``(group, module, metric)``
        and the columns series index, first step, step, value, min, max."""
    def heap_bytes(self) -> int: ...

@final
class TensorReader:
    """Statistics of CPU tensors read straight from their memory (no torch op).

    A tensor is readable when ``type(t)`` is exactly one of ``tensor_types``, its dtype one of
    the four given (by identity), ``t.is_cpu`` and ``t.is_contiguous()`` are True and it is
    empty or has a non-null ``data_ptr()``. For anything else the methods answer False/None
    (never raise) and the caller uses its torch path. Output arrays: C-contiguous writable
    float32 (ValueError otherwise). ``tensor_types`` must be torch's own tensor types
    (``torch.Tensor``, ``torch.nn.Parameter``): the reader trusts their ``data_ptr()``, and
    nothing may write the tensors from another thread during a call. With ``to_dlpack``
    (``torch._C._to_dlpack``) the dtype, device, layout and address come from the DLPack
    capsule it returns (one call instead of five); the tensor is then readable when it is a
    CPU float16/32/64 or bfloat16 tensor, compact row-major. With ``exchange`` (torch's
    ``Tensor.__dlpack_c_exchange_api__``, DLPack 1.3's exchange API capsule) a tensor of
    exactly ``tensor_types[0]`` is viewed through its ``dltensor_from_py_object_no_sync``
    instead: no capsule, no allocation (``to_dlpack`` when that view fails)."""

    def __new__(
        cls,
        tensor_types: Tuple[Type[object], ...],
        float32: object,
        float64: object,
        float16: object,
        bfloat16: object,
        to_dlpack: Optional[Callable[[object], object]] = None,
        exchange: Optional[object] = None,
    ) -> "TensorReader": ...
    @property
    def views(self) -> bool:
        """Whether ``tensor_types[0]`` tensors are read through the exchange API's view."""
    def norms(
        self,
        items: Sequence[object],
        out: npt.NDArray[np.float32],
        attr: Optional[str] = None,
        missing: float = -1.0,
    ) -> bool:
        """``out[i]`` = the L2 norm of ``items[i]`` (or of ``getattr(items[i], attr)``),
        ``missing`` where that is None. False as soon as a tensor is unreadable (``out`` then
        unspecified)."""
    def grad_norms(
        self,
        params: Sequence[object],
        out: npt.NDArray[np.float32],
        missing: float = -1.0,
        rows: Optional[npt.NDArray[np.float32]] = None,
        cols: Optional[npt.NDArray[np.float32]] = None,
    ) -> int:
        """``out[i]`` = the L2 norm of ``params[i].grad``, ``missing`` where that is None;
        returns what they hold: bit 1 some norm is not finite, bit 2 some is exactly zero, bit
        4 some gradient is missing (0: all present, finite, non-zero); -1 as soon as a gradient
        is unreadable (the arrays then unspecified). With ``rows`` and ``cols``, also the
        gradients' zero shares as :meth:`zero_shares` gives them, in the same pass."""
    def norm(self, item: object, attr: Optional[str] = None) -> Optional[float]:
        """The L2 norm of ``item`` (or of ``getattr(item, attr)``; -1 where that is None),
        None when it is not a readable tensor."""
    def stats(self, t: object) -> Optional[Tuple[float, float, float, float]]:
        """``(min, max, mean, std)`` (population std) of a readable non-empty tensor, else
        None."""
    def scalar(self, t: object) -> Optional[float]:
        """The value of a readable one-element tensor, else None."""
    def absmax(self, items: Sequence[object], out: npt.NDArray[np.float32], empty: float = 0.0) -> bool:
        """``out[i]`` = max |x| over ``items[i]`` (``empty`` when it has no element); False if
        an item is not a readable tensor."""
    def zero_shares(
        self,
        items: Sequence[object],
        rows: npt.NDArray[np.float32],
        cols: npt.NDArray[np.float32],
        attr: Optional[str] = None,
    ) -> bool:
        """Shares of the exactly-zero rows ``t[r]`` and columns ``t[:, c]`` of each tensor of 2
        or more dimensions (NaN for None, fewer dimensions or no element); False if a tensor
        is unreadable."""
    def activations(
        self,
        outs: Sequence[object],
        probes: Sequence[Tuple[int, int, float, Optional[float], bool, int]],
        table: npt.NDArray[np.float32],
    ) -> bool:
        """For each probe ``(row, unit_axis, center, half, death, slope)`` (slope: 0 none, 1
        tanh, 2 sigmoid, 3 softsign) the statistics of ``outs[row]`` into ``table[5*row:5*row+5]``
        (absmax, saturation share, dead share, slope, samples per unit; entries the probe does
        not ask are left alone, None and empty outputs skipped). False if an output is
        unreadable."""

@final
class OutputMaxima:
    """The largest magnitude of each recorded layer's output on a sampled step, read as the
    layer returns: ``maxima(index, output)``; an output ``reader`` cannot read is appended to
    ``kept`` as ``(index, output, None)``."""

    def __new__(cls, reader: TensorReader, kept: List[Tuple[int, object, None]]) -> "OutputMaxima": ...
    def __call__(self, index: int, output: object) -> None: ...
    def __len__(self) -> int:
        """The values read since the last table."""
    def clear(self) -> None:
        """Forgets the values read."""
    def table(
        self,
        rank: npt.NDArray[np.int64],
        modules: int,
        values: Optional[npt.NDArray[np.float32]] = None,
        ranks: Optional[npt.NDArray[np.int64]] = None,
    ) -> Optional[npt.NDArray[np.float32]]:
        """The engine's per-module table (``modules`` entries): at ``rank[index]`` (none where
        negative) the largest value read, and each ``values[k]`` at ``ranks[k]``; NaN where
        none (a NaN gives way to a number). None when no value has an entry. The values read
        are forgotten."""

@final
class PlainStep:
    """The common host-mode step observed by the extension (``HostReader.make_plain``): the
    collector's hooks hand it the model's forward, the loss's backward and the optimizer step;
    anything else is handed to its :class:`PlainHost`. Errors go to ``PlainHost.fail``;
    nothing raises but a ``KeyboardInterrupt`` met in the Python code a step calls (Ctrl-C),
    which reaches the loop as raised."""

    def __new__(
        cls,
        host: PlainHost,
        reader: TensorReader,
        engine: Engine,
        params: List[object],
        grads: npt.NDArray[np.float32],
        facts: PlainFacts,
        sentinels: List[int],
        clip: Optional[int],
        tensor: type,
        grad_enabled: Callable[[], bool],
        any_autocast: Callable[[], bool],
    ) -> "PlainStep": ...
    @property
    def taken(self) -> int:
        """Steps observed here so far."""
    def arm(self, on: bool) -> None:
        """Whether the coming step may be taken here; a step under way is handed over first."""
    def forward(self, module: object, args: object, kwargs: object) -> bool:
        """The model's forward pre-hook: True when taken here."""
    def backward(self, tensors: object) -> bool:
        """A backward starts: True when it is the plain step's loss, taken here."""
    def after_backward(self) -> None:
        """The backward taken here has returned."""
    def step(self, optimizer: object) -> bool:
        """The optimizer stepped: True when the step was observed here."""

@final
class LayerRecord:
    """A recorded layer's call, as the layer-class wrapper hands it over (``_hooks.make_record``):
    ``record(output, args)`` appends ``(index, output, args)`` to ``refs`` (cleared first when
    ``index == first[0]``), keeping what ``hold[0]`` says (True: output and inputs; False: the
    inputs; else no tensor, and a callable ``hold[0]`` is handed ``(index, output)``)."""

    def __new__(cls, index: int, refs: List[object], first: List[int], hold: List[object]) -> "LayerRecord": ...
    def __call__(self, output: object, args: object) -> None: ...

@final
class SlotRecord:
    """An activation probe's record: ``record(output, args)`` sets ``slots[row] = output``."""

    def __new__(cls, row: int, slots: List[object]) -> "SlotRecord": ...
    def __call__(self, output: object, args: object) -> None: ...
