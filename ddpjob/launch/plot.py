"""`ddpjob plot RUN [RUN...] -o curves.png` and `summary(run_dir)`: a run's history at a glance.

Last step of the flow, on the login node: the curves read only what the ranks appended to the run
dir (metrics.jsonl, events.jsonl, COMPLETED, checkpoints/); only the goodput bars below them
(launch/goodput.of_runs) ask the scheduler, for the queue wait. Each restart becomes a
marker at the step it resumed from, labelled with the reason of the stop before it.
matplotlib is an optional extra (`pip install 'ddpjob[plot]'`); `summary` needs nothing.
"""

from __future__ import annotations

import argparse
import io
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ddpjob import console, fileio, rundir
from ddpjob.ledger import attempts, budget, crashes, events, phases
from ddpjob.ledger.goodput import CATEGORIES, Ledger, duration
from ddpjob.errors import DDPJobError
from ddpjob.launch import goodput

# (metrics key, panel title): the four panels, in reading order.
PANELS = (("loss", "train loss"), ("eval_acc", "eval accuracy"), ("lr", "learning rate"),
          ("img_s", "images/s"))
# A record's bookkeeping, not a metric; every other number a loop logs gets a panel of its own.
# eval_s: the evaluation's seconds, drawn in the goodput panel's "eval" instead
_NOT_METRICS = frozenset({"kind", "time", "step", "restart", "epoch", "eval_s"})
MAX_CUSTOM_PANELS = 8


def custom_metrics(histories: list[History]) -> list[str]:
    """The user's own logged metrics (job.log(grad_norm=...)), beyond the built-in panels."""
    fixed = {key for key, _ in PANELS}
    seen: dict[str, None] = {}
    for h in histories:
        for r in [*h.train, *h.evals]:
            for k, v in r.items():
                if k not in fixed and k not in _NOT_METRICS and isinstance(v, (int, float)) \
                        and not isinstance(v, bool):
                    seen.setdefault(k)
    return sorted(seen)[:MAX_CUSTOM_PANELS]


@dataclass(frozen=True)
class Marker:
    """A restart: training resumed at `step` after a stop for `reason`."""

    step: int
    reason: str
    restart: int  # the attempt's number in the run (ledger/attempts.py): 1 for the first restart ...

    @property
    def label(self) -> str:
        return f"restart {self.restart}: {self.reason}"


@dataclass
class History:
    name: str
    train: list[dict[str, Any]]  # one record per step (a re-run step keeps its latest record)
    evals: list[dict[str, Any]]
    markers: list[Marker]
    events: list[dict[str, Any]]
    exclude_after: int = crashes.QUARANTINE_AFTER  # the run's [slurm] exclude_after


@dataclass
class PlotRecord:
    """What plot_runs drew, for tests and for the command's message."""

    output: Path
    series: dict[str, list[str]] = field(default_factory=dict)  # panel key -> runs with data
    markers: dict[str, list[tuple[int, str]]] = field(default_factory=dict)  # run -> (step, label)
    goodput: dict[str, dict[str, float]] = field(default_factory=dict)  # run -> seconds per category


def _num(v: Any) -> float:
    """Metrics values: numbers, or "nan"/"inf" strings (JSON has no NaN)."""
    try:
        return float(v)
    except (TypeError, ValueError):
        return math.nan


def restart_markers(evs: list[dict[str, Any]]) -> list[Marker]:
    """Every "start" after the first one is a restart; its reason is the last stop before it."""
    markers: list[Marker] = []
    started = False
    reason: str | None = None
    for e in evs:
        kind = e.get("event")
        if kind == "stop":
            reason = str(e.get("reason") or "stopped")
        elif kind == "cancel" and reason is None:
            reason = "cancelled"
        elif kind == "start":
            if started:
                step = e.get("resumed_step")
                number = e.get("restart")
                markers.append(Marker(int(step) if isinstance(step, int) else 0, reason or "killed (no stop recorded)",
                                      number if isinstance(number, int) and not isinstance(number, bool)
                                      else len(markers) + 1))
            started, reason = True, None
    return markers


def load_history(run_dir: str | Path, name: str | None = None) -> History:
    run = Path(run_dir)
    train: dict[int, dict[str, Any]] = {}
    evals: dict[int, dict[str, Any]] = {}
    for rec in fileio.read_jsonl(run / rundir.METRICS):
        if not isinstance(rec.get("step"), int):
            continue
        is_eval = rec.get("kind") == "eval" or (rec.get("kind") is None and "eval_acc" in rec)
        (evals if is_eval else train)[rec["step"]] = rec  # later (re-run) records win
    evs = events.read(run)
    after = fileio.read_record(run / "config.json").get("slurm", {}).get("exclude_after")
    return History(name or run.name, [train[s] for s in sorted(train)],
                   [evals[s] for s in sorted(evals)], restart_markers(evs), evs,
                   after if isinstance(after, int) and not isinstance(after, bool) else crashes.QUARANTINE_AFTER)


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
        raise DDPJobError(f"no metrics in {', '.join(map(str, paths))} (metrics.jsonl is missing "
                          "or empty)", "the job has not logged a step yet: wait, or read "
                          "`ddpjob logs RUN`")
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
            pts = [(r["step"], _num(r[key])) for r in recs if key in r]
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


# ------------------------------------------------------------------------- text summary
def _state(run: Path, h: History) -> str:
    done = rundir.completed(run)
    if done is not None:
        acc = done.get("accuracy")
        return f"completed at step {done.get('step')}" + (
            f" (accuracy {acc:.4f})" if isinstance(acc, (int, float)) else "")
    for e in reversed(h.events):
        kind = e.get("event")
        if kind == "start":
            return f"running (restart {e.get('restart', 0)})"
        if kind == "cancel":
            return "cancelled"
        if kind == "stop":
            reason = e.get("reason") or "stopped"
            if reason == "crash" and not e.get("requeued"):
                return "failed" + (f": {e['error']}" if e.get("error") else "")
            requeued = ", requeued" if e.get("requeued") else ""
            return f"stopped ({reason}) at step {e.get('step')}{requeued}"
    return "not started"


def summary(run_dir: str | Path, live_job: str | None = None) -> list[str]:
    """A few lines about a run from its run dir alone: state, progress, restarts, the ledger.
    `live_job`: the run's SLURM job while it is queued or running, whose next restart inside its
    allocation leaves quarantined hosts out; None (ended, or the local backend): none is."""
    run = Path(run_dir)
    h = load_history(run)
    lines = [f"state       {_state(run, h)}"]
    if h.train:
        r = h.train[-1]
        # what the record holds, in the built-in trainer's order first: a custom loop's own
        # metrics are shown, and nothing it did not log ("epoch ?", "nan img/s")
        said = [f"step {r['step']}"] + ([f"epoch {r['epoch']}"] if "epoch" in r else [])
        for key, fmt in (("loss", ".4f"), ("lr", ".3g")):
            if key in r:
                said.append(f"{key} {_num(r[key]):{fmt}}")
        if "img_s" in r:
            said.append(f"{_num(r['img_s']):.0f} img/s")
        said += [f"{k} {_num(r[k]):.4g}" for k in custom_metrics([h]) if k in r][:4]
        lines.append("progress    " + ", ".join(said))
    accs = [(a, r["step"]) for r in h.evals if not math.isnan(a := _num(r.get("eval_acc")))]
    if accs:  # a loop that evaluates no accuracy gets no line (not "nan")
        best = max(accs, key=lambda a: a[0])
        lines.append(f"best acc    {best[0]:.4f} at step {best[1]} (last {accs[-1][0]:.4f} at step {accs[-1][1]})")
    if h.markers:  # as many as the run's attempts less one (ledger/attempts.py), as `ls` counts them
        restarts = max(len(attempts.of_run(h.events)) - 1, len(h.markers))
        lines.append(f"restarts    {restarts}: " + "; ".join(
            f"resumed at step {m.step} after {m.reason}" for m in h.markers))
    else:
        lines.append("restarts    0")
    for line, took in ledger(h.events):
        lines.append(f"attempt     {line}")
        if took:
            lines.append(f"  recovery  {took}")
    for e in h.events:  # the straggler watch's findings (rank/straggler.py)
        if e.get("event") == "straggler":
            lines.append(f"straggler   rank {e.get('rank')} on {e.get('host')} ({e.get('cause')}), steps "
                         f"{e.get('first_step')}-{e.get('step')}: {_num(e.get('busy_ms')):.1f} ms of work per "
                         f"step against {_num(e.get('median_ms')):.1f} ms (job {e.get('job_id')})")
    failures = crashes.host_failures(h.events)
    if failures:  # the run's host ledger, and what the live job's next restart leaves out
        out = set(crashes.excluded(h.events, budget.job_chain(h.events, live_job), h.exclude_after)
                  if live_job else ())
        lines.append("hosts       " + ", ".join(
            f"{host} {n} failure{'s' * (n != 1)}{f' (excluded from job {live_job})' if host in out else ''}"
            for host, n in sorted(failures.items())))
    return lines


def ledger(evs: list[dict[str, Any]]) -> list[tuple[str, str]]:
    """One entry per stop of the run (rank 0's and the crash records): a line with why, at which
    step, steps lost, how it came back and the seconds from the signal to the next start's
    resumed step; and the recovery's phases ('' if none were recorded: ledger/phases.py)."""
    out: list[tuple[str, str]] = []
    final = {id(e) for e in events.final_decisions(evs)}  # one per attempt
    for i, e in enumerate(evs):
        if id(e) not in final or e.get("reason") == "finished":
            continue
        if e.get("reason") == "budget":  # a start refused (node/requeue.py: check_start)
            out.append((f"start refused (job {e.get('job_id')}): {e.get('note')}", ""))
            continue
        sig = [float(s["signal_time"]) for s in evs if s.get("event") == "signal"
               and s.get("job_id") == e.get("job_id") and s.get("restart") == e.get("restart")
               and isinstance(s.get("signal_time"), (int, float))]
        t0 = min(sig, default=e.get("signal_time") or e.get("time"))
        nxt = next((n for n in evs[i + 1:] if n.get("event") == "start"), None)
        back = (f"resumed step {nxt.get('resumed_step') or 0} after {nxt['time'] - t0:.0f} s"
                if nxt and isinstance(t0, (int, float)) and "time" in nxt else "not resumed")
        how = came_back(e, evs[i + 1:]) + (f" -> job {e['next_job_id']}" if e.get("next_job_id") else "")
        lost = e.get("steps_lost")
        who = ""
        if "failed_how" in e:  # who died where; how only for a death by a signal (`last event`
            # already gives an exception, in one line)
            rank, host, died = e.get("failed_rank"), e.get("failed_host"), e.get("failed_how")
            who = crashes.Culprit(rank if isinstance(rank, int) else None, host if isinstance(host, str) else None,
                                  died if e.get("host_fault") is True and isinstance(died, str) else "",
                                  False).describe() + ", "
        out.append((f"{e.get('reason') or 'stopped'} at step {e.get('step')} (job {e.get('job_id')}), {who}"
                    f"steps lost {'?' if lost is None else lost}, {how}, {back}",
                    phases.describe(phases.recovery(evs, i))))
    return out


_BY = {"supervisor": "restarted in place by the local supervisor", budget.IN_PLACE: "restarted inside the allocation"}


def came_back(stop: dict[str, Any], later: list[dict[str, Any]]) -> str:
    """How the run came back after `stop` ("not requeued": it did not): the decision's requeued_by,
    else the local supervisor's `local_requeue` record before the next start (its ranks' stop
    records leave the requeue to it). `later`: the records after the stop."""
    by = stop.get("requeued_by")
    if by is None:
        for e in later:
            if e.get("event") == "start":
                break
            if e.get("event") == "local_requeue" and str(e.get("job_id")) == str(stop.get("job_id")):
                by = "requeued by the local supervisor"
    return _BY.get(str(by), str(by)) if by else "requeued" if stop.get("requeued") else "not requeued"


def cmd_plot(args: argparse.Namespace) -> int:
    for run in args.runs:
        rundir.require_run_dir(run)
    try:
        import matplotlib  # noqa: F401  (optional extra)
    except ImportError:
        raise DDPJobError("matplotlib is not installed, and `ddpjob plot` needs it",
                          "pip install 'ddpjob[plot]' (or pip install matplotlib)") from None
    from ddpjob.launch import runs

    infos = runs.infos([(Path(r), "") for r in args.runs])
    record = plot_runs(args.runs, args.output, goodput.of_runs(infos))
    n = sum(len(m) for m in record.markers.values())
    console.info(f"wrote {record.output}: {len(args.runs)} run(s), {n} restart marker(s)")
    for run, marks in record.markers.items():
        for step, label in marks:
            console.info(f"  {run}: step {step}  {label}")
    for run in args.runs:  # the same ledger as `ddpjob status`, with the recovery's phases
        for line, took in ledger(events.read(run)):
            console.info(f"  {Path(run).name}: {line}" + (f"; recovery: {took}" if took else ""))
    return 0
