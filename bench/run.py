"""`python -m bench [P1 P3 ...] [--tiny]`: run benchmarks, print goal / measured / pass-fail.

The entry point of bench/: writes (or reuses) a CIFAR-10-format data set, runs the chosen
benchmarks from suite.py one after another and prints one table (README.md's Performance
section is this table). Exit status 1 only when a benchmark could not run; a missed goal is a
FAIL in the table, not an error.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
import traceback
from pathlib import Path

if __package__ in (None, ""):  # `python bench/run.py`: make `import bench` work
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench import harness  # noqa: E402
from bench.core import Bench, Row  # noqa: E402
from bench.suite import BENCHMARKS, NO_DATA, ON_DEMAND  # noqa: E402


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def table(rows: list[Row]) -> list[str]:
    cols = ("id", "measure", "goal", "measured", "result")
    cells = [(r.id, r.measure, r.goal, r.measured,
              "-" if r.passed is None else ("pass" if r.passed else "FAIL")) for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = "| " + " | ".join(c.ljust(w) for c, w in zip(cols, widths)) + " |"
    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return [line, rule] + ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths)) + " |"
                           for row in cells]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("ids", nargs="*", metavar="ID",
                    help=f"benchmarks to run ({', '.join(BENCHMARKS)}; default: all but "
                    f"{', '.join(sorted(ON_DEMAND))}, which run only when named)")
    ap.add_argument("--tiny", action="store_true", help="seconds-long smoke run for CI: tiny model, "
                    "few steps; the numbers mean nothing")
    ap.add_argument("--trials", type=int, help="trials per arm (default 5, and 3 for P5-P7; --tiny 1)")
    ap.add_argument("--work", help="work folder: data, logs, run dirs (default: $TMPDIR/ddpjob-bench-UID)")
    ap.add_argument("--json", help="also write the rows (with details) to this file")
    ap.add_argument("--budget-s", type=float, default=0.0,
                    help="P8: start no arm that could not finish this many seconds after the start "
                    "(a lent GPU's time is short); 0 = no limit")
    ap.add_argument("--hold", help="P8: before the timed trials, wait (at most 10 minutes) while this "
                    "file exists: whatever else used the GPU beside the cold compiles (tools/gpu.sh's "
                    "tests) must be done before anything is timed")
    args = ap.parse_args(argv)
    ids = [i.upper() for i in args.ids] or [i for i in BENCHMARKS if i not in ON_DEMAND]
    unknown = [i for i in ids if i not in BENCHMARKS]
    if unknown:
        ap.error(f"unknown benchmark id(s) {', '.join(unknown)}, expected some of {', '.join(BENCHMARKS)}")
    sizes = harness.TINY if args.tiny else harness.FULL
    if args.trials:
        sizes = dataclasses.replace(sizes, trials=args.trials, slow_trials=args.trials)

    base = harness.work_dir(args.work)
    t0 = time.monotonic()
    root = harness.dataset(base, sizes) if set(ids) - NO_DATA else base
    before = harness.machine()
    _log(f"bench: {before['cpu']}, {before['cores']} cores, torch {before['torch']}, load {before['load']}; "
         f"work dir {base}")
    bench = Bench(sizes, base, root, log=_log,
                  deadline=t0 + args.budget_s if args.budget_s > 0 else float("inf"),
                  hold=Path(args.hold) if args.hold else None)
    rows: list[Row] = []
    crashed = False
    try:
        for i in ids:
            _log(f"{i} ...")
            t1 = time.monotonic()
            try:
                rows += BENCHMARKS[i](bench)
            except Exception as exc:  # report it in the table and go on with the others
                crashed = True
                traceback.print_exc()
                first = " ".join(str(exc).split("\n")[0].split())[:120]
                rows.append(Row(i, "(did not run)", "", f"error: {type(exc).__name__}: {first}", False))
            _log(f"{i} done in {time.monotonic() - t1:.0f} s")
    finally:
        bench.close()
    after = harness.machine()
    print(f"ddpjob benchmarks{' (--tiny: smoke run, figures meaningless)' if sizes.tiny else ''}: "
          f"{after['cpu']}, {after['cores']} cores, torch {after['torch']}, python {after['python']}; "
          f"load average {before['load']} before, {after['load']} after; {time.monotonic() - t0:.0f} s")
    print("\n".join(table(rows)))
    for r in rows:
        shown = {k: v for k, v in r.details.items() if not isinstance(v, dict)}
        if shown:
            print(f"  {r.id}: " + "; ".join(f"{k} {v}" for k, v in shown.items()))
    if args.json:
        Path(args.json).write_text(json.dumps({"machine": after, "sizes": dataclasses.asdict(sizes),
                                               "rows": [dataclasses.asdict(r) for r in rows]}, indent=1))
    return 1 if crashed else 0


if __name__ == "__main__":
    sys.exit(main())
