import os
import sys
from typing import List

import pytest

# The scenario suite lives in bench/ at the repository root.
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

# The files that take longest run first (measured: BENCHMARKS.md, "make test"), so that the
# parallel run of `make test` (a file per worker, in this order: --no-loadscope-reorder) does
# not end on one worker finishing one of them alone while the others wait.
LONGEST_FIRST = (
    "test_run_command.py",
    "test_keras.py",
    "test_scenarios.py",
    "test_keras_backends.py",
    "test_jax.py",
    "test_quiet_evidence.py",
    "test_first_hour.py",
)


def pytest_collection_modifyitems(items: List[pytest.Item]) -> None:
    def rank(item: pytest.Item) -> int:
        name = item.path.name
        return LONGEST_FIRST.index(name) if name in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)
