"""The seed's data structures: health states, semantic events and causal hypotheses.

These are plain, immutable Python objects built from what the Rust engine returns; they hold
no logic beyond formatting.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Dict, List, Optional, Tuple, Union

__all__ = [
    "ActivationHealth",
    "CausalHypothesis",
    "Cause",
    "CoupledFailure",
    "DataHealth",
    "EventType",
    "Failure",
    "GradientHealth",
    "LossHealth",
    "ReplicaHealth",
    "RootCause",
    "SemanticEvent",
]


class _StrEnum(str, Enum):
    def __str__(self) -> str:
        return str(self.value)


class EventType(_StrEnum):
    """What an event is about; ``from_state``/``to_state`` say which transition."""

    GRADIENT_HEALTH = "gradient_health"
    """A layer's gradient health changed (states: :class:`GradientHealth`)."""
    ACTIVATION_HEALTH = "activation_health"
    """An activation module's output health changed (:class:`ActivationHealth`)."""
    NON_FINITE_OUTPUT = "non_finite_output"
    """The first module, in forward order, whose output was NaN/Inf on that step."""
    DATA_ANOMALY = "data_anomaly"
    """The input batches changed health (:class:`DataHealth`)."""
    LOSS_HEALTH = "loss_health"
    """The loss changed health (:class:`LossHealth`)."""
    REPLICA_DIVERGENCE = "replica_divergence"
    """The replicas of a data-parallel (DDP) job stopped matching (:class:`ReplicaHealth`)."""


class GradientHealth(_StrEnum):
    """Health of a layer's gradient norm (seed thresholds by default)."""

    HEALTHY = "HEALTHY"
    VANISHING = "VANISHING"
    SATURATED = "SATURATED"
    EXPLODING = "EXPLODING"
    NON_FINITE = "NON_FINITE"


class ActivationHealth(_StrEnum):
    """Health of an activation module's output."""

    NORMAL = "NORMAL"
    SATURATED = "SATURATED"
    DEAD = "DEAD"
    ANOMALOUS = "ANOMALOUS"
    NON_FINITE = "NON_FINITE"


class LossHealth(_StrEnum):
    NORMAL = "NORMAL"
    DIVERGING = "DIVERGING"
    PLATEAU = "PLATEAU"
    NON_FINITE = "NON_FINITE"


class DataHealth(_StrEnum):
    NORMAL = "NORMAL"
    OUT_OF_DISTRIBUTION = "OUT_OF_DISTRIBUTION"
    NON_FINITE = "NON_FINITE"


class ReplicaHealth(_StrEnum):
    """Whether the replicas of a data-parallel job still hold the same values."""

    CONSISTENT = "CONSISTENT"
    DIVERGED = "DIVERGED"


class Failure(_StrEnum):
    """What went wrong (design.md vocabulary)."""

    VANISHING_GRADIENTS = "vanishing_gradients"
    EXPLODING_GRADIENTS = "exploding_gradients"
    SATURATED_GRADIENTS = "saturated_gradients"
    SATURATED_ACTIVATIONS = "saturated_activations"
    DEAD_NEURONS = "dead_neurons"
    NON_FINITE = "non_finite"
    DATA_ANOMALY = "data_anomaly"
    LOSS_DIVERGENCE = "loss_divergence"
    LOSS_PLATEAU = "loss_plateau"
    LOSS_SCALE_COLLAPSE = "loss_scale_collapse"
    STALLED_LAYER = "stalled_layer"
    REPLICA_DIVERGENCE = "replica_divergence"


class Cause(_StrEnum):
    """Why it went wrong (design.md vocabulary)."""

    SATURATING_ACTIVATION = "saturating_activation"
    POOR_INITIALIZATION = "poor_initialization"
    LEARNING_RATE_TOO_HIGH = "learning_rate_too_high"
    LEARNING_RATE_TOO_LOW = "learning_rate_too_low"
    DYING_RELU = "dying_relu"
    BAD_INPUT_DATA = "bad_input_data"
    NUMERICAL_INSTABILITY = "numerical_instability"
    NETWORK_DEPTH = "network_depth"
    MISSING_NORMALIZATION = "missing_normalization"
    UNKNOWN = "unknown"
    MISSING_ZERO_GRAD = "missing_zero_grad"
    PARAMETERS_NOT_UPDATED = "parameters_not_updated"
    EVAL_MODE = "eval_mode"
    OUTPUT_LOSS_MISMATCH = "output_loss_mismatch"
    TARGET_SHAPE_MISMATCH = "target_shape_mismatch"
    OVER_REGULARIZATION = "over_regularization"
    OUTPUT_IGNORES_INPUT = "output_ignores_input"
    FLIPPED_UPDATE_SIGN = "flipped_update_sign"
    BATCH_AXIS_MISMATCH = "batch_axis_mismatch"
    SEQUENCE_START_READOUT = "sequence_start_readout"


def _float(v: Any) -> float:
    """JSON from the engine writes non-finite floats as strings; turn them back into floats."""
    if isinstance(v, str):
        return {"NaN": math.nan, "inf": math.inf, "-inf": -math.inf}.get(v, math.nan)
    return float(v)


def _metadata(raw: Dict[str, Any]) -> Dict[str, Union[float, str]]:
    """Event metadata as plain floats (the engine writes every value as a number, or as the
    string of a non-finite one)."""
    return {k: _float(v) if isinstance(v, (int, float, str)) else v for k, v in raw.items()}


def _layer(name: Optional[str]) -> str:
    if name is None:
        return "-"
    return "<model>" if name == "" else name


@dataclass(frozen=True, repr=False)
class SemanticEvent:
    """A confirmed health transition (the seed's causal compression: transitions only).

    ``confidence`` is ``1 - exp(-(margin/0.5 + persistence/3))``: how far past its threshold
    the value went (decades for norms, share of the remaining range for fractions) and for how
    many consecutive observations it held when confirmed. ``metadata`` holds ``value`` (observed
    at onset), ``threshold``, ``confirmed_step``, ``persistence`` and ``margin``, and in a
    distributed job ``rank`` when the signal is one rank's own (its batch, its forward pass,
    the odd replica out).
    """

    event_type: EventType
    layer_name: str
    step: int
    from_state: str
    to_state: str
    confidence: float
    metadata: Dict[str, Union[float, str]] = field(default_factory=dict)

    @classmethod
    def _from_json(cls, d: Dict[str, Any]) -> SemanticEvent:
        return cls(
            event_type=EventType(d["event_type"]),
            layer_name=d["layer_name"],
            step=int(d["step"]),
            from_state=d["from_state"],
            to_state=d["to_state"],
            confidence=_float(d["confidence"]),
            metadata=_metadata(d.get("metadata", {})),
        )

    def __str__(self) -> str:
        value = self.metadata.get("value")
        shown = f" value={value:.3g}" if isinstance(value, float) and math.isfinite(value) else ""
        return (
            f"step {self.step:>6}  {_layer(self.layer_name)}  {self.event_type}: "
            f"{self.from_state} -> {self.to_state}{shown} (confidence {self.confidence:.2f})"
        )

    def __repr__(self) -> str:
        # Short: a list of events printed in a REPL stays one line per event.
        return (
            f"SemanticEvent(step={self.step}, layer_name={self.layer_name!r}, "
            f"{self.event_type}: {self.from_state} -> {self.to_state}, confidence={self.confidence:.2f})"
        )


@dataclass(frozen=True, repr=False)
class CausalHypothesis:
    """One ranked explanation of a failure: what failed, where, from when, why, what to do."""

    description: str
    confidence: float
    evidence: List[SemanticEvent]
    causal_chain: List[str]
    failure: Failure
    cause: Cause
    layer: Optional[str]
    """Root-cause layer (qualified module name), or None when no single layer is to blame."""
    step: Optional[int]
    """Step the failure began, or None."""
    remedies: List[str]

    @classmethod
    def _from_json(cls, d: Dict[str, Any]) -> CausalHypothesis:
        return cls(
            description=d["description"],
            confidence=_float(d["confidence"]),
            evidence=[SemanticEvent._from_json(e) for e in d["evidence"]],
            causal_chain=list(d["causal_chain"]),
            failure=Failure(d["failure"]),
            cause=Cause(d["cause"]),
            layer=d["layer"],
            step=None if d["step"] is None else int(d["step"]),
            remedies=list(d["remedies"]),
        )

    def __str__(self) -> str:
        where = f"layer {_layer(self.layer)}, step {self.step if self.step is not None else '-'}"
        return f"[{self.confidence:.2f}] {self.failure} <- {self.cause} ({where}): {self.description}"

    def __repr__(self) -> str:
        # Short: the fields that identify it; `str(h)` is the sentence, `h.evidence` the events.
        return (
            f"CausalHypothesis(failure={str(self.failure)!r}, cause={str(self.cause)!r}, "
            f"layer={self.layer!r}, step={self.step!r}, confidence={self.confidence:.2f})"
        )


@dataclass(frozen=True)
class RootCause:
    """The root of a failure that no other failure explains."""

    failure: Failure
    layer: Optional[str]
    step: int
    event: Optional[SemanticEvent]
    affected: List[str]
    consequences: List[Failure]

    @classmethod
    def _from_json(cls, d: Dict[str, Any]) -> RootCause:
        return cls(
            failure=Failure(d["failure"]),
            layer=d["layer"],
            step=int(d["step"]),
            event=None if d["event"] is None else SemanticEvent._from_json(d["event"]),
            affected=list(d["affected"]),
            consequences=[Failure(c) for c in d["consequences"]],
        )

    def __str__(self) -> str:
        then = f" -> {', '.join(map(str, self.consequences))}" if self.consequences else ""
        return f"{self.failure} at step {self.step} in {_layer(self.layer)}{then}"


@dataclass(frozen=True)
class CoupledFailure:
    """Two failure events within the coupling window.

    ``coupling`` is ``"structural"`` when they are in adjacent monitored modules (layer N and
    N-1 in forward order), ``"temporal"`` otherwise; ``lag`` is the steps between them.
    """

    coupling: str
    first: SemanticEvent
    second: SemanticEvent
    lag: int

    @property
    def layers(self) -> Tuple[str, str]:
        return (self.first.layer_name, self.second.layer_name)

    @classmethod
    def _from_json(cls, d: Dict[str, Any]) -> CoupledFailure:
        return cls(
            coupling=d["kind"],
            first=SemanticEvent._from_json(d["first"]),
            second=SemanticEvent._from_json(d["second"]),
            lag=int(d["lag"]),
        )
