"""torchrun's restart rounds get ddpjob's verdicts (ledger/policy.py), as SLURM's in-place
restarts and the local supervisor's do.

`torchrun --max-restarts N` starts every worker again when one fails and tells nobody why, so
without this a torchrun run's crash never met the policy: a user's bug was run again N times,
max_failures and the crash-loop rule did not count torchrun's restarts, and `status` showed an
attempt without an end. Rank 0 of the next round, at its start (startcheck.check_start), finds the
round before ended with no stop on record, gathers the same facts the batch shell and the
supervisor do (the ranks' own crash records: a user's exception, ddpjob's own; else a rank that
ended without a word, a kill: the infrastructure's), records the decision and carries it out:
torchrun has restarted already, so a retry is this round going on, and an end is this round and
every later round of the same torchrun refusing to train.

Only torchrun outside SLURM (its agent is the ranks' parent, env.agent_pid): inside an allocation
the batch shell and sacct decide (requeue.after_crash, startcheck.record_unseen).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

from ddpjob.config import JobConfig
from ddpjob.ledger import attempts, budget, crashes, events, policy, recovery
from ddpjob.node.cluster import ClusterEnv
from ddpjob.store import memsnap

SOURCE = "torchrun"  # the decision's source: torchrun's agent restarted the ranks (requeued_by: budget.TORCHRUN)


def decide_unseen(cfg: JobConfig, env: ClusterEnv, run_dir: Path) -> str | None:
    """Rank 0 at a restart round of torchrun (TORCHELASTIC_RESTART_COUNT > 0): decide each round
    of this agent before it that ended without a stop on record. Returns why this round must not
    train (a verdict that ends the run, now or in an earlier round of the same agent), else None.
    A new torchrun of the run (round 0: the user fixed the bug and started it again) decides
    nothing and is refused nothing: an earlier agent's verdicts were its own."""
    if env.agent_pid is None or not env.job_id or env.restart_count < 1:
        return None
    job = str(env.job_id)
    evs = events.read(run_dir)
    ended = [e for e in events.final_decisions(evs) if e.get("agent") == env.agent_pid
             and e.get("source") == SOURCE and e.get("action") == policy.END]
    if ended:
        return f"round {ended[-1].get('restart')} of this torchrun was decided: {ended[-1].get('line')}"
    # this agent's rounds: at most as many as it started before this one (a round whose ranks
    # died before any record left no attempt)
    mine = [a for a in attempts.of_run(evs) if a.job_id == job][-env.restart_count:]
    why = None
    for attempt in mine:
        if attempt.stop is not None:
            continue
        verdict = _decide(cfg, env, run_dir, attempt.number)
        if verdict.action == policy.END:
            why = f"round {attempt.number} of this torchrun was decided: {verdict.line}"
    return why


def _decide(cfg: JobConfig, env: ClusterEnv, run_dir: Path, restart: int) -> policy.Verdict:
    """The crash verdict of attempt `restart` (a round torchrun ended and started again),
    recorded as its decision and said in rank 0's log."""
    evs = events.read(run_dir)
    saved = memsnap.retry_point(cfg, run_dir, str(env.job_id))  # the round's snapshots survive it on this host
    crash, _ = recovery.settle(
        cfg, run_dir, evs, env.job_id, restart, _silent(evs, env, restart),
        lambda c: {"source": SOURCE, "agent": env.agent_pid,
                   **recovery.carried_here(c.verdict, budget.TORCHRUN, "torchrun started the ranks again")},
        lambda line: print(line, file=sys.stderr, flush=True), here=True, saved=saved)
    return crash.verdict


def _silent(evs: list[dict[str, Any]], env: ClusterEnv, restart: int) -> crashes.Culprit | None:
    """The rank of the round that ended without a word, when every rank that said something
    only saw a peer go (torchrun names no culprit; srun would): the kill of that rank, or its
    crash outside Python, is the round's cause, not the survivors' failed all-reduce. None: a
    rank raised an error of its own (the verdict's class is its), or every rank spoke."""
    records = [e for e in evs if events.is_rank_crash(e) and events.of_attempt(e, env.job_id, restart)]
    if any(e.get("error_class") != policy.INFRASTRUCTURE for e in records):
        return None
    spoke = {e.get("rank") for e in records} | {
        e.get("rank") for e in evs if e.get("event") == "rank_end" and events.of_attempt(e, env.job_id, restart)}
    silent = [r for r in range(env.world_size) if r not in spoke]
    if not silent or len(silent) == env.world_size:
        return None
    return crashes.Culprit(silent[0], env.hostname if env.num_nodes == 1 else None,
                           "ended without a word (killed, or a crash outside Python)", False)
