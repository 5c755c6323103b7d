"""NeuralDBG: a causal debugger for deep-learning training.

Wrap an unchanged training loop in ``with NeuralDbg(model) as dbg:``; when training fails,
``dbg.explain_failure()`` says what failed, in which layer, from which step, why, and what to
change. Statistics are collected by PyTorch hooks and analysed by a Rust engine.
"""

from . import _native
from .debugger import NeuralDbg
from .errors import (
    ConfigError,
    EngineError,
    ModelError,
    NeuralDbgError,
    NeuralDbgWarning,
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
    RootCause,
    SemanticEvent,
)

__version__: str = _native.__version__

__all__ = [
    "NeuralDbg",
    "SemanticEvent",
    "CausalHypothesis",
    "RootCause",
    "CoupledFailure",
    "EventType",
    "GradientHealth",
    "ActivationHealth",
    "LossHealth",
    "DataHealth",
    "Failure",
    "Cause",
    "NeuralDbgError",
    "ConfigError",
    "ModelError",
    "EngineError",
    "UnknownNameError",
    "TrainingFailure",
    "NeuralDbgWarning",
    "__version__",
]
