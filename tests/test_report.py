"""The HTML report (``dbg.save_report``) of a real run with a planted failure, opened in a real
browser: headless Chromium loads the file offline, its script draws the charts, the verdict is in
the DOM and the heatmap is drawn with the colours the run calls for.

``make test`` installs Chromium (``make browser``) and sets ``NEURALDBG_CHROMIUM``, which makes the
browser checks mandatory; without it they are skipped when no Chromium is on PATH."""

from __future__ import annotations

import html
import re
from pathlib import Path
from typing import Tuple

import numpy as np
import pytest
import torch
import torch.nn as nn
from bench import browser, suite
from bench import scenarios as S

from neuraldbg import NeuralDbg


@pytest.fixture(scope="module")
def sigmoid_report(tmp_path_factory: pytest.TempPathFactory) -> Tuple[S.Outcome, Path]:
    # 12 sigmoid layers: gradients vanish in the first layers from step 0, the last stay healthy.
    torch.set_num_threads(1)
    scenario = next(s for s in suite.all_scenarios() if s.name == "deep_sigmoid_mlp")
    outcome = S.evaluate(scenario)
    path = tmp_path_factory.mktemp("report") / "report.html"
    outcome.dbg.save_report(path)
    return outcome, path


@pytest.fixture(scope="module")
def chromium() -> str:
    found = browser.find_chromium()
    if found is None:
        pytest.skip("no Chromium on PATH (make browser installs Debian's chromium)")
    return found


def test_report_is_one_self_contained_file(sigmoid_report):
    _outcome, path = sigmoid_report
    text = path.read_text(encoding="utf-8")
    assert text.startswith("<!DOCTYPE html>")
    # The only URL is the SVG namespace name, which is never fetched.
    assert set(re.findall(r"https?://[^\s'\"]+", text)) == {"http://www.w3.org/2000/svg"}
    assert not re.search(r"<(script|img|iframe|link)\b[^>]*\b(src|href)=", text)
    assert "@import" not in text and not re.search(r"url\((?!#)", text)
    assert "<title>NeuralDBG report: Sequential</title>" in text
    assert len(text) < 500_000


def test_save_report_takes_str_paths_and_titles_during_training(tmp_path):
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with NeuralDbg(model) as dbg:
        for _ in range(5):
            opt.zero_grad()
            nn.functional.cross_entropy(model(torch.randn(16, 8)), torch.randint(0, 2, (16,))).backward()
            opt.step()
        dbg.save_report(str(tmp_path / "mid.html"), title="<run 7> & co")
    text = (tmp_path / "mid.html").read_text(encoding="utf-8")
    assert "<title>&lt;run 7&gt; &amp; co</title>" in text
    assert "No failure detected" in text


def verdict_text(dom: str) -> str:
    start = dom.index('<section id="verdict">')
    section = dom[start : dom.index("</section>", start)]
    return " ".join(html.unescape(re.sub(r"<[^>]+>", "", section)).split())


def test_chromium_renders_the_verdict_and_the_charts(sigmoid_report, chromium):
    outcome, path = sigmoid_report
    dom = browser.dump_dom(chromium, path)
    assert 'data-rendered="ok"' in dom, "the report's script ran to the end without an error"
    verdict = verdict_text(dom)
    top = outcome.hypotheses[0]
    assert str(top.failure) == "vanishing_gradients"
    assert " ".join(top.description.replace("`", "").split()) in verdict
    for remedy in top.remedies:
        assert " ".join(remedy.replace("`", "").split()) in verdict
    layers = len(outcome.record.layer_names)
    assert f'data-rows="{layers}"' in dom, "one heatmap row per layer"
    assert dom.count("<tr>") == len(outcome.events) + 1, "the event list holds every event"
    assert "How vanishing_gradients unfolded" in dom, "the causal graph lists the chain"


def test_heatmap_is_drawn_with_the_runs_colours(sigmoid_report, chromium, tmp_path):
    outcome, path = sigmoid_report
    from PIL import Image

    layout = browser.layout(chromium, path)
    print(f"drawn {layout['ms_to_drawn']:.0f} ms after navigation start")
    shot = tmp_path / "report.png"
    browser.screenshot(chromium, path, shot, 1280, int(layout["page_height"]))
    img = np.asarray(Image.open(shot).convert("RGB")).astype(np.int32)
    left, top, width, height = layout["heatmap_plot"]
    x0 = int(layout["heatmap"]["left"] + left) + 3
    y0 = int(layout["heatmap"]["top"] + top) + 3
    plot = img[y0 : y0 + int(height) - 6, x0 : x0 + int(width) - 6]
    assert plot.size and plot.std() > 20, "the heatmap is not blank"
    assert len(np.unique(plot.reshape(-1, 3), axis=0)) > 8, "many colours: a log scale, not a fill"
    r, g, b = plot[..., 0], plot[..., 1], plot[..., 2]
    blue = (b > r + 40) & (b >= g)
    green = (g > r + 25) & (g > b)
    rows = plot.shape[0]
    # Forward order, input at the top: the first layers vanished (blues), the last stayed healthy
    # (greens), as the independent record of the run says.
    assert outcome.record.grad[outcome.record.layer_names[0]][0] < 1e-6
    assert blue[: rows // 5].mean() > 0.6, blue[: rows // 5].mean()
    assert green[-rows // 8 :].mean() > 0.6, green[-rows // 8 :].mean()
    assert blue[-rows // 8 :].mean() < 0.1
