"""Nothing hangs (node/hang.py): a rank that stops making progress ends the job within
train.dist_timeout_s + 60 s, with one line naming the rank, its host and where it was, and
every thread's stack in each rank's log. Real processes (tests/api_script.py, 2 ranks under
`ddpjob run`); the stall is caused at a chosen step by the script itself, and the only clock
in the assertions is the issue's own bound (timeout + 60 s), measured from the stall."""

from __future__ import annotations

from ddpjob.node import hang
from ddpjob.node.hang import Report

HOSTS = {0: "n1", 1: "n1", 2: "n2", 3: "n2"}


def _report(rank: int, **kw: object) -> Report:
    base: dict[str, object] = dict(rank=rank, host=HOSTS[rank], step=6, inside=None,
                                   frame="train.py:40 in main", for_s=12.0, backward=False, failed=None)
    base.update(kw)
    return Report(**base)  # type: ignore[arg-type]


def test_describe_names_the_rank_that_did_not_arrive_and_where_it_was() -> None:
    vote = "the stop vote"
    reports = {0: _report(0, inside=vote), 1: _report(1, inside=vote), 2: _report(2),
               3: _report(3, inside=vote)}
    assert hang.describe(vote, 6, reports, HOSTS) == (
        "rank 2 (n2) did not arrive: it was running its own code at train.py:40 in main (step 6, for 12 s)")


def test_describe_backward_waiters_failures_silence_and_other_collectives() -> None:
    reports = {0: _report(0, backward=True), 1: _report(1, failed="ValueError: bad batch"),
               3: _report(3, inside="the checkpoint's write", step=5)}
    line = hang.describe(hang.BACKWARD, 6, reports, HOSTS)
    assert line == ("rank 1 (n1) failed: ValueError: bad batch; rank 3 (n2) was in the checkpoint's "
                    "write at step 5 for 12 s; rank 2 (n2) did not answer (the process ended or is "
                    "stuck outside Python: see its log)")
    everyone = {r: _report(r, backward=True) for r in range(4)}
    assert "network between the nodes failed" in hang.describe(hang.BACKWARD, 6, everyone, HOSTS)


def test_comm_failures_are_told_from_bugs() -> None:
    assert hang.is_comm_failure(RuntimeError("[gloo/transport/tcp/unbound_buffer.cc:78] Timed out "
                                             "waiting 10000ms for recv operation to complete"))
    assert hang.is_comm_failure(RuntimeError("[pair.cc:534] Connection closed by peer [10.0.0.2]:4242"))
    assert not hang.is_comm_failure(RuntimeError("mat1 and mat2 shapes cannot be multiplied (4x8 and 3x2)"))
    assert not hang.is_comm_failure(ValueError("timed out"))  # a value error is the caller's


def test_a_signal_ends_the_wait_for_reports_that_cannot_come(monkeypatch) -> None:
    """A rank was killed (kill -9): its peer's collective fails and the peer waits for reports
    (hang.REPORT_S) that the dead rank never sends. srun then ends the step (SIGTERM, SIGKILL
    after KillWait): the signal ends the wait, so the restart inside the allocation is not held
    up by it. Counted in polls of the store, not seconds."""
    from ddpjob.node.preemption import StopFlag

    flag = StopFlag()

    class Store:
        polls = 0

        def add(self, key: str, n: int) -> int:
            Store.polls += 1
            if Store.polls == 2:
                flag._handle(15, None)  # SIGTERM from slurmstepd, as the handler records it
            return 1  # of 2 ranks: the dead one never reports

        def check(self, keys: list[str]) -> bool:
            return False

    watch = object.__new__(hang.Watch)
    watch.world_size, watch.steps, watch._store = 2, flag, Store()
    watch._prefix = "ddpjob/hang/0/"
    watch._reported_key = watch._key("reported")
    monkeypatch.setattr(hang.time, "sleep", lambda s: None)
    assert watch._gather() == {}
    assert Store.polls == 2, Store.polls  # without the signal: every 0.25 s until REPORT_S
    # srun's SIGTERM came first, while this rank still computed its step, and its collective
    # failed after: no wait at all (it would last until SIGKILL)
    Store.polls = 10
    assert watch._gather() == {} and Store.polls == 11, Store.polls
