"""ddpjob/ledger/events.py and attempts.py: the record kinds, the one writer (a kind or field it
does not declare is refused), the readers on an old-format ledger (no schema version: written by
ddpjob before 0.4) and on records of a newer schema or unknown kind (kept, said once), and the
attempt numbering across a requeue, a restart in place and a new submission."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

import ddpjob
from ddpjob import fileio
from ddpjob.ledger import attempts, budget, events

REPO = Path(__file__).resolve().parents[2]
OLD = REPO / "tests" / "golden" / "p11-storm-events.jsonl"  # bench P11 --tiny, written by ddpjob 0.3


def test_the_writer_refuses_what_the_schema_does_not_declare(tmp_path: Path) -> None:
    rec = events.record(tmp_path, "checkpoint", job_id="7", restart=0, step=5, block_s=0.1, snapshot_s=0.0)
    assert rec["v"] == events.SCHEMA and rec["event"] == "checkpoint"
    with pytest.raises(ValueError, match="unknown event kind 'chekpoint'"):
        events.record(tmp_path, "chekpoint", job_id="7", restart=0)
    with pytest.raises(ValueError, match=re.escape("event 'checkpoint' has no field(s) ['stepp']")):
        events.record(tmp_path, "checkpoint", job_id="7", restart=0, stepp=5)
    events.record(tmp_path, "start", job_id="7", restart=0, accumulation=4)  # the loop's own info
    assert [e["event"] for e in events.read(tmp_path)] == ["checkpoint", "start"]


def test_a_stop_is_written_as_a_decision_or_as_a_ranks_crash(tmp_path: Path) -> None:
    """The two constructors of a stop record: the whole job's decision, a rank's own crash record."""
    decided = events.decision(tmp_path, "time_limit", job_id="7", restart=0, step=5, requeued=True)
    crashed = events.rank_crash(tmp_path, rank=1, host="n2", job_id="7", restart=1, error="boom", step=3)
    assert events.is_decision(decided) and not events.is_rank_crash(decided) and decided["reason"] == "time_limit"
    assert events.is_rank_crash(crashed) and crashed["reason"] == "crash" and crashed["rank"] == 1
    with pytest.raises(ValueError, match="a decision is the whole job's"):
        events.decision(tmp_path, "crash", job_id="7", restart=1, rank=1)
    assert events.read(tmp_path) == [decided, crashed]


def test_an_old_format_ledger_reads_as_schema_1() -> None:
    """A run dir written before records carried `v`: every reader takes it as it is."""
    evs = fileio.read_jsonl(OLD)
    assert evs and all("v" not in e for e in evs) and events.notes(evs) == ""
    found = attempts.of_run(evs)
    assert [a.number for a in found] == list(range(len(found))) and len(found) >= 3
    assert [a.ended_by for a in found][:2] == ["preemption", "preemption"]
    assert found[1].resumed_step == 433 and found[0].source == "slurm"
    assert attempts.next_number(evs) == len(found)
    requeues, failures = budget.used(evs, "254")
    assert requeues == sum(1 for a in found if a.stop is not None and a.stop.get("requeued") is True)
    assert failures == 0


def test_newer_and_unknown_records_are_kept_and_said_once(tmp_path: Path) -> None:
    lines = [{"event": "start", "job_id": "7", "restart": 0, "time": 1.0, "v": 1},
             {"event": "start", "job_id": "7", "restart": 1, "time": 2.0, "v": 9, "new_field": "x"},
             {"event": "teleport", "job_id": "7", "restart": 1, "time": 3.0, "v": 9}]
    (tmp_path / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in lines))
    evs = events.read(tmp_path)
    assert len(evs) == 3 and [a.number for a in attempts.of_run(evs)] == [0, 1]
    assert events.notes(evs) == ("2 record(s) of a newer schema, read as schema 1; "
                                 "unknown kind(s) teleport skipped")


def test_attempts_are_numbered_once_across_requeue_restart_in_place_and_resume(tmp_path: Path) -> None:
    """submit (job 7) -> requeue -> a crash restarted in place -> `ddpjob resume` (job 9): 0..3."""
    def start(job: str, n: int) -> None:
        events.record(tmp_path, "start", job_id=job, restart=n, source="slurm")

    assert attempts.current(events.read(tmp_path), "7") == 0
    start("7", 0)
    events.record(tmp_path, "stop", reason="preemption", job_id="7", restart=0, requeued=True, requeued_by="scontrol")
    assert attempts.current(events.read(tmp_path), "7") == 1  # the requeued job's next start
    start("7", 1)
    # a rank records its crash; the batch shell's decision finds the same attempt open
    events.record(tmp_path, "stop", reason="crash", rank=1, job_id="7", restart=1, error="x")
    assert attempts.current(events.read(tmp_path), "7") == 1
    events.record(tmp_path, "stop", reason="crash", job_id="7", restart=1, requeued=True,
                  requeued_by=budget.IN_PLACE)
    start("7", 2)
    events.record(tmp_path, "stop", reason="user_stop", job_id="7", restart=2, requeued=None)
    assert attempts.current(events.read(tmp_path), "9") == 3  # `ddpjob resume`: not 0 again
    start("9", 3)
    evs = events.read(tmp_path)
    assert [(a.number, a.job_id, a.ended_by) for a in attempts.of_run(evs)] == [
        (0, "7", "preemption"), (1, "7", "crash"), (2, "7", "user_stop"), (3, "9", None)]
    assert budget.used(evs, "7") == (1, 1) and budget.used(evs, "9") == (0, 0)
    # torchrun's agent starts its ranks again after a round it did not see end: a new attempt
    assert attempts.current(evs, "9") == 3 and attempts.current(evs, "9", starting=True) == 4


def test_no_module_tests_a_records_shape_by_hand() -> None:
    """What a stop record is (the decision, or a rank's own crash record) is said in one place."""
    package = Path(ddpjob.__file__).resolve().parent
    hand = re.compile(r"""["']rank["'] (not )?in e\b|get\(["']event["']\) (==|!=) ["']stop["'] (and|or) ["']rank""")
    offenders = [f"{p.relative_to(package.parent)}:{n}" for p in sorted(package.rglob("*.py"))
                 if p.name != "events.py" or p.parent.name != "ledger"
                 for n, line in enumerate(p.read_text().splitlines(), 1) if hand.search(line)]
    assert offenders == []
    # a stop record is written by its constructor (events.decision, events.rank_crash) only
    assert not [p for p in package.rglob("*.py") if re.search(r"""record\((?:[^,()]+, )?["']stop["']""", p.read_text())
                and not (p.name == "events.py" and p.parent.name == "ledger")]
    kinds = {m.group(1) for p in package.rglob("*.py") for m in re.finditer(
        r"""events\.record\([^,]+, ["']([a-z_]+)["']""", p.read_text())}
    assert kinds <= set(events.KINDS) and len(kinds) >= 10, kinds


def test_docs_events_md_lists_every_kind() -> None:
    text = (REPO / "docs" / "events.md").read_text()
    assert all(f"| `{k}` |" in text for k in events.KINDS), "regenerate the table in docs/events.md"
