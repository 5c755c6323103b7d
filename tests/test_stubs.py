"""The hand-written stubs of the native module match the module (mypy's stubtest), and the
package type-checks against them."""

from __future__ import annotations

import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..")


def test_native_stub_matches_the_extension(tmp_path):
    # The stub imports numpy only, but checking it builds its package, whose other modules
    # import torch: analysing all of torch took most of a minute of CI and checks nothing here
    # (test_package_type_checks below reads the package against torch's types).
    config = tmp_path / "mypy.ini"
    config.write_text("[mypy]\n[mypy-torch,torch.*]\nfollow_imports = skip\nfollow_imports_for_stubs = True\n")
    out = subprocess.run(
        [sys.executable, "-m", "mypy.stubtest", "neuraldbg._native", "--mypy-config-file", str(config)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr


def test_package_type_checks():
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "mypy",
            "--ignore-missing-imports",
            "--no-error-summary",
            os.path.join(ROOT, "python", "neuraldbg"),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert out.returncode == 0, out.stdout + out.stderr
