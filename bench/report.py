"""Runs one scenario of the suite and writes NeuralDBG's HTML report of it (and a screenshot).

    python bench/report.py relu_dies_adam_lr -o runs/report.html --png docs/report.png

``make report-screenshot`` regenerates ``docs/report.png`` this way.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench import browser, suite
from bench import scenarios as S


def main() -> int:
    names = [s.name for s in suite.all_scenarios()]
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("scenario", choices=names, metavar="SCENARIO", help="one of: " + ", ".join(names))
    ap.add_argument("-o", "--output", default="runs/report.html", help="the HTML report to write")
    ap.add_argument("--png", help="also write a full-page screenshot (headless Chromium) here")
    ap.add_argument("--width", type=int, default=1280)
    args = ap.parse_args()

    scenario = next(s for s in suite.all_scenarios() if s.name == args.scenario)
    torch.set_num_threads(1)
    outcome = S.evaluate(scenario)
    os.makedirs(os.path.dirname(os.path.abspath(args.output)), exist_ok=True)
    t0 = time.perf_counter()
    outcome.dbg.save_report(args.output, title=f"NeuralDBG report: {scenario.name} ({scenario.arch})")
    print(f"{args.output}: {os.path.getsize(args.output) / 1e3:.0f} kB in {time.perf_counter() - t0:.3f} s")
    for h in outcome.hypotheses[:3]:
        print(" ", h)
    if args.png:
        chromium = browser.find_chromium()
        if chromium is None:
            print("no chromium found (make browser installs it)", file=sys.stderr)
            return 1
        height = int(browser.layout(chromium, args.output, args.width)["page_height"])
        browser.screenshot(chromium, args.output, args.png, args.width, height)
        print(f"{args.png}: {args.width}x{height}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
