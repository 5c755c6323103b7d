#!/usr/bin/env python3
"""The external suite under ``--confirm`` (`make bench-confirm`): does trying the diagnosis's
remedies confirm the labelled cause, and nothing on the healthy controls?

Each program of bench/external, buggy and then fixed, is run through
``neuraldbg.run("bench.external.targets:<function>", confirm=True)``: the public API, the same
path as ``neuraldbg run --confirm``. The function trains the program as
bench/external_scoreboard.py does (one thread, ``torch.manual_seed(0)`` before the build), and
every re-run (once unchanged, once per mechanical remedy of the top ``--confirm-top``
hypotheses) is a fresh process that imports it by name. Scored, per program:

- buggy: the top hypothesis of the plain diagnosis (highest confidence; "detected" when >= 0.5,
  as on the scoreboard), its verdict, and whether it names the labelled cause (the label's cause
  or one of its ``also``); whether a confirmed hypothesis at any of the top K ranks names it;
  the top after verdicts (the first confirmed hypothesis, else the plain top) and whether it
  names the labelled cause;
- fixed: whether anything was confirmed (a healthy program should have nothing confirmed).

The fixed version a group of programs shares (``fixed_key``) runs once. ``--json FILE`` keeps
every program's hypotheses with their verdicts and evidence, rewritten after each program, so
a run cut short still has what it did; ``--score FILE`` prints the table and totals of such a
file without running anything.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import sys
import time
from typing import Any, Dict, Iterable, List, Optional, Tuple

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from bench.external import all_programs
from bench.external.common import Program
from bench.external.targets import function_name

VERDICTS = ("confirmed", "refuted", "inconclusive", "untested")


def labels(row: Dict[str, Any]) -> Tuple[str, ...]:
    """The causes that name a buggy program's labelled fault (none when the vocabulary has no
    name for it)."""
    return ((row["cause"],) + tuple(row["also"])) if row.get("cause") else ()


def plain_top(hyps: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """The diagnosis's own top hypothesis: the most confident (``--confirm`` moves the
    confirmed ones first; the sort is stable, so ties keep the order they were given in)."""
    return sorted(hyps, key=lambda h: -h["confidence"])[0] if hyps else None


def after_verdicts(hyps: List[Dict[str, Any]]) -> Optional[Dict[str, Any]]:
    """What the ranking puts first once verdicts are in: the first confirmed hypothesis, else
    the plain top."""
    confirmed = [h for h in hyps if h.get("verdict") == "confirmed"]
    return confirmed[0] if confirmed else plain_top(hyps)


def names(h: Optional[Dict[str, Any]], causes: Tuple[str, ...]) -> bool:
    return h is not None and h["cause"] in causes


def assess(row: Dict[str, Any]) -> Dict[str, Any]:
    """One run's scores (see the module's docstring)."""
    hyps = row["hypotheses"]
    top = plain_top(hyps)
    causes = labels(row) if row["variant"] == "buggy" else ()
    after = after_verdicts(hyps)
    return {
        "top": top,
        "detected": top is not None and top["confidence"] >= 0.5,
        "verdict": None if top is None else top.get("verdict"),
        "top_names_cause": names(top, causes) and top is not None and top["confidence"] >= 0.5,
        "confirmed": [h for h in hyps if h.get("verdict") == "confirmed"],
        "cause_confirmed": any(h.get("verdict") == "confirmed" and h["cause"] in causes for h in hyps),
        "after": after,
        # Put first by a verdict, or by its own confidence like the scoreboard's top.
        "after_names_cause": names(after, causes)
        and after is not None
        and (after.get("verdict") == "confirmed" or after["confidence"] >= 0.5),
    }


def totals(rows: Iterable[Dict[str, Any]]) -> Dict[str, Any]:
    """The suite's totals: for the buggy runs, the verdicts of the detected top hypotheses and
    how many of the confirmed name the labelled cause (precision, over those with a label), the
    labelled causes confirmed at any tested rank, and the top after verdicts naming the cause
    against the plain top; for the fixed runs, how many had anything confirmed."""
    t: Dict[str, Any] = {
        "buggy": 0,
        "labelled": 0,
        "detected": 0,
        "top_verdicts": dict.fromkeys(VERDICTS, 0),
        "top_confirmed_labelled": 0,
        "top_confirmed_names_cause": 0,
        "cause_confirmed_any_rank": 0,
        "plain_names_cause": 0,
        "after_names_cause": 0,
        "confirmed_any_rank": 0,
        "fixed": 0,
        "fixed_confirmed": 0,
        "fixed_alarms": 0,
    }
    for row in rows:
        a = assess(row)
        if row["variant"] == "fixed":
            t["fixed"] += 1
            t["fixed_confirmed"] += bool(a["confirmed"])
            t["fixed_alarms"] += a["detected"]
            continue
        t["buggy"] += 1
        labelled = bool(labels(row))
        t["labelled"] += labelled
        t["confirmed_any_rank"] += bool(a["confirmed"])
        if a["detected"]:
            t["detected"] += 1
            t["top_verdicts"][a["verdict"] or "untested"] += 1
            if a["verdict"] == "confirmed" and labelled:
                t["top_confirmed_labelled"] += 1
                t["top_confirmed_names_cause"] += a["top_names_cause"]
        t["cause_confirmed_any_rank"] += a["cause_confirmed"]
        t["plain_names_cause"] += a["top_names_cause"]
        t["after_names_cause"] += a["after_names_cause"]
    return t


# ------------------------------------------------------------------------- running


def confirm_run(p: Program, buggy: bool, args: argparse.Namespace) -> Dict[str, Any]:
    """``p``'s buggy or fixed version through ``neuraldbg.run(..., confirm=True)``."""
    import neuraldbg

    fn = function_name(p, buggy)
    out = os.path.join(args.out, fn)
    said = io.StringIO()
    t0 = time.perf_counter()
    with contextlib.redirect_stderr(said), contextlib.redirect_stdout(said):
        res = neuraldbg.run(
            f"bench.external.targets:{fn}",
            out=out,
            confirm=True,
            confirm_top=args.confirm_top,
            jobs=args.jobs,
            quiet=True,
        )
    seconds = time.perf_counter() - t0
    losses = res.value.losses if res.value is not None else []
    return {
        "program": p.name,
        "variant": "buggy" if buggy else "fixed",
        "function": fn,
        "label": p.label,
        "cause": p.cause,
        "also": list(p.also),
        "fixed_key": None if p.fixed_key is None else str(p.fixed_key),
        "seconds": round(seconds, 1),
        "steps": res.steps,
        "loss_first": losses[0] if losses else None,
        "loss_last": losses[-1] if losses else None,
        "exit_code": res.exit_code,
        "hypotheses": res.hypotheses,
        "confirm": res.confirm,
        "out": out,
        "said": said.getvalue(),
    }


# ------------------------------------------------------------------------- printing


def _hyp(h: Optional[Dict[str, Any]]) -> str:
    return "(none)" if h is None else f"{h['failure']}/{h['cause']} {h['confidence']:.2f}"


def _mark(ok: bool, labelled: bool) -> str:
    return "-" if not labelled else ("ok" if ok else "XX")


def print_table(rows: List[Dict[str, Any]], verbose: bool) -> None:
    fixed = {r["program"]: r for r in rows if r["variant"] == "fixed"}
    print(
        f"{'program':<34} {'labelled cause':<24} {'buggy: top hypothesis':<50} {'verdict':<13}{'cause':<6}"
        f"{'after verdicts':<50} {'cause':<6}{'confirmed, any rank':<40} {'fixed: confirmed':<30} {'s':>5}"
    )
    print("-" * 262)
    for r in rows:
        if r["variant"] != "buggy":
            continue
        a = assess(r)
        lab = bool(labels(r))
        conf = ", ".join(sorted({h["cause"] for h in a["confirmed"]})) or "-"
        f = fixed.get(r["program"])
        if f is None:
            fdesc = "(not run)"
        else:
            fc = assess(f)["confirmed"]
            fdesc = ", ".join(sorted({h["cause"] for h in fc})) if fc else "nothing"
        verdict = (a["verdict"] or "-") if a["detected"] else f"({a['verdict'] or '-'})"
        secs = r["seconds"] + (f["seconds"] if f is not None and not f.get("shared") else 0)
        print(
            f"{r['program']:<34} {r['cause'] or '(not in vocabulary)':<24} {_hyp(a['top']):<50} {verdict:<13}"
            f"{_mark(a['top_names_cause'], lab):<6}{_hyp(a['after']):<50} {_mark(a['after_names_cause'], lab):<6}"
            f"{conf:<40} {fdesc:<30} {secs:>5.0f}",
            flush=True,
        )
        if verbose:
            for v in (r, f):
                if v is None:
                    continue
                for h in v["hypotheses"]:
                    if "evidence" not in h or h["evidence"].get("why", "").startswith("not among the top"):
                        continue
                    ev = h["evidence"]
                    nums = ""
                    if h.get("intervention"):
                        nums = (
                            f"; {h['intervention']}: loss {ev.get('loss')} vs {ev.get('loss_unchanged')} unchanged "
                            f"(first run {ev.get('loss_first_run')}, spread {ev.get('spread', 0):.3g}), "
                            f"recurred {ev.get('failure_recurred')}, applied {ev.get('applied')}"
                        )
                    print(
                        f"     {v['variant']}: {h['verdict']:<12} {_hyp(h)}{nums}; {ev.get('why')}",
                    )


def print_totals(t: Dict[str, Any], seconds: Optional[float] = None) -> None:
    v = t["top_verdicts"]
    n = t["top_confirmed_labelled"]
    precision = f"{t['top_confirmed_names_cause']}/{n}" + (f" = {t['top_confirmed_names_cause'] / n:.0%}" if n else "")
    print(
        f"buggy: {t['buggy']} programs, top hypothesis >= 0.5 on {t['detected']}: confirmed {v['confirmed']}, "
        f"refuted {v['refuted']}, inconclusive {v['inconclusive']}, untested {v['untested']}; "
        f"confirmed tops naming the labelled cause (precision, over the {n} with a label): {precision}; "
        f"labelled cause confirmed at any tested rank: {t['cause_confirmed_any_rank']}/{t['labelled']}; "
        f"programs with anything confirmed: {t['confirmed_any_rank']}/{t['buggy']}"
    )
    print(
        f"labelled cause named by the top: plain diagnosis {t['plain_names_cause']}/{t['labelled']}, "
        f"top after verdicts (confirmed first) {t['after_names_cause']}/{t['labelled']}"
    )
    print(
        f"fixed: {t['fixed']} runs; anything confirmed on {t['fixed_confirmed']}; "
        f"a hypothesis >= 0.5 (the scoreboard's false alarm) on {t['fixed_alarms']}"
        + ("" if seconds is None else f"; {seconds:.0f}s")
    )


# ------------------------------------------------------------------------- main


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="only programs whose name contains one of these")
    ap.add_argument(
        "--exclude", nargs="+", default=[], metavar="NAME", help="leave out programs whose name contains one"
    )
    ap.add_argument("--jobs", type=int, default=1, help="re-runs of one program at once (default 1)")
    ap.add_argument("--confirm-top", type=int, default=3, help="hypotheses whose remedy is tried (default 3)")
    ap.add_argument(
        "--only", choices=("buggy", "fixed"), default=None, help="run only the buggy or only the fixed versions"
    )
    ap.add_argument("--json", default=None, metavar="FILE", help="every run's hypotheses, verdicts and evidence")
    ap.add_argument("--out", default="runs/external-confirm", help="where the runs' traces go")
    ap.add_argument(
        "--score",
        nargs="+",
        default=None,
        metavar="FILE",
        help="print the table of --json files (a later file's row replaces an earlier one), run nothing",
    )
    ap.add_argument("-v", "--verbose", action="store_true", help="print every tested hypothesis's verdict and numbers")
    args = ap.parse_args()

    if args.score:
        # A later file's row replaces an earlier one of the same program and variant.
        merged: Dict[Tuple[str, str], Dict[str, Any]] = {}
        for path in args.score:
            with open(path, encoding="utf-8") as f:
                for row in json.load(f)["rows"]:
                    merged.pop((row["program"], row["variant"]), None)
                    merged[(row["program"], row["variant"])] = row
        rows: List[Dict[str, Any]] = list(merged.values())
        print_table(rows, args.verbose)
        print_totals(totals(r for r in rows if not r.get("shared")))
        return 0

    import torch

    torch.set_num_threads(1)
    progs = [
        p
        for p in all_programs()
        if (not args.names or any(n in p.name for n in args.names)) and not any(n in p.name for n in args.exclude)
    ]
    variants = [v for v in (True, False) if args.only is None or v == (args.only == "buggy")]
    rows = []
    done_fixed: Dict[str, Dict[str, Any]] = {}  # fixed_key -> the shared control's row
    t0 = time.perf_counter()

    def save() -> None:
        if args.json:
            with open(args.json, "w", encoding="utf-8") as f:
                json.dump(
                    {
                        "command": " ".join(sys.argv),
                        "torch": torch.__version__,
                        "confirm_top": args.confirm_top,
                        "rows": rows,
                    },
                    f,
                    indent=1,
                )

    # Every buggy version first, then the fixed ones: a run cut short has the buggy side whole.
    for buggy in variants:
        for p in progs:
            key = None if p.fixed_key is None else str(p.fixed_key)
            if not buggy and key is not None and key in done_fixed:
                row = dict(done_fixed[key], program=p.name, shared=True, seconds=0.0)
            else:
                row = confirm_run(p, buggy, args)
                if not buggy and key is not None:
                    done_fixed[key] = row
            rows.append(row)
            save()
            a = assess(row)
            print(
                f"{row['variant']:<6}{p.name:<34} top {_hyp(a['top']):<50} {a['verdict'] or '-':<13} "
                f"confirmed: {', '.join(sorted({h['cause'] for h in a['confirmed']})) or '-':<40} {row['seconds']:.0f}s",
                file=sys.stderr,
                flush=True,
            )
            if args.verbose and row.get("said"):
                print(row["said"], file=sys.stderr, flush=True)
    print()
    print_table(rows, args.verbose)
    print("-" * 262)
    print_totals(totals(r for r in rows if not r.get("shared")), time.perf_counter() - t0)
    print(f"torch {torch.__version__}, 1 thread, --confirm-top {args.confirm_top}, --jobs {args.jobs}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
