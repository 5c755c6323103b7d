"""The external suite: published buggy training programs, written and labelled by others,
ported faithfully to PyTorch, each with its fixed version as a healthy control.

`all_programs()` lists them; `bench/external_scoreboard.py` trains each buggy and fixed version
under `NeuralDbg` and scores the diagnosis (see docs/diagnosis.md, "External suite")."""

from __future__ import annotations

from typing import List

from .common import Program


def all_programs() -> List[Program]:
    from . import deepchecker, tf_program_bugs

    return deepchecker.programs() + tf_program_bugs.programs()
