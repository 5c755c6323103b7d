"""Type stubs of the Rust extension module (crates/neuraldbg-py)."""

import os
from typing import Dict, Optional, Sequence, Tuple, Union

import numpy as np
import numpy.typing as npt
from typing_extensions import final

__all__ = ["Engine", "__version__", "cli_main", "default_config_json"]
__version__: str

def default_config_json() -> str:
    """The engine's default configuration as a JSON object."""

def cli_main(argv: Sequence[str]) -> int:
    """Runs the ``neuraldbg`` command line (program name first); returns its exit code."""

@final
class Engine:
    """The NeuralDBG engine for one watched model."""

    def __new__(cls, config_json: str) -> "Engine": ...
    def open_trace(
        self,
        path: Union[str, os.PathLike[str]],
        meta_json: str = "{}",
        sync_interval: Optional[float] = None,
    ) -> None:
        """Starts recording the engine's inputs to a trace file (ConfigError if it cannot be
        created). ``sync_interval``: seconds between syncs to disk (0: every step; inf: only
        on close; None: the default)."""
    def close_trace(self) -> Optional[Tuple[str, int, int, bool]]:
        """Closes the trace: ``(path, steps, bytes, has_header)``, or None if none was open."""
    def register_model(self, spec_json: str) -> str:
        """Registers the model (JSON ModelSpec); returns the activation probes as JSON."""
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
        inputs: Optional[npt.NDArray[np.float32]] = None,
        loss: Optional[float] = None,
        lr: Optional[float] = None,
        nonfinite_module: Optional[int] = None,
        outputs_checked: bool = False,
        facts: Optional[Dict[str, float]] = None,
        measures: Optional[Dict[str, npt.NDArray[np.float32]]] = None,
    ) -> None: ...
    def events_json(self) -> str: ...
    def explain_json(self, failure: Optional[str] = None) -> str: ...
    def root_causes_json(self) -> str: ...
    def couplings_json(self, window: int) -> str: ...
    def causal_chain_json(self, failure: str) -> str: ...
    def mermaid(self) -> str: ...
    def report_html(self, title: str) -> str:
        """The self-contained HTML report of the run."""
    def history(
        self, name: Optional[str], metric: str, reduce: str = "last"
    ) -> Tuple[npt.NDArray[np.uint64], npt.NDArray[np.float64]]: ...
    def heap_bytes(self) -> int: ...
