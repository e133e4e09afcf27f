"""store/memsnap.py: one rank's in-memory snapshots (taken in the background, verified like a
checkpoint, KEEP of them, never in a tree someone else made or can change) and the job-wide
view the crash decision takes of them. The restart that resumes from them runs with real ranks
in tests/ranks/test_failure.py (local backend) and tests/cluster/test_requeue_slurm.py (sbatch)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ddpjob.store import memsnap, snapauto, snaproom


def snaps(base: Path, rank: int = 0, host: str = "n1", every: int = 2) -> memsnap.Snapshots:
    root = memsnap.rank_root(base / "run", "77", host, rank, base)
    return memsnap.Snapshots(root, every=every, config_hash="abc", base=base)


def files(value: float) -> dict:
    return {"model.pt": {"w": torch.full((4,), value)}, "rank-0.pt": {"seed": 1}}


def test_snapshots_are_taken_when_due_kept_two_deep_and_verified(tmp_path: Path) -> None:
    s = snaps(tmp_path)
    assert [st for st in range(7) if s.due(st)] == [2, 4, 6]
    for step in (2, 4, 6):
        assert s.take(step, files(step), {"step": step})
        s.close()  # the background write is done
    held = s.held()
    assert sorted(held) == [4, 6]  # KEEP = 2
    assert sorted(held[6]["files"]) == ["model.pt", "rank-0.pt"] and held[6]["step"] == 6
    info = s.info(6)
    assert torch.equal(s.store.load(info, "model.pt")["w"], torch.full((4,), 6.0))
    root = s.store.root
    assert all(p.stat().st_mode & 0o077 == 0 for p in [root, *root.parents] if tmp_path in p.parents)
    # a damaged file: that snapshot no longer counts
    (info.path / "model.pt").write_bytes(b"garbage")
    assert sorted(s.held()) == [4]
    # what a peer whose node lost its copy receives: the file as stored, if still whole
    entry = s.held()[4]["files"]["model.pt"]
    data = s.read_bytes(4, "model.pt", entry["size"])
    assert len(data) == entry["size"] and s.read_bytes(4, "model.pt", entry["size"] + 1) == b""
    assert s.read_bytes(4, "../model.pt", entry["size"]) == b"" and s.read_bytes(8, "model.pt", 1) == b""


def test_a_snapshot_a_killed_writer_left_half_done_goes_at_the_next_one(tmp_path: Path) -> None:
    """kill -9 during a snapshot's write leaves its staging folder; the restarted rank's first
    snapshot removes it (one process per rank folder: it is nobody's), so the folder never holds
    more than KEEP snapshots + the one being written."""
    first = snaps(tmp_path)
    assert first.take(2, files(2), {"step": 2})
    first.close()
    left = first.store.staging_dir(4, "pid999")  # the killed process's half-written snapshot
    (left / "model.pt").write_bytes(b"half")
    again = snaps(tmp_path)  # the restarted rank, moments later
    for step in (4, 6):
        assert again.take(step, files(step), {"step": step})
        again.close()
    names = sorted(p.name for p in again.store.root.iterdir())
    assert names == ["step-000000004", "step-000000006"], names


def test_a_resume_leaves_each_rank_only_the_snapshot_it_resumed_from(tmp_path: Path) -> None:
    """A rank killed between a snapshot's commit and its prune keeps KEEP + 1 (here 2, 4, 6 with
    a half-written 8): once the resume has read the one of step 4 (the newest every rank held),
    the others go, so the first new snapshot finds the room the node's fit counted on. A resume
    that took no snapshot leaves none."""
    killed = snaps(tmp_path)
    killed.store.keep_last = 3  # as if the kill came before the prune
    for step in (2, 4, 6):
        assert killed.take(step, files(step), {"step": step})
        killed.close()
    (killed.store.staging_dir(8, "pid999") / "model.pt").write_bytes(b"half")
    restarted = snaps(tmp_path)
    assert sorted(restarted.held()) == [2, 4, 6]
    restarted.resumed(4)
    assert sorted(p.name for p in restarted.store.root.iterdir()) == ["step-000000004"]
    assert torch.equal(restarted.store.load(restarted.info(4), "model.pt")["w"], torch.full((4,), 4.0))
    restarted.resumed(None)
    assert list(restarted.store.root.iterdir()) == []


def test_a_tree_someone_else_can_change_is_never_used(tmp_path: Path) -> None:
    top = memsnap.top(tmp_path)
    top.mkdir(mode=0o777)
    os.chmod(top, 0o777)
    s = snaps(tmp_path)
    assert s.why_not is not None and "others may change it" in s.why_not
    assert s.due(2)  # the schedule is every rank's (the peer copies' gather), the write is not
    assert not s.take(2, files(2), {"step": 2}) and s.held() == {}
    os.chmod(top, 0o700)
    link = memsnap.job_root(tmp_path / "run", "77", tmp_path)
    link.symlink_to(tmp_path)  # a link planted where the job's tree goes
    assert "is not a folder" in (memsnap.refuse(memsnap.rank_root(tmp_path / "run", "77", "n1", 0, tmp_path),
                                                tmp_path) or "")


def test_the_decision_sees_the_newest_step_every_rank_holds_and_the_job_end_removes_it(tmp_path: Path) -> None:
    ranks = [snaps(tmp_path, rank, host) for rank, host in ((0, "n1"), (1, "n1"), (2, "n2"))]
    for s in ranks:
        s.take(2, files(2), {"step": 2})
        s.close()
    ranks[0].take(4, files(4), {"step": 4})  # ranks 1 and 2 died before their step 4
    ranks[0].close()
    assert memsnap.newest_common(tmp_path / "run", "77", tmp_path) == 2
    assert memsnap.newest_common(tmp_path / "run", "78", tmp_path) is None  # another job
    memsnap.remove_job(tmp_path / "run", "77", tmp_path)
    assert not memsnap.job_root(tmp_path / "run", "77", tmp_path).exists()
    assert memsnap.top(tmp_path).is_dir()  # other jobs' trees live beside it


def test_auto_interval_keeps_a_snapshot_within_one_percent_of_the_steps_between_two() -> None:
    rule = snapauto.AutoRule()
    auto = snapauto.Auto(rule, start=0, step_s=[0.050, 0.048, 0.052], block_s=0.002, write_cpu_s=0.008)
    n, line = auto.interval()
    # 10 ms per snapshot against 50 ms steps: 20 steps hold it to 1%, 19 would not
    assert n == 20 and "every 20 steps" in line and "10.0 ms" in line and "50.0 ms" in line, line
    assert 0.010 / (n * 0.050) <= rule.goal < 0.010 / ((n - 1) * 0.050)
    cheap = snapauto.Auto(rule, start=0, step_s=[1.0], block_s=0.001, write_cpu_s=0.0)
    assert cheap.interval()[0] == 1  # never less than every step
    assert snapauto.Auto(rule, start=0, step_s=[1.0]).interval() == (
        0, "in-memory snapshots off: the probe snapshot could not be taken")


def test_auto_probes_once_then_snapshots_at_the_interval_rank_0_measured(tmp_path: Path) -> None:
    """snapshot_every = "auto": nothing but the probe until rank 0's verdict (once the probe's
    write is done), an interval from its real cost; the probe is the first step asked about from
    start + probe on (the loop does not ask at a checkpoint's step)."""
    root = memsnap.rank_root(tmp_path / "run", "77", "n1", 0, tmp_path)
    s = memsnap.Snapshots(root, every=None, config_hash="abc", base=tmp_path)
    assert s.auto is not None
    asked = list(range(101, 160))  # resumed at 100; a checkpoint at 120
    probes, decided_at = [], None
    for st in asked:
        s.observe(st, now=st * 0.05)  # 50 ms steps
        found = s.verdict() if decided_at is None else None
        if found is not None:
            decided_at = st
            s.every, line = found
            assert line.startswith(f"in-memory snapshots every {s.every} steps"), line
        if s.due(st, saved=st == 120):
            if s.every is None:
                probes.append(st)
            assert s.take(st, files(st), {"step": st})
            s.close()  # this test's steps are instants: let each write end before the next
    assert probes == [121] and decided_at == 131, (probes, decided_at)
    assert s.auto.block_s is not None and s.auto.block_s > 0 and s.auto.write_cpu_s is not None
    assert len(s.auto.step_s) == 131 - 102  # every step asked about but the first two
    taken = [i.step for i in s.store.list()]
    every = s.every
    assert every is not None and every > 0, every
    later = [st for st in asked if st >= 131 and st % every == 0 and st != 120]
    assert taken == sorted([121, *later], reverse=True)[:snaproom.KEEP], (taken, s.every)


class Running:
    """A background write that never ends; waiting for it would hang the loop."""

    def done(self) -> bool:
        return False

    def wait(self) -> None:
        raise AssertionError("the loop waited for the probe's write")


def test_auto_verdict_never_waits_for_the_probes_write_and_comes_within_a_bound(tmp_path: Path) -> None:
    """Rank 0's verdict is None while the probe's write runs (the vote carries 0, "not yet"),
    an interval as soon as it is done, and at most AutoRule.wait steps past the decide step an
    interval from the write's time so far: "auto" never stays undecided."""
    rule = snapauto.AutoRule(probe=3, decide=2, wait=4)
    root = memsnap.rank_root(tmp_path / "run", "77", "n1", 0, tmp_path)
    s = memsnap.Snapshots(root, every=None, config_hash="abc", base=tmp_path, rule=rule)
    verdicts: dict[int, tuple[int, str] | None] = {}
    for st in range(1, 14):
        s.observe(st, now=st * 0.05)
        verdicts[st] = s.verdict()
        if s.due(st):
            assert st == 3 and s.take(st, files(st), {"step": st})
            s.close()
            s._pending = Running()  # the probe's write, still running
    assert all(verdicts[st] is None for st in range(1, 9)), verdicts  # probe 3, decide 5, bound 5 + 4
    found = verdicts[9]
    assert found is not None
    every, line = found
    assert every >= 1 and "its write still running after" in line, line
    s._pending = None  # done after all: the verdict no longer waits for the bound
    done = s.verdict()
    assert done is not None and "still running" not in done[1]


def test_snapshot_every_auto_is_on_only_for_a_job_that_may_restart() -> None:
    from ddpjob import config

    base = config.JobConfig()  # may restart by default: slurm.max_failures = 20
    assert base.checkpoint.snapshot_every == "auto" and base.slurm.max_failures > 0
    never = config.JobConfig(slurm=config.SlurmConfig(max_failures=0))
    assert memsnap.interval(base) is None and memsnap.interval(never) == 0
    fixed = config.JobConfig(checkpoint=config.CheckpointConfig(snapshot_every=5))
    assert memsnap.interval(fixed) == 5


def test_each_ranks_rng_file_is_kept_by_a_rank_on_the_next_node() -> None:
    from ddpjob.store.peers import keepers

    assert keepers(["n1", "n1", "n2", "n2"]) == [2, 3, 0, 1]
    assert keepers(["n1", "n2", "n3"]) == [1, 2, 0]
    assert keepers(["n1", "n1", "n1", "n2"]) == [3, 3, 3, 0]  # uneven: the next node's ranks in turn
    assert keepers(["n1", "n1"]) == [None, None]  # one node: nothing survives its loss anyway


def test_a_restart_plans_the_newest_snapshot_every_rank_can_have_whole() -> None:
    """plan_restore over what each new rank's folder holds (step -> files): a rank without its
    own copy gets the replicas from the lowest rank holding them and its RNG file from the rank
    that kept it; a step at which some rank's RNG file is nowhere is passed over."""
    from ddpjob.store.peers import Restore, plan_restore

    state = ["model.pt", "optimizer.pt"]
    n1 = {6: [*state, "rank-0.pt", "rank-2.pt"], 8: [*state, "rank-0.pt"]}  # step 8: no peer copy yet
    n1b = {6: [*state, "rank-1.pt", "rank-3.pt"], 8: [*state, "rank-1.pt", "rank-3.pt"]}
    spare: dict[int, list[str]] = {}  # ranks 2 and 3 now run on a spare node: no folder
    needs = [[*state, f"rank-{r}.pt"] for r in range(4)]
    plan = plan_restore([n1, n1b, spare, spare], needs, durable=4)
    assert plan == Restore(6, [(2, "model.pt", 0), (2, "optimizer.pt", 0), (2, "rank-2.pt", 0),
                               (3, "model.pt", 0), (3, "optimizer.pt", 0), (3, "rank-3.pt", 1)])
    assert plan_restore([n1, n1b, spare, spare], needs, durable=6) is None  # the checkpoint is as new
    assert plan_restore([n1, n1b], needs[:2], durable=None) == Restore(8, [])  # the survivors alone
    assert plan_restore([{}, {}], needs[:2], durable=None) is None


# ------------------------------------------------------------------ fitting them to the node
def test_keep_two_one_or_none_by_the_room_and_the_memory_left() -> None:
    """need() = ranks x (kept + the one being written) x state; keep_for: the most that fit."""
    mib = 1 << 20
    assert snaproom.need(100 * mib, 4) == 1200 * mib and snaproom.need(100 * mib, 4, 1) == 800 * mib
    assert snaproom.need(100 * mib, 4, 0) == 0
    assert snaproom.keep_for(100 * mib, 4, room=1200 * mib, mem_left=None) == 2
    assert snaproom.keep_for(100 * mib, 4, room=1199 * mib, mem_left=None) == 1
    assert snaproom.keep_for(100 * mib, 4, room=None, mem_left=800 * mib) == 1
    assert snaproom.keep_for(100 * mib, 4, room=5000 * mib, mem_left=799 * mib) == 0
    assert snaproom.keep_for(100 * mib, 4, room=None, mem_left=None) == 2


def test_memory_left_reads_the_cgroup_and_its_limited_parents(tmp_path: Path) -> None:
    """cgroup v2 (memory.max / memory.current) and v1 (memory.limit_in_bytes / usage): the
    tightest level with a limit, less MEM_MARGIN of it; "max" or v1's huge number: no limit."""
    job = tmp_path / "slurm" / "job_7"
    step = job / "step_0"
    step.mkdir(parents=True)
    (step / "memory.max").write_text("max\n")
    (step / "memory.current").write_text("100\n")
    (job / "memory.max").write_text("1000000\n")
    (job / "memory.current").write_text("400000\n")
    left = snaproom.memory_left("0::/slurm/job_7/step_0\n", tmp_path)
    assert left == 1000000 - 400000 - int(1000000 * snaproom.MEM_MARGIN)
    assert snaproom.memory_left("0::/slurm\n", tmp_path) is None  # no limit on the way up
    v1 = tmp_path / "memory" / "job"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (v1 / "memory.usage_in_bytes").write_text("5\n")
    assert snaproom.memory_left("4:memory:/job\n3:cpu:/\n", tmp_path) is None
    (v1 / "memory.limit_in_bytes").write_text("2000\n")
    assert snaproom.memory_left("4:memory:/job\n", tmp_path) == 2000 - 5 - 100
    assert snaproom.memory_left("", tmp_path) is None


def test_a_node_short_of_room_keeps_one_snapshot_or_none_with_one_line(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """fit() at the first snapshot: the room measured at the start and the memory cgroup's
    headroom decide; the node's first rank says so in one line, the others keep quiet."""
    size = memsnap._nbytes(files(0))  # what take() counts: the tensors' bytes, 64 per plain value
    roomy = snaps(tmp_path / "a")
    roomy._room = snaproom.need(size, 1)
    assert roomy.take(2, files(2), {"step": 2}) and roomy.keep == 2
    roomy.close()
    assert capsys.readouterr().out == ""

    one = memsnap.Snapshots(memsnap.rank_root(tmp_path / "run", "77", "n1", 0, tmp_path), every=2,
                            config_hash="abc", base=tmp_path, host="n1", ranks=2,
                            memory=lambda: snaproom.need(size, 2, 1))
    for step in (2, 4, 6):
        assert one.take(step, files(step), {"step": step})
        one.close()
    assert one.keep == 1 and sorted(one.held()) == [6]
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith("ddpjob: warning: in-memory snapshots kept 1 deep instead of 2 on n1: 2 rank(s) x 3 x"), out
    assert "left under the job's memory limit" in out[0] and "free in" not in out[0]

    none = memsnap.Snapshots(memsnap.rank_root(tmp_path / "run", "78", "n1", 1, tmp_path), every=2,
                             config_hash="abc", base=tmp_path, host="n1", ranks=2, node_lead=False)
    none._room = size
    assert not none.take(2, files(2), {"step": 2}) and none.keep == 0
    assert not none.take(4, files(4), {"step": 4}) and none.held() == {}
    assert "off on n1" in str(none.why_not) and f"free in {tmp_path}" in str(none.why_not)
    assert capsys.readouterr().out == ""  # not the node's first rank


def test_a_folder_that_fills_up_mid_run_stops_the_snapshots_before_a_write_fails(
        tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first snapshot only the new one needs room (the older ones go once it is in); when
    even that is not free any more (another job filled the folder), they stop, in one line."""
    import shutil
    from collections import namedtuple

    s = snaps(tmp_path)
    size = memsnap._nbytes(files(0))
    assert s.take(2, files(2), {"step": 2})
    s.close()
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, size))  # exactly one more
    assert s.take(4, files(4), {"step": 4})
    s.close()
    monkeypatch.setattr(shutil, "disk_usage", lambda _p: usage(0, 0, size - 1))
    assert not s.take(6, files(6), {"step": 6}) and [i.step for i in s.store.list()] == [4, 2]
    out = capsys.readouterr().out.strip().splitlines()
    assert out == [f"ddpjob: warning: in-memory snapshots off from step 6: {snaproom.size_text(size)} more "
                   f"needed, {snaproom.size_text(size - 1)} free in {s.store.root}"], out
    assert not s.take(8, files(8), {"step": 8})  # and stay off
