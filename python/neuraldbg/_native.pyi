"""Type stubs of the Rust extension module (crates/neuraldbg-py)."""

from typing import Optional, Tuple

import numpy as np
import numpy.typing as npt

__version__: str

def default_config_json() -> str:
    """The engine's default configuration as a JSON object."""

class Engine:
    """The NeuralDBG engine for one watched model."""

    def __init__(self, config_json: str) -> None: ...
    def register_model(self, spec_json: str) -> str:
        """Registers the model (JSON ModelSpec); returns the activation probes as JSON."""
    @property
    def registered(self) -> bool: ...
    @property
    def steps_observed(self) -> int: ...
    @property
    def last_step(self) -> Optional[int]: ...
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
    ) -> None: ...
    def events_json(self) -> str: ...
    def explain_json(self, failure: Optional[str] = None) -> str: ...
    def root_causes_json(self) -> str: ...
    def couplings_json(self, window: int) -> str: ...
    def causal_chain_json(self, failure: str) -> str: ...
    def mermaid(self) -> str: ...
    def history(
        self, name: Optional[str], metric: str, reduce: str = "last"
    ) -> Tuple[npt.NDArray[np.uint64], npt.NDArray[np.float64]]: ...
    def heap_bytes(self) -> int: ...
