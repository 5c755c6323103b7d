"""NeuralDBG: a causal debugger for deep-learning training.

Wrap an unchanged training loop in ``with NeuralDbg(model) as dbg:``; when training fails,
``dbg.explain_failure()`` says what failed, in which layer, from which step, why, and what to
change. Statistics are collected by PyTorch hooks and analysed by a Rust engine.
"""

from . import _native
from ._function import RunResult, run
from ._load import TraceRun, load
from ._results import Hypotheses
from .debugger import NeuralDbg
from .errors import (
    ConfigError,
    EngineError,
    ModelError,
    NeuralDbgError,
    NeuralDbgWarning,
    TraceError,
    TrainingFailure,
    UnknownNameError,
)
from .types import (
    ActivationHealth,
    CausalHypothesis,
    Cause,
    CoupledFailure,
    DataHealth,
    EventType,
    Failure,
    GradientHealth,
    LossHealth,
    ReplicaHealth,
    RootCause,
    SemanticEvent,
)

__version__: str = _native.__version__

__all__ = [
    "ActivationHealth",
    "CausalHypothesis",
    "Cause",
    "ConfigError",
    "CoupledFailure",
    "DataHealth",
    "EngineError",
    "EventType",
    "Failure",
    "GradientHealth",
    "Hypotheses",
    "LossHealth",
    "ModelError",
    "NeuralDbg",
    "NeuralDbgError",
    "NeuralDbgWarning",
    "ReplicaHealth",
    "RootCause",
    "RunResult",
    "SemanticEvent",
    "TraceError",
    "TraceRun",
    "TrainingFailure",
    "UnknownNameError",
    "__version__",
    "load",
    "run",
]
