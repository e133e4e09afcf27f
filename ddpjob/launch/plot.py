"""`ddpjob plot RUN [RUN...] -o curves.png`: a run's history at a glance, drawn.

Last step of the flow, on the login node: the curves read only what the ranks appended to the run
dir (metrics.jsonl, events.jsonl, COMPLETED, checkpoints/); only the goodput bars below them
(launch/goodput.of_runs) ask the scheduler, for the queue wait. Each restart becomes a
marker at the step it resumed from, labelled with the reason of the stop before it.
matplotlib is an optional extra (`pip install 'ddpjob[plot]'`); the text summary (launch/summary.py)
needs nothing.
"""

from __future__ import annotations

import argparse
import io
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ddpjob import console, fileio, rundir
from ddpjob.errors import DDPJobError
from ddpjob.launch import goodput
from ddpjob.launch.history import PANELS, custom_metrics, load_history, number
from ddpjob.ledger import events
from ddpjob.ledger.goodput import CATEGORIES, Ledger, duration

@dataclass
class PlotRecord:
    """What plot_runs drew, for tests and for the command's message."""

    output: Path
    series: dict[str, list[str]] = field(default_factory=dict)  # panel key -> runs with data
    markers: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # run -> (step, label)
    goodput: dict[str, dict[str, float]] = field(default_factory=dict)  # run -> seconds per category
    bands: dict[str, list[tuple[int, int, str]]] = field(default_factory=dict)  # run -> slowdowns (from, to, label)


def _names(run_dirs: list[Path]) -> list[str]:
    """Folder names, or parent/name where two runs share a folder name."""
    names = [p.name for p in run_dirs]
    return [f"{p.parent.name}/{p.name}" if names.count(p.name) > 1 else p.name
            for p in run_dirs]


def plot_runs(run_dirs: list[str | Path], output: str | Path,
              ledgers: Mapping[Path, Ledger | None] | None = None) -> PlotRecord:
    """Draw the four panels (and the user's own metrics) for all runs into one PNG, with a bar
    per run of where its wall time went where `ledgers` has one; returns what was drawn."""
    from matplotlib.figure import Figure  # no pyplot: no global state, Agg canvas for PNG
    from matplotlib.lines import Line2D

    out = fileio.UserOutput(output)  # refused before any drawing if it is no place for a PNG
    paths = [Path(p) for p in run_dirs]
    try:
        histories = [load_history(p, n) for p, n in zip(paths, _names(paths))]
    except fileio.RecordError as exc:
        raise DDPJobError(f"cannot plot: {exc}, expected its records as ddpjob writes them",
                          "move the damaged file out of the run dir") from None
    empty = [h.name for h in histories if not h.train and not h.evals]
    if len(empty) == len(histories):
        over = [p for p in paths if rundir.completed(p) is not None or any(events.is_decision(e) for e in events.read(p))]
        raise DDPJobError(f"no metrics in {', '.join(map(str, paths))} (metrics.jsonl is missing "
                          "or empty)", "its program wrote no metrics lines (docs/commands.md, Metrics); "
                          "`ddpjob status RUN` shows its stops and where its time went" if over else
                          "the job has not logged a step yet: wait, or read `ddpjob logs RUN`")
    for name in empty:
        console.warn(f"{name} has no metrics yet; it is left out of the curves")

    panels = [*PANELS, *((key, key) for key in custom_metrics(histories))]
    rows = (len(panels) + 1) // 2
    bars = [(h.name, ledger) for h, p in zip(histories, paths) if (ledger := (ledgers or {}).get(p)) is not None]
    tall = 1.6 + 0.45 * len(bars) if bars else 0.0
    fig = Figure(figsize=(13, 4.25 * rows + tall), layout="constrained")
    top: Any = fig
    low: Any = None
    if bars:  # the curves on top, the goodput bars below, each with its own x axis
        subs: Any = fig.subfigures(2, 1, height_ratios=[4.25 * rows, tall])
        top, low = subs[0], subs[1]
    axes = top.subplots(rows, 2, sharex=True, squeeze=False).ravel()
    for ax in axes[len(panels):]:
        ax.set_visible(False)
    record = PlotRecord(Path(output), {key: [] for key, _ in panels})
    colors = [f"C{i % 10}" for i in range(len(histories))]
    for h, color in zip(histories, colors):
        for ax, (key, _) in zip(axes, panels):
            recs = h.evals if key.startswith("eval_") else h.train
            pts = [(r["step"], number(r[key])) for r in recs if key in r]
            if not pts:
                continue
            xs, ys = zip(*pts)
            ax.plot(xs, ys, color=color, label=h.name, lw=1.4,
                    marker="o" if key.startswith("eval_") else None, ms=3)
            record.series[key].append(h.name)
        record.markers[h.name] = [(m.step, m.label) for m in h.markers]
        for m in h.markers:
            for ax in axes[:len(panels)]:
                ax.axvline(m.step, color=color, ls="--", lw=1, alpha=0.8)
            axes[0].annotate(m.label, xy=(m.step, 0.98), xycoords=("data", "axes fraction"),
                             rotation=90, va="top", ha="right", fontsize=8, color=color,
                             bbox=dict(fc="white", ec="none", alpha=0.7, pad=1))
        last = h.train[-1]["step"] if h.train else 0
        record.bands[h.name] = [(int(b["since"]), int(o["step"]) if o else max(last, int(b["step"])),
                                 f"slowdown {number(b.get('ratio')):.2f}x ({b.get('cause')})")
                                for b, o in events.slowdowns(h.events) if isinstance(b.get("since"), int)]
        for lo, hi, label in record.bands[h.name]:  # the job slower than its own speed (rank/slowdown.py)
            for ax in axes[:len(panels)]:
                ax.axvspan(lo, hi, color=color, alpha=0.12, lw=0)
            axes[0].annotate(label, xy=(lo, 0.02), xycoords=("data", "axes fraction"), fontsize=8, color=color)
    for ax, (key, title) in zip(axes, panels):
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if not record.series[key]:
            ax.text(0.5, 0.5, "no data", transform=ax.transAxes, ha="center", color="gray")
    for ax in axes[max(0, len(panels) - 2):len(panels)]:  # the bottom row
        ax.set_xlabel("optimizer step")
        ax.xaxis.set_tick_params(labelbottom=True)
    axes[2].ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    handles, labels = axes[0].get_legend_handles_labels()
    if any(h.markers for h in histories):
        handles.append(Line2D([], [], color="gray", ls="--", lw=1))
        labels.append("restart (resumed step, stop reason)")
    if any(record.bands.values()):
        from matplotlib.patches import Patch

        handles.append(Patch(color="gray", alpha=0.25))
        labels.append("slowdown (slower than the run's own speed)")
    if handles:  # below the panels: never on top of a curve or a marker label
        fig.legend(handles, labels, fontsize=8, loc="outside lower center",
                   ncols=min(len(handles), 4))
    if low is not None:
        _draw_goodput(low.subplots(), bars, record)
    fig.suptitle("ddpjob: " + (histories[0].name if len(histories) == 1
                               else f"{len(histories)} runs"))
    png = io.BytesIO()
    fig.savefig(png, format="png", dpi=110)
    out.write(png.getvalue())  # a viewer never sees half a PNG; a device or FIFO is written in place
    return record


def _draw_goodput(ax: Any, bars: list[tuple[str, Ledger]], record: PlotRecord) -> None:
    """One horizontal bar per run: its wall time split by category, in percent."""
    for y, (name, ledger) in enumerate(bars):
        left, wall = 0.0, max(ledger.wall_s, 1e-9)
        record.goodput[name] = dict(ledger.seconds)
        for n, cat in enumerate(CATEGORIES):
            share = 100 * ledger.seconds[cat] / wall
            if share > 0:
                ax.barh(y, share, left=left, color=f"C{n}", label=cat if y == 0 else None)
                left += share
    ax.set_yticks(range(len(bars)), [f"{name}\ngoodput {100 * ledger.goodput:.1f}% of "
                                     f"{duration(ledger.wall_s)}" for name, ledger in bars], fontsize=8)
    ax.set_xlim(0, 100)
    ax.invert_yaxis()  # the first run on top, as in the legend of the curves
    ax.set_xlabel("% of the run's wall time (every attempt, queue included)")
    ax.set_title("where the time went")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.005, 1.0))  # beside the bars, never on them


def cmd_plot(args: argparse.Namespace) -> int:
    for run in args.runs:
        rundir.require_run_dir(run)
    try:
        import matplotlib  # noqa: F401  (optional extra)
    except ImportError:
        raise DDPJobError("matplotlib is not installed, and `ddpjob plot` needs it",
                          "pip install 'ddpjob[plot]' (or pip install matplotlib)") from None
    from ddpjob.launch import runs, summary

    infos = runs.infos([(Path(r), "") for r in args.runs])
    record = plot_runs(args.runs, args.output, goodput.of_runs(infos))
    n = sum(len(m) for m in record.markers.values())
    console.info(f"wrote {record.output}: {len(args.runs)} run(s), {n} restart marker(s)")
    for run, marks in record.markers.items():
        for step, label in marks:
            console.info(f"  {run}: step {step}  {label}")
    for run in args.runs:  # the same ledger as `ddpjob status`, with the recovery's phases
        for line, took in summary.ledger(events.read(run)):
            console.info(f"  {Path(run).name}: {line}" + (f"; recovery: {took}" if took else ""))
    return 0
