"""Notebooks: a real notebook executed headless (nbclient, an IPython kernel), its rich outputs
checked, then drawn by Chromium as a notebook page would show them."""

from __future__ import annotations

import html
import re
import textwrap
from typing import Any, Dict, List

import pytest
from bench import browser

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

CELLS = [
    """
    import torch, torch.nn as nn
    import neuraldbg
    from neuraldbg import NeuralDbg
    from IPython.display import display

    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 16), nn.ReLU(), nn.Linear(16, 2))
    opt = torch.optim.SGD(model.parameters(), lr=50.0)   # far too high: the run blows up
    crit = nn.MSELoss()
    with NeuralDbg(model, trace=TRACE, criterion=crit) as dbg:
        for step in range(25):
            opt.zero_grad()
            crit(model(torch.randn(16, 8) * 3), torch.randn(16, 2) * 10).backward()
            opt.step()
            if step == 4:
                display(dbg)          # during the block: a snapshot so far
    """,
    "dbg",
    "dbg.explain_failure()",
    "run = neuraldbg.load(TRACE)\nrun",
    "print(dbg.explain_failure()[0])",
]


def outputs(cell: Any) -> List[Dict[str, Any]]:
    return [o for o in cell["outputs"] if o["output_type"] in ("display_data", "execute_result")]


def srcdoc(markup: str) -> str:
    m = re.search(r"srcdoc='([^']*)'", markup)
    assert m, markup[:300]
    return html.unescape(m.group(1))


def self_contained(page: str) -> None:
    assert set(re.findall(r"https?://[^\s'\"]+", page)) <= {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<(script|img|iframe|link)\b[^>]*\b(src|href)=", page)
    assert "@import" not in page


@pytest.fixture(scope="module")
def notebook(tmp_path_factory: pytest.TempPathFactory) -> Any:
    tmp = tmp_path_factory.mktemp("nb")
    trace = tmp / "run.ndbg"
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"TRACE = {str(trace)!r}")] + [
        nbformat.v4.new_code_cell(textwrap.dedent(c).strip()) for c in CELLS
    ]
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3", resources={"metadata": {"path": str(tmp)}})
    client.execute()
    nbformat.write(nb, str(tmp / "run.ipynb"))
    return nb, tmp


def test_notebook_outputs_are_rich_html_and_readable_text(notebook) -> None:
    nb, _ = notebook
    during, after, hyps, loaded = (outputs(nb.cells[i]) for i in (1, 2, 3, 4))
    # During the block (display(dbg)) and after it, the debugger shows the verdict and heatmap.
    assert len(during) == 1 and len(after) == 1
    for out, state in ((during[0], "active"), (after[0], "finished")):
        data = out["data"]
        assert data["text/plain"].startswith("NeuralDbg(Sequential, step=") and state in data["text/plain"]
        page = srcdoc(data["text/html"])
        assert 'class="inline"' in page and '<canvas id="heatmap"' in page
        self_contained(page)
    observed = [
        int(re.search(r"\((\d+) observed\)", srcdoc(o["data"]["text/html"])).group(1))  # type: ignore[union-attr]
        for o in (during[0], after[0])
    ]
    assert observed[0] < 10 and observed[1] == 25, observed
    assert "exploding_gradients" in srcdoc(after[0]["data"]["text/html"])
    # A hypothesis list shows the verdict only; its text form is one line per hypothesis.
    page = srcdoc(hyps[0]["data"]["text/html"])
    assert 'class="inline verdict-only"' in page and "What to do" in page
    assert re.match(r"\[0\.\d\d\] \w+ <- \w+ \(layer ", hyps[0]["data"]["text/plain"]), hyps[0]["data"]["text/plain"]
    # A trace opened from Python.
    assert loaded[0]["data"]["text/plain"].startswith("TraceRun(") and "closed" in loaded[0]["data"]["text/plain"]
    assert srcdoc(loaded[0]["data"]["text/html"]).count("exploding_gradients") >= 1
    # Plain text in a terminal-like output stays one readable line.
    printed = nb.cells[5]["outputs"][0]["text"]
    assert re.match(r"\[0\.\d\d\] exploding_gradients <- \w+ \(layer \w+, step \d+\): ", printed), printed
    assert printed.count("\n") == 1 and not re.search(r"<[a-z/]", printed)


def test_chromium_draws_the_notebook_outputs(notebook) -> None:
    chromium = browser.find_chromium()
    if chromium is None:
        pytest.skip("no Chromium on PATH (make browser installs Debian's chromium)")
    from PIL import Image

    nb, tmp = notebook
    after = outputs(nb.cells[2])[0]["data"]["text/html"]
    # The embedded page itself: its script ran, one heatmap row per layer, the verdict is there.
    inner = tmp / "inner.html"
    inner.write_text(srcdoc(after), encoding="utf-8")
    dom = browser.dump_dom(chromium, inner)
    assert 'data-rendered="ok"' in dom
    assert 'data-rows="3"' in dom, "three layers with parameters"
    assert "exploding_gradients" in dom
    # The outputs as a notebook page shows them (each in its iframe), as Chromium draws them.
    cells = "".join(
        f"<div class='cell'>{o['data']['text/html']}</div>" for i in (2, 3, 4) for o in outputs(nb.cells[i])
    )
    page = tmp / "notebook.html"
    page.write_text(f"<!DOCTYPE html><html><body style='width:960px'>{cells}</body></html>", encoding="utf-8")
    self_contained(srcdoc(after))
    shot = tmp / "notebook.png"
    browser.screenshot(chromium, page, shot, 1000, 1400)
    img = Image.open(shot).convert("RGB")
    import numpy as np

    rgb = np.asarray(img, dtype=np.int32)
    # The heatmap's colours (saturated reds/oranges of exploding layers, not greys or white).
    vivid = int(((rgb.max(axis=2) - rgb.min(axis=2)) > 80).sum())
    assert vivid > 2000, f"only {vivid} coloured pixels: the embedded report was not drawn"
