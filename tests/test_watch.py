"""``neuraldbg watch`` against a trace that a training process is still writing: the terminal UI
in a real terminal (tmux, read back with ``capture-pane``) and the plain mode for logs.

``make test`` installs tmux (Debian's package); without it the terminal test is skipped. Setting
``NEURALDBG_SCREENSHOTS=DIR`` also saves the rendered terminal as ``DIR/watch.png`` (``make
watch-screenshot`` writes docs/watch.png that way).
"""

from __future__ import annotations

import html
import os
import re
import shutil
import signal
import subprocess
import sys
import textwrap
import time
import uuid
from pathlib import Path
from typing import Callable, Iterator, List, Optional

import pytest
from bench import browser

CLI = str(Path(sys.executable).parent / "neuraldbg")

# A tanh MLP trained with a sane learning rate, multiplied by 20,000 at step 30 (a planted
# failure: exploding gradients from step 30), slowed down so the run is still going while watched.
TRAIN = textwrap.dedent(
    """
    import sys, time
    import torch, torch.nn as nn
    from neuraldbg import NeuralDbg

    path, steps, delay = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(),
                          nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    crit = nn.MSELoss()
    with NeuralDbg(model, trace=path, criterion=crit):
        for step in range(steps):
            if step == 30:
                for g in opt.param_groups:
                    g["lr"] = 1000.0
            opt.zero_grad()
            x = torch.randn(32, 8)
            crit(model(x), x[:, :2] * 3).backward()
            opt.step()
            time.sleep(delay)
    """
)


def start_training(tmp: Path, steps: int, delay: float) -> tuple[subprocess.Popen, Path]:
    script = tmp / "train.py"
    script.write_text(TRAIN)
    trace = tmp / "run.ndbg"
    proc = subprocess.Popen([sys.executable, str(script), str(trace), str(steps), str(delay)])
    return proc, trace


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.1)
    raise AssertionError(f"timed out waiting for {what}")


def explain_lines(trace: Path) -> List[str]:
    proc = subprocess.run([CLI, "explain", str(trace)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


# ------------------------------------------------------------------ plain mode


def test_plain_mode_prints_events_as_they_are_confirmed_then_the_verdict(tmp_path: Path) -> None:
    train, trace = start_training(tmp_path, steps=60, delay=0.02)
    err_path = tmp_path / "watch.err"
    try:
        # Started before the trace exists; stdout is a pipe, so plain mode is automatic.
        with open(err_path, "w") as err_file:
            watch = subprocess.Popen(
                [CLI, "watch", str(trace), "--interval", "0.05"], stdout=subprocess.PIPE, stderr=err_file, text=True
            )
            assert watch.stdout is not None
            lines = []
            running_at_first_event = None
            for line in watch.stdout:
                if running_at_first_event is None:
                    # The first event arrived while the training process was still running.
                    running_at_first_event = train.poll() is None
                lines.append(line.rstrip("\n"))
            watch.wait(timeout=120)
        assert train.wait(timeout=60) == 0
    finally:
        train.kill()
    err = err_path.read_text()
    assert watch.returncode == 0, err
    assert running_at_first_event, "the run ended before watch printed its first event"
    assert re.match(r"step +\d+ ", lines[0]), lines[0]
    verdict = explain_lines(trace)
    assert lines[-len(verdict) :] == verdict
    assert "exploding_gradients" in verdict[0]
    events = subprocess.run([CLI, "events", str(trace)], capture_output=True, text=True).stdout.splitlines()
    assert sorted(lines[: -len(verdict)]) == sorted(events)
    assert "watching" in err


# ------------------------------------------------------------------ terminal UI in tmux


@pytest.fixture
def tmux() -> Iterator[Callable[..., str]]:
    exe = shutil.which("tmux")
    if exe is None:
        pytest.skip("no tmux (make test installs Debian's tmux)")
    socket = f"ndbg-{uuid.uuid4().hex[:8]}"

    def run(*args: str) -> str:
        proc = subprocess.run([exe, "-L", socket, *args], capture_output=True, text=True, timeout=30)
        assert proc.returncode == 0, f"tmux {args}: {proc.stderr}"
        return proc.stdout

    yield run
    subprocess.run([exe, "-L", socket, "kill-server"], capture_output=True)


def ansi_to_html(text: str) -> str:
    """A terminal capture (``capture-pane -e``) as an HTML page, colours included."""
    base = ["#1d2330", "#e05561", "#8cc265", "#d18f52", "#4aa5f0", "#c162de", "#42b3c2", "#d7dae0"]
    bright = ["#5c6370", "#ff616e", "#a5e075", "#f0a45d", "#4dc4ff", "#de73ff", "#4cd1e0", "#ffffff"]
    out: List[str] = []
    fg: Optional[str] = None
    bold = rev = False
    for part in re.split(r"(\x1b\[[0-9;]*m)", text):
        m = re.fullmatch(r"\x1b\[([0-9;]*)m", part)
        if not m:
            if part:
                style = []
                color = fg or "#d7dae0"
                if rev:
                    style.append(f"background:{color};color:#14171f")
                else:
                    style.append(f"color:{color}")
                if bold:
                    style.append("font-weight:bold")
                out.append(f'<span style="{";".join(style)}">{html.escape(part)}</span>')
            continue
        codes = [int(c) if c else 0 for c in m.group(1).split(";")]
        i = 0
        while i < len(codes):
            c = codes[i]
            if c == 0:
                fg, bold, rev = None, False, False
            elif c == 1:
                bold = True
            elif c == 7:
                rev = True
            elif c == 22:
                bold = False
            elif c == 27:
                rev = False
            elif 30 <= c <= 37:
                fg = base[c - 30]
            elif 90 <= c <= 97:
                fg = bright[c - 90]
            elif c == 39:
                fg = None
            elif c == 38 and i + 2 < len(codes) and codes[i + 1] == 5:
                n = codes[i + 2]
                fg = (base + bright)[n] if n < 16 else None
                i += 2
            i += 1
    body = "".join(out)
    return (
        "<!DOCTYPE html><html><head><meta charset='utf-8'><style>"
        "body{margin:0;background:#14171f}"
        "pre{margin:0;padding:12px;font:14px/1.2 'DejaVu Sans Mono',monospace;color:#d7dae0}"
        f"</style></head><body><pre>{body}</pre></body></html>"
    )


def test_watch_tui_follows_a_running_training_and_survives_its_kill(tmp_path: Path, tmux) -> None:
    train, trace = start_training(tmp_path, steps=100_000, delay=0.03)
    try:
        wait_for("the trace header", lambda: trace.exists() and trace.stat().st_size > 2000)
        tmux(
            "new-session",
            "-d",
            "-s",
            "w",
            "-x",
            "110",
            "-y",
            "34",
            f"cd {tmp_path} && {CLI} watch {trace.name} --interval 0.2; echo EXITED $?; sleep 600",
        )
        screen = lambda: tmux("capture-pane", "-p", "-J", "-t", "w")  # noqa: E731

        def step_shown() -> int:
            m = re.search(r"step (\d+)\s+steps (\d+)", screen())
            return int(m.group(1)) if m else -1

        wait_for("the exploding gradients to be diagnosed", lambda: "exploding_gradients" in screen())
        s1 = step_shown()
        wait_for("the step count to move", lambda: step_shown() > s1 + 5)
        text = screen()
        assert "following (writer process" in text and f"{train.pid} running" in text, text
        assert re.search(r"steps/s (\d+\.\d)", text), text
        # One strip row per layer, in forward order, then the events and the hypotheses.
        rows = [re.match(r"│(\S+)\s+[█·!]", line) for line in text.splitlines()]
        assert [m.group(1) for m in rows if m] == ["0", "2", "4", "6"], text
        assert "Top hypotheses" in text and "Events (" in text
        assert "EXPLODING" in text

        if os.environ.get("NEURALDBG_SCREENSHOTS") or browser.find_chromium():
            colour = tmux("capture-pane", "-p", "-e", "-t", "w")
            page = tmp_path / "watch.html"
            page.write_text(ansi_to_html(colour), encoding="utf-8")
            chromium = browser.find_chromium()
            if chromium:
                png = tmp_path / "watch.png"
                browser.screenshot(chromium, page, png, 1000, 600)
                assert png.stat().st_size > 10_000
                dest = os.environ.get("NEURALDBG_SCREENSHOTS")
                if dest:
                    shutil.copy(png, Path(dest) / "watch.png")

        # The writer is killed: the view stays up and says so.
        train.send_signal(signal.SIGKILL)
        train.wait(timeout=30)
        wait_for("the view to notice the writer is gone", lambda: "without closing the trace" in screen(), 30)
        assert "EXITED" not in screen()
        tmux("send-keys", "-t", "w", "q")
        wait_for("watch to exit on q", lambda: "EXITED 0" in screen(), 30)
        after = screen()
        verdict = explain_lines(trace)
        # Back on the normal screen: the verdict, as `explain` prints it.
        for line in verdict[:3]:
            assert line[:100] in after.replace("\n", ""), (line, after)
        # Ctrl-C quits as well (the terminal is in raw mode: it arrives as a key).
        tmux(
            "new-window",
            "-t",
            "w",
            "-n",
            "again",
            f"cd {tmp_path} && {CLI} watch {trace.name}; echo EXITED $?; sleep 600",
        )
        again = lambda: tmux("capture-pane", "-p", "-J", "-t", "w:again")  # noqa: E731
        wait_for("the second view", lambda: "without closing the trace" in again(), 30)
        tmux("send-keys", "-t", "w:again", "C-c")
        wait_for("watch to exit on Ctrl-C", lambda: "EXITED 0" in again(), 30)
    finally:
        train.kill()
        train.wait()


def test_watch_tui_exits_when_the_run_closes_the_trace(tmp_path: Path, tmux) -> None:
    train, trace = start_training(tmp_path, steps=40, delay=0.05)
    try:
        tmux("new-session", "-d", "-s", "c", "-x", "100", "-y", "30", f"{CLI} watch {trace}; echo EXITED $?; sleep 600")
        # (With the scrollback: the verdict printed on exit may push the first lines up.)
        screen = lambda: tmux("capture-pane", "-p", "-J", "-S", "-200", "-t", "c")  # noqa: E731
        wait_for("the view to start", lambda: "neuraldbg watch" in screen() or "step" in screen(), 30)
        assert train.wait(timeout=120) == 0
        wait_for("watch to exit once the trace is closed", lambda: "EXITED 0" in screen(), 30)
        assert "closed: the run ended" in screen()
    finally:
        train.kill()
        train.wait()
