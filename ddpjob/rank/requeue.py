"""SLURM's side of a stop's and a crash's recovery: rank 0 after every rank stopped with a
checkpoint (Job.steps, job.py), and the batch script (or NodeTask) after the ranks crashed
(`python -m ddpjob.rank.requeue`). They gather what only SLURM tells (is the job being preempted,
did a node fail, which task srun saw die, which hosts are left), ask ledger/recovery.py (the one
procedure, policy.decide's verdict) and carry the verdict out.

SLURM requeues by itself only a job that outlives GraceTime after a preemption. So ddpjob brings
the job back itself after: the time-limit warning / deadline watch; a SIGTERM while SLURM is
preempting the job (we stopped within GraceTime, 22.05 would end it FAILED), not a plain scancel;
a crash while [slurm] max_failures lasts. "Bringing back" is `scontrol requeue`, or, where that
is refused or missing, one successor job (sbatch --dependency=afterany) of the same run dir.
Budgets: max_requeues for preemptions and time limits, max_failures for crashes and node
failures, both counted from the run dir's events (SLURM_RESTART_COUNT restarts at 0 in a
successor). An attempt that ended where no ddpjob code ran (a failed node) is found at the
next start and recorded then from sacct (startcheck.record_unseen, with the start's budget check).
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

from ddpjob import console, exitcodes, fileio, rundir, slurm
from ddpjob.ledger import attempts, budget, crashes, events, policy, recovery, requests, stragglers
from ddpjob.config import JobConfig
from ddpjob.node import hostlist, preemption
from ddpjob.node.cluster import ClusterEnv
from ddpjob.store import memsnap

CHECK_TRIES, CHECK_PAUSE_S = 3, 2.0
sleep: Callable[[float], None] = time.sleep  # tests skip the pauses


def bring_back(cfg: JobConfig, env: ClusterEnv, run_dir: Path) -> dict[str, Any]:
    """`scontrol requeue`, else a successor job; the fields for the stop event. A sweep point
    (an array task, job id ARRAYID_TASK) is brought back alone: scontrol requeues that task, and
    its successor is a one-task array of the same index (slurm.submit_successor), never the
    whole sweep its job.sbatch holds: a user who requeues one point expects that point back,
    and the other points, running or done, left as they are (not run again)."""
    job_id = str(env.job_id)
    res = slurm.requeue(job_id)
    if res.ok:
        return {"requeued": True, "requeued_by": "scontrol", "note": f"requeued job {job_id}"}
    if requests.cancelled(events.read(run_dir), job_id):
        return {"requeued": False, "note": f"{res.error}; the run was cancelled: no successor"}
    script = run_dir / "job.sbatch"
    new = (slurm.submit_successor(job_id, script, cwd=run_dir) if script.is_file()
           else slurm.Failed(f"{script} is missing"))
    if isinstance(new, slurm.Failed):
        return {"requeued": False, "note": f"{res.error}; no successor either: {new.why}"}
    rundir.follow_successor(run_dir, job_id, new)
    return {"requeued": True, "requeued_by": "successor", "next_job_id": new,
            "note": f"{res.error}; submitted successor job {new}"}


def _preempting(job_id: str) -> bool | slurm.Failed:
    answer: bool | slurm.Failed = slurm.Failed("not asked")
    for attempt in range(CHECK_TRIES):
        answer = slurm.being_preempted(job_id)
        if not isinstance(answer, slurm.Failed):
            return answer
        if attempt + 1 < CHECK_TRIES:
            sleep(CHECK_PAUSE_S)
    return answer


def _requeued_by_slurm(env: ClusterEnv) -> bool:
    """Whether the controller already requeued this job by itself (its Restarts went up past
    this attempt's: a node failure or someone's `scontrol requeue`; a scancel never does). A
    failed query reads as "no": the caller then records what it saw, as before."""
    info = slurm.show_job(str(env.job_id))
    restarts = "" if isinstance(info, slurm.Failed) else info.get("Restarts", "")
    return restarts.isdigit() and int(restarts) > env.restart_count


def _node_failed(env: ClusterEnv, signal_time: float | None) -> bool:
    """Whether SLURM ended this attempt for a failed node. Only when the controller already
    requeued the job by itself (its Restarts went up: a node failure or someone's `scontrol
    requeue`; a scancel never does) is sacct asked how the attempt ended; slurmdbd may lag a
    moment behind the controller, so it is asked a few times."""
    if not _requeued_by_slurm(env):
        return False
    t = time.time() if signal_time is None else signal_time
    for attempt in range(CHECK_TRIES):
        runs = slurm.incarnations(str(env.job_id))
        if not isinstance(runs, slurm.Failed):
            mine = [r for r in runs if r.start is not None and r.start <= t + 1]
            if mine and mine[-1].state not in ("RUNNING", "COMPLETING", "PENDING"):
                return mine[-1].state in ("NODE_FAIL", "BOOT_FAIL")
        if attempt + 1 < CHECK_TRIES:
            sleep(CHECK_PAUSE_S)
    return False


def after_stop(cfg: JobConfig, env: ClusterEnv, run_dir: Path, code: int, step: int | None, *,
               restart: int = 0, signal_step: int | None = None,
               signal_time: float | None = None, lag: int = 0,
               times: dict[str, float] | None = None, program: str | None = None,
               steps_lost: int | None = None, detail: dict[str, Any] | None = None) -> bool | None:
    """Rank 0: record the stop (the ledger: reason, steps_lost) and, where nobody else will,
    bring the job back. Returns whether it did (None: it was not asked to). `program`: a [train]
    command's, what it did after the stop signal (rank/command_end.py): it saved only where it
    exited by itself, and no checkpoint of ddpjob's was written. `detail`: a straggler's stop's
    (rank/stragglerstop.py: the host to leave out, the line)."""
    under_slurm = env.source in ("slurm", "torchrun") and bool(env.job_id)
    reason = {preemption.PREEMPTED: "preemption", preemption.NONE: "signal",
              preemption.STRAGGLER: stragglers.REASON}.get(code, "time_limit")
    if code == preemption.REQUEUE and requests.stop_requested(run_dir, env.job_id):
        reason = policy.USER_STOP  # `ddpjob stop` sent the checkpoint signal: the policy ends the run
    fields: dict[str, Any] = {"requeued": None}
    cancelled = requests.cancelled(events.read(run_dir), env.job_id)
    if code == preemption.PREEMPTED and cancelled:
        reason = "signal"  # `ddpjob cancel` (recorded before its signal): never a preemption
    elif code == preemption.PREEMPTED and under_slurm:
        preempting = _preempting(str(env.job_id))
        if isinstance(preempting, slurm.Failed):
            # SIGTERM came and scontrol could not say why, even after retries. Reading that as
            # "not preempted" would end a preempted job FAILED over a controller hiccup, so it
            # counts as a preemption. `ddpjob cancel` records its cancel first, which the policy
            # reads (Facts.cancelled: no requeue, no successor). A raw scancel during a
            # controller outage can come back (SLURM 22.05 takes `scontrol requeue` of a job
            # still COMPLETING after its scancel): the lesser harm.
            fields["note"] = f"preemption check failed ({preempting.why}): treated as preemption"
        elif not preempting:
            reason = "signal"  # a scancel, or a job requeued already: the policy's verdict is the end
            if _node_failed(env, signal_time):
                # A node of the job went down: SLURM ended this attempt NODE_FAIL and requeued
                # the job by itself; the ranks that lived got SIGTERM and checkpointed. SLURM
                # decided: nothing is left to decide or carry out.
                reason = "node_failure"
                fields.update(requeued=True, requeued_by="slurm",
                              note="a node failed: SLURM ended this attempt (NODE_FAIL) and requeued the job")
    # Rank 0 decides under SLURM (and torchrun inside it) and under the local supervisor, which
    # carries the verdict out (launch/local.Supervisor.after_stop); a cancel's end is every
    # decider's to say
    if under_slurm and reason == stragglers.REASON:
        fields.update(_leave_out(cfg, env, run_dir, step, detail or {}))
    elif (under_slurm or cancelled or env.source == "local") and reason != "node_failure":
        stop = recovery.decide_stop(cfg, run_dir, events.read(run_dir), env.job_id, reason)
        fields.update(carry_out(cfg, env, run_dir, stop.verdict, fields.get("note")))
    # steps run after the signal beyond the one in flight and the `lag` an overlapped vote adds
    lost = steps_lost if signal_step is None or step is None else max(0, step - signal_step - 1 - lag)
    events.decision(run_dir, reason, job_id=env.job_id, restart=restart, step=step,
                    incarnation=env.restart_count, steps_lost=lost, signal_time=signal_time, **(times or {}),
                    **({"program": program} if program else {}), **fields)
    note = fields.get("note")
    if cfg.train.command:  # the program's own checkpoint, if it wrote one: command_end.stop_said
        said = f"stopped ({reason}" + ("" if step is None else f"; the program had logged step {step}") + ")"
    else:
        said = f"stopped at step {step} ({reason}); checkpoint written" if step is not None else f"stopped ({reason})"
    console.print0(f"ddpjob: {said}" + (f"; {note}" if note else ""))
    return fields["requeued"]


def _leave_out(cfg: JobConfig, env: ClusterEnv, run_dir: Path, step: int | None,
               detail: dict[str, Any]) -> dict[str, Any]:
    """A straggler's stop decided and carried out: in place, the batch shell's restart loop runs
    the ranks again without its host (restart_layout reads it from this record); requeued, SLURM
    leaves it out of the next start (ExcNodeList of the pending job)."""
    host = str(detail.get("host", ""))
    stop = recovery.decide_stop(cfg, run_dir, events.read(run_dir), env.job_id, stragglers.REASON,
                                what=str(detail.get("line", "a straggler")), leave_out=host,
                                here=cfg.slurm.on_straggler == "exclude", resume_at=step)
    out: dict[str, Any] = {**carry_out(cfg, env, run_dir, stop.verdict), "excluded_host": host, "line": stop.verdict.line,
           **{k: detail[k] for k in ("straggler_rank", "cause", "srun_attempt") if k in detail}}
    if stop.verdict.action == policy.REQUEUE:  # bring_back's note says how; the verdict says why
        out["note"] = f"{stop.verdict.line}: {out['note']}"
    if stop.verdict.action == policy.REQUEUE and out.get("requeued"):
        job = str(out.get("next_job_id") or env.job_id)
        hosts = sorted({host, *stragglers.excluded(events.read(run_dir), action=policy.REQUEUE)})
        res = slurm.exclude_nodes(job, hosts)
        said = f"job {job} excludes {','.join(hosts)}" if res.ok else f"{res.error}: {host} may be given again"
        out["note"] = f"{out['note']}; {said}"
    return out


def carry_out(cfg: JobConfig, env: ClusterEnv, run_dir: Path, verdict: policy.Verdict,
              prefix: str | None = None) -> dict[str, Any]:
    """The decision's fields for its stop record, the verdict carried out: a requeue is
    `scontrol requeue` or a successor job (bring_back); a restart here is the batch shell's to
    run (this process answers RESTART); under the local supervisor every retry is its restart
    (launch/local.Supervisor.after_stop reads this record); the end needs nothing."""
    if env.source == "local":
        return recovery.carried_here(verdict, budget.SUPERVISOR, prefix)
    if verdict.action != policy.REQUEUE:
        return recovery.carried_here(verdict, budget.IN_PLACE, prefix)
    out = bring_back(cfg, env, run_dir)
    note = f"{verdict.line}: {out['note']}" if verdict.crash is not None else out["note"]
    return {**out, "note": "; ".join(x for x in (prefix, note) if x), **verdict.fields()}


def after_crash(cfg: JobConfig, env: ClusterEnv, run_dir: Path, status: int, *,
                in_place: bool = False) -> bool | None:
    """The ranks ended with `status` (not 0, not 3): a rank raised or was killed. The policy's
    verdict (ledger/policy.py) is recorded and carried out; returns whether the job was brought
    back. `in_place` (the batch script, which still holds the allocation): a retry runs the ranks
    again in it (a crash then costs seconds, not a trip through the queue); else the job is
    requeued (submitit's NodeTask of a job an older ddpjob submitted is itself one of the ranks)."""
    if rundir.completed(run_dir) is not None or not env.job_id:
        return None
    evs = events.read(run_dir)
    restart = attempts.current(evs, env.job_id)
    # this start of the job (SLURM's restart count), decided already by another than a restart here
    mine = [e for e in evs if events.is_decision(e) and str(e.get("job_id")) == str(env.job_id)
            and e.get("incarnation") == env.restart_count]
    srun = crashes.from_srun(_attempt_log(run_dir, str(env.job_id))) if in_place else None
    if mine and _step_ended_by_srun(mine[-1], srun) and isinstance(mine[-1].get("restart"), int):
        restart = mine[-1]["restart"]  # the crash ends the attempt rank 0's stop record names
    elif mine and mine[-1].get("requeued_by") != budget.IN_PLACE:
        # Rank 0 stopped with a checkpoint and decided already: srun's status is not 3 only
        # because --kill-on-bad-exit ended rank 0 after the others exited 3 (and SLURM does not
        # always signal the batch shell on a preemption).
        return None
    if _requeued_by_slurm(env):
        # SLURM ended this attempt itself (a node failed) and requeued the job: srun returned
        # while rank 0 may still be writing its stop (node_failure) - recording a crash now
        # would race it. If rank 0 died too, the next start records the stop from sacct.
        print(f"ddpjob: job {env.job_id} was requeued by SLURM (status {status}); "
              "the stop is rank 0's or the next start's to record", flush=True)
        return None
    culprit = crashes.with_rank_error(srun, evs, env.job_id, restart)
    # on_node_loss = "continue" (sbatch --no-kill): a failed node left the allocation, the job did not end
    gone = {h for e in evs if events.is_decision(e) and str(e.get("job_id")) == str(env.job_id)
            and isinstance(e.get("lost_hosts"), list) for h in e["lost_hosts"]}
    lost = [h for h in env.hosts if h not in allocation_now(cfg, env) and h not in gone] if in_place else []
    with _term_held():
        # in place the job's snapshots count too (the restart resumes from them; a spare's new
        # ranks get theirs from the survivors, store/peers.py): the newest all folders left hold
        saved = memsnap.retry_point(cfg, run_dir, str(env.job_id) if in_place else None)
        why = (f"node(s) {','.join(lost)} left allocation {env.job_id}" if lost
               else f"ranks exited with status {status}")
        _, how = recovery.settle(
            cfg, run_dir, evs, env.job_id, restart, culprit,
            lambda crash: {"incarnation": env.restart_count, "status": status,
                           **carry_out(cfg, env, run_dir, crash.verdict, why)},
            lambda line: print(line, file=sys.stderr, flush=True), here=in_place, saved=saved,
            hosts_left=not in_place or restart_layout(run_dir, env, cfg, culprit) is not None,
            lost_hosts=lost, exclude_after=cfg.slurm.exclude_after if in_place else 0)
    return how["requeued"]


def _step_ended_by_srun(decision: dict[str, Any], srun: crashes.Culprit | None) -> bool:
    """Rank 0's stop that decided nothing (SIGTERM, "not being preempted") while the batch shell
    got no signal (after_crash runs in place only then), and srun names a task that died another
    way: the SIGTERM was srun ending the step after that task failed (--kill-on-bad-exit), not a
    scancel, so that task's crash is the one to decide. This happens when the failed rank left no
    crash record for rank 0 to see (crashes.peer_crash): a plain command's `ddpjob run` killed
    along with or instead of the program. A `scancel --signal=TERM` of the steps leaves only
    "Terminated" tasks: the stop stands."""
    return decision.get("reason") == "signal" and decision.get("requeued") is None and srun is not None \
        and not crashes.terminated(srun.how)


# The batch script's line before each srun (templates/sbatch.sh.tmpl): what srun wrote after
# it is this attempt's.
ATTEMPT_MARK = "ddpjob: attempt "


def _attempt_log(run_dir: Path, job_id: str) -> str:
    """The batch log from this attempt's srun on (its last 64 KiB): srun's lines name the task
    that failed and its host. The template's batch-ID.out, else submitit's ID_0_log.err (its
    batch shell's stderr, which srun's own lines go to). '' where neither can be read (a
    custom --output, a sweep's shared log folder)."""
    for name in (f"batch-{job_id}.out", f"{job_id}_0_log.err"):
        try:
            text = fileio.read_bounded(run_dir / rundir.LOGS / name, 1 << 16, tail=True)
        except (OSError, fileio.RecordError):
            continue
        return text[text.rfind(ATTEMPT_MARK):] if ATTEMPT_MARK in text else text
    return ""


def allocation_now(cfg: JobConfig, env: ClusterEnv) -> tuple[str, ...]:
    """The allocation's hosts now. With slurm.on_node_loss = "continue" (sbatch --no-kill) a
    failed node leaves it and the job goes on: `scontrol show job`'s NodeList says which are
    left. Otherwise (or when the controller does not answer) the job's nodelist."""
    if cfg.slurm.on_node_loss != "continue" or not env.job_id:
        return env.hosts
    info = slurm.show_job(str(env.job_id))
    nodes = "" if isinstance(info, slurm.Failed) else info.get("NodeList", "")
    try:
        return tuple(hostlist.parse_hostlist(nodes)) if nodes and nodes != "(null)" else env.hosts
    except ValueError:
        return env.hosts


def restart_layout(run_dir: Path, env: ClusterEnv, cfg: JobConfig, pending: crashes.Culprit | None = None,
                   straggler: str | None = None) -> tuple[int, list[str]] | None:
    """(nodes, excluded hosts) for the next srun inside the allocation: every node of it but the
    hosts the run's ledger quarantines (slurm.exclude_after host failures) or left out for
    straggling (slurm.on_straggler = "exclude"; `straggler`: one about to be), at most
    slurm.nodes of them when on_node_loss = "continue" (a spare takes a lost node's place; with
    none left the world is smaller). None: no node is left to run on. `pending`: the culprit of
    a crash being decided, not on record yet, counted too."""
    evs = events.read(run_dir)
    if pending is not None:
        evs.append({"event": "stop", "reason": "crash", "job_id": env.job_id, **pending.fields()})
    hosts, chain = allocation_now(cfg, env), budget.job_chain(evs, env.job_id)
    bad = {*crashes.excluded(evs, chain, cfg.slurm.exclude_after), *stragglers.excluded(evs, chain),
           *([straggler] if straggler else [])}
    out = sorted(h for h in bad if h in hosts)
    nodes = (len(hosts) or env.num_nodes) - len(out)
    if cfg.slurm.on_node_loss == "continue":
        nodes = min(nodes, cfg.slurm.nodes)
    return (nodes, out) if nodes > 0 and cfg.slurm.tasks_per_node > 0 else None


@contextlib.contextmanager
def _term_held() -> Iterator[None]:
    """SIGTERM waits until the stop is recorded. `scontrol requeue` of our own job ends the
    batch step, this process included (SIGTERM, SIGKILL after KillWait): on a busy node the
    SIGTERM came before the record was written, and the crash went unrecorded, so its retry
    was not counted against max_failures (seen in CI). A flag-only handler, not a blocked
    mask: a process-directed signal goes to any thread that does not block it (torch's), and
    Python runs its handlers in the main thread only. The signal is raised again after."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    came: list[int] = []
    old = signal.signal(signal.SIGTERM, lambda signum, _frame: came.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, old)
        if came:
            signal.raise_signal(signal.SIGTERM)


def main(argv: list[str]) -> int:
    """`python -m ddpjob.rank.requeue RUN_DIR STATUS`: the batch script after srun failed."""
    from ddpjob import jobfile

    run_dir, status = Path(argv[0]), int(argv[1])
    cfg, env = jobfile.read_run_config(run_dir), ClusterEnv.batch_shell()
    straggler = _straggler_stop(run_dir, env)
    if straggler is not None and straggler.get("requeued_by") != budget.IN_PLACE:
        return exitcodes.REQUEUE  # rank 0 decided otherwise (`ddpjob stop`, requeue = false): a plain stop
    # in place, a retry is never a requeue: brought back means "run the ranks again here"
    if straggler is None and not after_crash(cfg, env, run_dir, status, in_place=True):
        memsnap.remove_job(run_dir, env.job_id, memsnap.base_of(cfg))  # the job ends here: its snapshots with it
        return status
    layout = restart_layout(run_dir, env, cfg)
    # the verdict counted the hosts left (the crash just recorded included): a restart has one
    assert layout is not None, "a restart verdict without a node left"
    nodes, out = layout
    if out:
        slow = stragglers.excluded(events.read(run_dir), budget.job_chain(events.read(run_dir), env.job_id))
        why = "; ".join(x for x in (
            f"{','.join(h for h in out if h not in slow)} ({cfg.slurm.exclude_after} failures each)"
            if set(out) - set(slow) else "", f"{','.join(h for h in out if h in slow)} (a straggler)"
            if set(out) & set(slow) else "") if x)
        print(f"ddpjob: excluding {why}: the ranks restart on {nodes} node(s)", file=sys.stderr, flush=True)
    # stdout is the batch script's: "NODES [EXCLUDED,HOSTS]" (hostnames: crashes.HOST, no shell)
    print(nodes, ",".join(out), flush=True)
    return exitcodes.RESTART


def _straggler_stop(run_dir: Path, env: ClusterEnv) -> dict[str, Any] | None:
    """Rank 0's decision of a straggler's stop that ended the srun just run (the ranks exit
    RESTART after it; srun's status may be another where --kill-on-bad-exit ended a rank in its
    teardown), None where the newest decision of this start of the job is another, or names an
    earlier srun (DDPJOB_ATTEMPT: the srun after it crashed, a crash to decide)."""
    mine = [e for e in events.read(run_dir) if events.is_decision(e) and str(e.get("job_id")) == str(env.job_id)
            and e.get("incarnation") == env.restart_count]
    if not mine or mine[-1].get("reason") != stragglers.REASON:
        return None
    now = os.environ.get("DDPJOB_ATTEMPT", "")
    return mine[-1] if now.isdigit() and mine[-1].get("srun_attempt") == int(now) else None


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
