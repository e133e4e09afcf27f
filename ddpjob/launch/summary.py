"""A run's history in lines, from its run dir alone: `ddpjob status`'s summary (state, progress,
restarts, each stop's ledger line with its recovery, the speed watches' findings, the hosts) and
the ledger `ddpjob plot` prints under its figure. The curves are launch/plot.py's; both read the
run through history.load_history.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ddpjob import rundir
from ddpjob.launch.history import History, custom_metrics, load_history, number
from ddpjob.ledger import attempts, budget, crashes, events, phases, policy, stragglers
from ddpjob.ledger.programend import stop_said


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
            at = f" at step {e['step']}" if isinstance(e.get("step"), int) else ""
            return f"stopped ({reason}){at}{requeued}"
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
                said.append(f"{key} {number(r[key]):{fmt}}")
        if "img_s" in r:
            said.append(f"{number(r['img_s']):.0f} img/s")
        said += [f"{k} {number(r[k]):.4g}" for k in custom_metrics([h]) if k in r][:4]
        lines.append("progress    " + ", ".join(said))
    accs = [(a, r["step"]) for r in h.evals if not math.isnan(a := number(r.get("eval_acc")))]
    if accs:  # a loop that evaluates no accuracy gets no line (not "nan")
        best = max(accs, key=lambda a: a[0])
        lines.append(f"best acc    {best[0]:.4f} at step {best[1]} (last {accs[-1][0]:.4f} at step {accs[-1][1]})")
    if h.markers:  # as many as the run's attempts less one (ledger/attempts.py), as `ls` counts them
        restarts = max(len(attempts.of_run(h.events)) - 1, len(h.markers))
        # a program that logs no steps (a [train] command): where it resumed is its own to say
        lines.append(f"restarts    {restarts}: " + "; ".join(
            (f"resumed at step {m.step} after {m.reason}" if h.train else f"resumed after {m.reason}")
            for m in h.markers))
    else:
        lines.append("restarts    0")
    for line, took in ledger(h.events):
        lines.append(f"attempt     {line}")
        if took:
            lines.append(f"  recovery  {took}")
    for e in h.events:  # the speed watches' findings (rank/straggler.py, rank/slowdown.py)
        if e.get("event") == "straggler" and e.get("cause") == "host":
            lines.append(f"straggler   none: host {e.get('host')} oversubscribed (load {number(e.get('load')):.1f} on "
                         f"{e.get('cores')} cores), steps {e.get('first_step')}-{e.get('step')}: rank {e.get('rank')} "
                         f"waited {number(e.get('wait_ms')):.1f} ms a step more for a core (job {e.get('job_id')})")
        elif e.get("event") == "straggler":
            lines.append(f"straggler   rank {e.get('rank')} on {e.get('host')} ({e.get('cause')}), steps "
                         f"{e.get('first_step')}-{e.get('step')}: {number(e.get('busy_ms')):.1f} ms of work per "
                         f"step against {number(e.get('median_ms')):.1f} ms (job {e.get('job_id')})")
        elif events.is_decision(e) and e.get("reason") == stragglers.REASON and e.get("excluded_host"):
            # the action on_straggler took: the host left out, and the decision's line
            lines.append(f"straggler   {e.get('excluded_host')} left out at step {e.get('step')} "
                         f"(job {e.get('job_id')}): {e.get('note')}")
    for began, over in events.slowdowns(h.events):
        lines.append(f"slowdown    {began.get('line')}" + (f"; back at step {over.get('step')}" if over else "")
                     + f" (job {began.get('job_id')})")
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
        if e.get("reason") == "budget":  # a start refused (rank/startcheck.py: check_start)
            out.append((f"start refused (job {e.get('job_id')}): {e.get('note')}", ""))
            continue
        sig = [float(s["signal_time"]) for s in evs if s.get("event") == "signal"
               and s.get("job_id") == e.get("job_id") and s.get("restart") == e.get("restart")
               and isinstance(s.get("signal_time"), (int, float))]
        t0 = min(sig, default=e.get("signal_time") or e.get("time"))
        nxt = next((n for n in evs[i + 1:] if n.get("event") == "start"), None)
        resumed = nxt.get("resumed_step") if nxt else None
        back = ((f"resumed step {resumed} after" if isinstance(resumed, int) else
                 "resumed after" if e.get("step") is None else "resumed step 0 after")
                + f" {nxt['time'] - t0:.0f} s" if nxt and isinstance(t0, (int, float)) and "time" in nxt
                else "not resumed")
        how = came_back(e) + (f" -> job {e['next_job_id']}" if e.get("next_job_id") else "")
        lost = e.get("steps_lost")
        who = ""
        if "failed_how" in e:  # who died where; how only for a death by a signal (`last event`
            # already gives an exception, in one line)
            rank, host, died = e.get("failed_rank"), e.get("failed_host"), e.get("failed_how")
            who = crashes.Culprit(rank if isinstance(rank, int) else None, host if isinstance(host, str) else None,
                                  died if e.get("host_fault") is True and isinstance(died, str) else "",
                                  False).describe() + ", "
        # a [train] command's stop: what its program did about the signal (rank/command_end.py);
        # a step and the steps lost only where the program logged steps
        program = stop_said(e["program"]) + ", " if isinstance(e.get("program"), str) else ""
        step = "" if e.get("step") is None else f" at step {e['step']}"
        lost_said = "" if lost is None and e.get("step") is None else f"steps lost {'?' if lost is None else lost}, "
        out.append((f"{e.get('reason') or 'stopped'}{step} (job {e.get('job_id')}), {who}{program}"
                    f"{lost_said}{how}, {back}",
                    phases.describe(phases.recovery(evs, i))))
    return out


_BY = {budget.SUPERVISOR: "restarted in place by the local supervisor", budget.IN_PLACE: "restarted inside the allocation",
       budget.TORCHRUN: "restarted by torchrun"}


def came_back(stop: dict[str, Any]) -> str:
    """How the run came back after `stop` ("not requeued": it did not): the decision's requeued_by."""
    by = stop.get("requeued_by")
    if by == budget.SUPERVISOR and stop.get("reason") not in policy.FAILURES:
        return "requeued by the local supervisor"  # a stop for a requeue, not a crash
    return _BY.get(str(by), str(by)) if by else "requeued" if stop.get("requeued") else "not requeued"
