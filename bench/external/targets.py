"""The external suite's programs as importable functions of no arguments, for
``neuraldbg.run("bench.external.targets:<name>", confirm=True)`` (bench/external_confirm.py):
``--confirm`` re-runs a function in fresh processes that import it by name.

``buggy_<id>`` and ``fixed_<id>`` (``<id>`` is the program's name with every character that is
not a letter, a digit or ``_`` replaced by ``_``, see :func:`function_name`) each train the
program as bench/external_scoreboard.py does: one thread, ``torch.manual_seed(0)`` just before
the program is built, the suite's own loop. They return the loop's ``TrainResult``."""

from __future__ import annotations

import re
import warnings
from typing import Callable, Dict, List

from .common import Program, TrainResult, train


def function_name(p: Program, buggy: bool) -> str:
    """The name under which this module exposes ``p``'s buggy or fixed version."""
    return ("buggy_" if buggy else "fixed_") + re.sub(r"[^0-9A-Za-z_]", "_", p.name)


def _trainer(p: Program, buggy: bool, name: str) -> Callable[[], TrainResult]:
    def fn() -> TrainResult:
        import torch

        torch.set_num_threads(1)
        warnings.simplefilter("ignore")
        torch.manual_seed(0)
        return train(p.build(buggy, None))

    fn.__name__ = fn.__qualname__ = name
    fn.__module__ = __name__
    return fn


_functions: Dict[str, Callable[[], TrainResult]] = {}


def _all() -> Dict[str, Callable[[], TrainResult]]:
    if not _functions:
        from . import all_programs

        for p in all_programs():
            for buggy in (True, False):
                name = function_name(p, buggy)
                if name in _functions:
                    raise RuntimeError(f"two programs of the external suite are both named {name}")
                _functions[name] = _trainer(p, buggy, name)
    return _functions


def __getattr__(name: str) -> Callable[[], TrainResult]:
    found = _all().get(name)
    if found is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return found


def __dir__() -> List[str]:
    return sorted(list(globals()) + list(_all()))
