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
    args = sys.argv[1:] if argv is None else argv
    if args and args[0] == "run":
        # `run` runs Python code (the user's script), so it is handled here, not by the Rust CLI.
        from . import _run

        return _run.main(args[1:])
    from . import _native

    # Ctrl-C ends the command at once, as it does the native binary (Python would only see it
    # once the Rust code returns).
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    sys.stdout.flush()
    return int(_native.cli_main(["neuraldbg", *args]))


if __name__ == "__main__":
    sys.exit(main())
