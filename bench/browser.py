"""Headless Chromium (Debian's ``chromium`` package) for checking and picturing HTML reports.

The machines this runs on have no network, so Chromium is started with everything that would
reach out switched off, and with a fresh profile each time.
"""

from __future__ import annotations

import html
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Dict, List, Optional, Union

PathLike = Union[str, "os.PathLike[str]"]

FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",  # containers often have a tiny /dev/shm
    "--hide-scrollbars",
    "--force-device-scale-factor=1",
]

# Appended to a copy of the page (never to the report itself): records where things landed.
_PROBE = """<script>
(function () {
  function rect(e) { const r = e.getBoundingClientRect();
    return {left: r.left + scrollX, top: r.top + scrollY, width: r.width, height: r.height}; }
  const c = document.getElementById('heatmap');
  document.body.setAttribute('data-probe', JSON.stringify({
    ms_to_drawn: performance.now(),
    page_height: document.documentElement.scrollHeight,
    heatmap: c ? rect(c) : null,
    heatmap_plot: c && c.dataset.plot ? c.dataset.plot.split(',').map(Number) : null,
    thresholds: [...document.querySelectorAll('#legend text.threshold')].map(rect),
    root_label: c && c.dataset.rootLabel ? Number(c.dataset.rootLabel) : null,
  }));
})();
</script>"""


def find_chromium() -> Optional[str]:
    """The Chromium binary: ``$NEURALDBG_CHROMIUM``, else the first on PATH."""
    explicit = os.environ.get("NEURALDBG_CHROMIUM")
    if explicit:
        return explicit
    for name in ("chromium", "chromium-browser", "google-chrome", "chrome"):
        found = shutil.which(name)
        if found:
            return found
    return None


def _run(chromium: str, args: List[str], timeout: float = 120.0) -> str:
    with tempfile.TemporaryDirectory(prefix="ndbg-chromium-") as profile:
        proc = subprocess.run(
            [chromium, *FLAGS, f"--user-data-dir={profile}", *args],
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    if proc.returncode != 0:
        raise RuntimeError(f"chromium exited with {proc.returncode}:\n{proc.stderr[-3000:]}")
    return proc.stdout


def dump_dom(chromium: str, page: PathLike, width: int = 1280, height: int = 2000) -> str:
    """The page's DOM after its scripts ran."""
    url = Path(page).resolve().as_uri()
    return _run(chromium, [f"--window-size={width},{height}", "--dump-dom", url])


def layout(chromium: str, page: PathLike, width: int = 1280, height: int = 2000) -> Dict[str, Any]:
    """Where the heatmap landed and how tall the page is, measured on a probed copy of the page
    at the same window size."""
    page = Path(page)
    probed = page.with_name(page.stem + ".probe.html")
    probed.write_text(page.read_text(encoding="utf-8").replace("</body>", _PROBE + "</body>"), encoding="utf-8")
    try:
        dom = dump_dom(chromium, probed, width, height)
    finally:
        probed.unlink()
    start = dom.index('data-probe="') + len('data-probe="')
    return json.loads(html.unescape(dom[start : dom.index('"', start)]))


def screenshot(chromium: str, page: PathLike, png: PathLike, width: int = 1280, height: int = 2000) -> None:
    """A PNG of the page's first ``height`` pixels at ``width``."""
    url = Path(page).resolve().as_uri()
    _run(
        chromium,
        [
            f"--window-size={width},{height}",
            "--run-all-compositor-stages-before-draw",
            f"--screenshot={Path(png).resolve()}",
            url,
        ],
    )
