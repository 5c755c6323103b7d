"""``neuraldbg`` on the command line (``python -m neuraldbg`` or the installed script).

The command is the Rust CLI (crates/neuraldbg-cli), reached through the extension module, so
the script installed by ``pip install .`` and ``cargo install --path crates/neuraldbg-cli`` are
the same program.
"""

from __future__ import annotations

import signal
import sys
from typing import List, Optional


def main(argv: Optional[List[str]] = None) -> int:
    """Runs the CLI with ``argv`` (default: the process's arguments); returns the exit code."""
    from . import _native

    # Ctrl-C ends the command at once, as it does the native binary (Python would only see it
    # once the Rust code returns).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    args = sys.argv[1:] if argv is None else argv
    sys.stdout.flush()
    return int(_native.cli_main(["neuraldbg", *args]))


if __name__ == "__main__":
    sys.exit(main())
