"""The script ``neuraldbg.run(fn, confirm=True)``'s re-runs execute: ``python -m neuraldbg run
... -m neuraldbg._call MODULE:QUALNAME`` imports the function and calls it, so a fresh process
runs the same training as the function did in the notebook."""

from __future__ import annotations

import sys

if __name__ == "__main__":
    from neuraldbg._function import resolve

    resolve(sys.argv[1])()
