"""What a run dir says it trained, read back for the bit-exact comparisons of every tier: the
events and train records (replays included), the stops as decided (decisions: every tier's one way
to tell the job's decision from a rank's own crash record, ddpjob.ledger.events' rule), and the
sample log checked against "every sample once per epoch". Shared by every tier.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, TypeVar

from ddpjob import fileio
from ddpjob.ledger import events as ledger

Record = TypeVar("Record", bound=Mapping[str, Any])


def lines(path: Path) -> list[dict[str, Any]]:
    """JSON lines; a torn last line (the writer was killed) is skipped."""
    return fileio.read_jsonl(path)


def events(run: Path, kind: str | None = None) -> list[dict[str, Any]]:
    return [e for e in lines(run / "events.jsonl") if kind is None or e["event"] == kind]


def decisions(records: Iterable[Record]) -> list[Record]:
    """The attempts' stops as decided for the whole job (rank 0, the batch shell, the local
    supervisor, the next start), in the order written: ledger.is_decision, never a rank's own
    crash record. Every attempt's, the replaced ones too (ledger.final_decisions keeps the last)."""
    return [e for e in records if ledger.is_decision(e)]


def torch_teardown(decision: Record) -> bool:
    """A crash decision of an attempt whose every rank's program aborted in torch's teardown after
    its code ended (rank/command_end.unvouched_teardown): torch 2.x's gloo does so by itself now
    and then (a 2-rank [train] command: both ranks in about 1 run in 25), so a test that counts the
    crashes it caused leaves these out, and asserts the run still ends as it should."""
    return decision.get("reason") == "crash" and "in torch's teardown" in str(decision.get("failed_how", ""))


def stops(records: Iterable[Record]) -> list[Record]:
    """decisions() of the stops and crashes alone: not the "finished" record a completed run ends
    with (the API's job.finish(), a [train] command whose every rank exited 0)."""
    return [e for e in decisions(records) if e.get("reason") != "finished"]


def rank_crashes(records: Iterable[Record], rank: int | None = None) -> list[Record]:
    """The ranks' own records of the error that ended them (ledger.is_rank_crash), `rank`'s if given."""
    return [e for e in records if ledger.is_rank_crash(e) and (rank is None or e.get("rank") == rank)]


def train_records(run: Path) -> list[dict[str, Any]]:
    """Every train line of metrics.jsonl, replayed steps included, in order."""
    return [r for r in lines(run / "metrics.jsonl") if r.get("kind") == "train"]


def sample_log(run: Path) -> dict[int, dict[str, Any]]:
    """step -> {"epoch", "restart", "world_size", "ids": the global batch's sample ids}, from the
    newest incarnation that trained the step (a step trained again after a kill, or after an
    elastic resume by fewer ranks, replaces what the older incarnation logged, all ranks of it)."""
    per_step: dict[int, dict[tuple[int, int], dict[str, Any]]] = defaultdict(dict)
    for path in sorted((run / "samples").glob("rank-*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line torn by a kill
            per_step[rec["step"]][(rec["restart"], rec["rank"])] = rec
    out = {}
    for step, recs in per_step.items():
        newest = max(restart for restart, _ in recs)
        ranks = [r for (restart, _), r in sorted(recs.items()) if restart == newest]
        world = ranks[0]["world_size"]
        assert [r["rank"] for r in ranks] == list(range(world)), (step, newest, sorted(recs))
        out[step] = {"epoch": ranks[0]["epoch"], "restart": newest, "world_size": world,
                     "ids": [i for r in ranks for i in r["ids"]]}
    return out


def assert_each_sample_once_per_epoch(log: dict[int, dict[str, Any]], steps: int, *, samples: int,
                                      global_batch: int) -> None:
    """Every step trained one global batch; every whole epoch used each sample exactly once."""
    per_epoch = samples // global_batch
    assert sorted(log) == list(range(1, steps + 1))
    epochs: dict[int, list[int]] = defaultdict(list)
    for step, rec in sorted(log.items()):
        assert len(rec["ids"]) == global_batch, (step, len(rec["ids"]))
        assert rec["epoch"] == (step - 1) // per_epoch
        epochs[rec["epoch"]] += rec["ids"]
    for epoch, ids in epochs.items():
        if len(ids) == samples:  # a whole epoch: every sample once
            assert sorted(ids) == list(range(samples)), f"epoch {epoch}: repeats or gaps"
        else:  # the last, partial epoch: no sample twice
            assert len(set(ids)) == len(ids), f"epoch {epoch}: a sample used twice"
