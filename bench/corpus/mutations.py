"""Mutation operators: each plants one known cause in a base program by turning its knobs.

An operator's ``cause`` is the engine's name for what it plants; ``also`` lists causes that name
the same mistake (a very deep stack of sigmoids is both network depth and saturation). Pairs
combine two operators of different causes whose knobs do not overlap.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import dataclass, replace
from typing import Any, Dict, List, Sequence, Tuple

from .bases import Base, Knobs


@dataclass(frozen=True)
class Mutation:
    name: str
    cause: str
    changes: Tuple[Tuple[str, Any], ...]
    also: Tuple[str, ...] = ()
    # Drawn into pairs (operators added after the corpus's pairs were first drawn are not, so
    # that the pairs, and every figure measured on them, stay what they were).
    paired: bool = True

    def knobs(self) -> Dict[str, Any]:
        return dict(self.changes)

    def applies_to(self, b: Base) -> bool:
        return all(k in b.supports for k in self.knobs())

    def apply(self, k: Knobs) -> Knobs:
        return replace(k, **self.knobs())


def named(ops: Sequence[str]) -> List[Mutation]:
    """The operators of these names, in order."""
    return [next(m for m in MUTATIONS if m.name == o) for o in ops]


def knobs_for(ops: Sequence[str]) -> Knobs:
    """A base program's knobs with the named operators applied, in order."""
    k = Knobs()
    for m in named(ops):
        k = m.apply(k)
    return k


def _m(name: str, cause: str, also: Tuple[str, ...] = (), paired: bool = True, **changes: Any) -> Mutation:
    return Mutation(name, cause, tuple(sorted(changes.items())), also, paired)


MUTATIONS: List[Mutation] = [
    _m("lr_x10", "learning_rate_too_high", lr_factor=10.0),
    _m("lr_x100", "learning_rate_too_high", lr_factor=100.0),
    _m("lr_x1000", "learning_rate_too_high", lr_factor=1000.0),
    _m("lr_div10", "learning_rate_too_low", lr_factor=0.1),
    _m("lr_div100", "learning_rate_too_low", lr_factor=0.01),
    _m("lr_div1000", "learning_rate_too_low", lr_factor=0.001),
    _m("act_sigmoid", "saturating_activation", act="sigmoid"),
    _m("act_tanh", "saturating_activation", act="tanh"),
    _m("deep_sigmoid", "network_depth", ("saturating_activation",), act="sigmoid", extra_depth=8),
    _m("init_x0.01", "poor_initialization", init_scale=0.01),
    _m("init_x10", "poor_initialization", init_scale=10.0),
    _m("raw_inputs", "bad_input_data", raw_inputs=True),
    _m("raw_targets", "bad_input_data", raw_targets=True),
    _m("label_noise", "bad_input_data", label_noise=0.6),
    _m("out_softmax", "output_loss_mismatch", output_act="softmax"),
    _m("out_relu", "output_loss_mismatch", output_act="relu"),
    _m("out_sigmoid", "output_loss_mismatch", output_act="sigmoid"),
    _m("no_zero_grad", "missing_zero_grad", zero_grad=False),
    _m("zero_grad_late", "parameters_not_updated", paired=False, zero_grad_late=True),
    _m("frozen_first", "parameters_not_updated", frozen_first=True),
    _m("eval_mode", "eval_mode", eval_mode=True),
    _m("dead_bias", "dying_relu", dead_bias=True),
    _m("weight_decay", "over_regularization", paired=False, weight_decay=1.0),
    _m("l2_penalty", "over_regularization", paired=False, weight_penalty=0.1),
    _m("uneven_features", "bad_input_data", paired=False, uneven_features=True),
    _m("clip_tight", "learning_rate_too_low", paired=False, clip_norm=1e-4),
    _m("warmup_endless", "learning_rate_too_low", paired=False, warmup_steps=1_000_000),
    _m("loss_cut", "parameters_not_updated", paired=False, loss_cut=True),
    _m("dropout_keep", "over_regularization", paired=False, dropout=0.9),
    _m("labels_apart", "bad_input_data", paired=False, labels_apart=True),
    _m("input_lost", "output_ignores_input", paired=False, input_lost=True),
    _m("grads_negated", "flipped_update_sign", paired=False, negate_grads=True),
    _m("readout_first", "sequence_start_readout", paired=False, readout_first=True),
]


def singles(bases: List[Base]) -> List[Tuple[Base, Tuple[Mutation, ...]]]:
    return [(b, (m,)) for b in bases for m in MUTATIONS if m.applies_to(b)]


def pairs(bases: List[Base], n: int, seed: int) -> List[Tuple[Base, Tuple[Mutation, ...]]]:
    """`n` pairs drawn (seeded) from every compatible pair of operators on every base."""
    out: List[Tuple[Base, Tuple[Mutation, ...]]] = []
    for b in bases:
        ok = [m for m in MUTATIONS if m.paired and m.applies_to(b)]
        for a, c in itertools.combinations(ok, 2):
            if a.cause != c.cause and not set(a.knobs()) & set(c.knobs()):
                out.append((b, (a, c)))
    random.Random(seed).shuffle(out)
    return out[:n]
