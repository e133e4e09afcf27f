"""rank/slowdown.py in-process: the whole job against its own baseline, on made-up step times
(each case caused at a step), and a resumed run compared with its speed before the stop. The
real ranks are in tests/ranks/test_straggler_ranks.py."""

from __future__ import annotations

import json
import random

import pytest

from ddpjob.ledger import events
from ddpjob.rank.slowdown import Baseline, Parts, Recovered, Slowdown, SlowdownWatch
from ddpjob.rank.steptimer import StepTimer


def feed(watch: SlowdownWatch, steps: range, world: int = 4, *, data=lambda r, s: 0.002,
         compute=lambda r, s: 0.150, allreduce=lambda s: 0.040) -> list[tuple[int, object]]:
    """Steps of `world` ranks: each rank's busy = its data wait + compute; the step = the
    slowest rank's busy + the all-reduce."""
    out = []
    for s in steps:
        d = [data(r, s) for r in range(world)]
        busy = [d[r] + compute(r, s) for r in range(world)]
        out += [(s, f) for f in watch.observe(s, max(busy) + allreduce(s), busy, d)]
    return out


def test_a_job_whose_data_wait_grows_on_every_rank_is_said_slower_with_that_cause() -> None:
    """Baseline 192 ms (2 data + 150 compute + 40 all-reduce); from step 301 every rank's data
    wait is 110 ms: 1.56x slower. One line within 3 windows of that step, naming the data wait;
    the baseline once, before."""
    watch = SlowdownWatch(window=50, threshold=0.3, world_size=4)
    found = feed(watch, range(1, 601), data=lambda r, s: 0.110 if s > 300 else 0.002)
    kinds = [type(f).__name__ for _, f in found]
    assert kinds == ["Baseline", "Slowdown"], kinds
    (at, base), (step, slow) = found
    assert isinstance(base, Baseline) and isinstance(slow, Slowdown)
    assert at == 25 + 50 and base.parts.step == pytest.approx(0.192)  # warm-up, then a window
    assert 300 < step <= 300 + 3 * 50 and 300 < slow.since <= step
    assert slow.cause == "data" and slow.slower == (0, 1, 2, 3)
    assert slow.describe() == (f"the job runs at {0.192 / 0.300:.2f}x its own speed since step {slow.since} "
                               "(300 ms a step against 192 ms): every rank is slower (not one straggler); "
                               "the data wait went from 2 ms to 110 ms")
    assert slow.fields()["ratio"] == 0.64 and slow.fields()["data_ms"] == 110.0


def test_one_slow_rank_slows_the_job_and_the_line_says_it_is_that_rank() -> None:
    watch = SlowdownWatch(window=20, threshold=0.3, world_size=4)
    found = feed(watch, range(1, 301), compute=lambda r, s: 0.300 if r == 2 and s > 100 else 0.150)
    (_, slow), = [(s, f) for s, f in found if isinstance(f, Slowdown)]
    assert slow.slower == (2,) and slow.cause == "allreduce"  # the median rank waits for rank 2
    assert ": rank 2 alone is slower, the others wait for it; the all-reduce wait went from" \
        in slow.describe()


def test_a_slower_all_reduce_with_no_rank_slower_is_said_so() -> None:
    watch = SlowdownWatch(window=20, threshold=0.3, world_size=2)
    found = feed(watch, range(1, 301), 2, allreduce=lambda s: 0.150 if s > 100 else 0.040)
    (_, slow), = [(s, f) for s, f in found if isinstance(f, Slowdown)]
    assert slow.slower == () and slow.cause == "allreduce"
    assert "no rank's own work is slower (the time goes to the all-reduce); the all-reduce wait went from " \
           "40 ms to 150 ms" in slow.describe()


def test_noise_and_a_short_burst_say_nothing_and_a_recovery_is_said_once() -> None:
    rng = random.Random(4)
    noisy = SlowdownWatch(window=50, threshold=0.3, world_size=4)
    # +-25% on every step, and 20 steps at 3x: no slowdown
    found = feed(noisy, range(1, 2001), compute=lambda r, s: 0.150 * rng.uniform(0.75, 1.25) * (
        3 if 700 < s <= 720 else 1))
    assert [type(f).__name__ for _, f in found] == ["Baseline"]
    watch = SlowdownWatch(window=20, threshold=0.3, world_size=4)
    found = feed(watch, range(1, 401), compute=lambda r, s: 0.300 if 100 < s <= 200 else 0.150)
    assert [type(f).__name__ for _, f in found] == ["Baseline", "Slowdown", "Recovered"]
    step, back = found[2]
    assert isinstance(back, Recovered) and 200 < step <= 200 + 2 * 20 and back.describe().startswith(
        "the job is back at 1.00x its own speed at step ")


def test_a_baseline_taken_in_a_slow_warm_up_window_gives_way_to_the_run_s_own_speed() -> None:
    """The window after the warm-up ran at 1.4x (steps 11-40 at 270 ms, the run's speed is 192
    ms): the first look that finds the run faster than that baseline by over a third of the
    threshold records a new one (a window half slow, then one past them), so a 1.5x slowdown from step 101 (data wait +96 ms) is said,
    against 192 ms, not missed as 1.07x of the slow window. Without the new baseline nothing is
    said (checked by hand)."""
    watch = SlowdownWatch(window=20, threshold=0.3, world_size=2)
    found = feed(watch, range(1, 251), 2, compute=lambda r, s: 0.228 if s <= 40 else 0.150,
                 data=lambda r, s: 0.098 if s > 100 else 0.002)
    kinds = [type(f).__name__ for _, f in found]
    assert kinds[0] == "Baseline" and kinds[-1] == "Slowdown" and set(kinds[1:-1]) == {"Baseline"}, kinds
    (_, slow_window), (lowered_at, base), (step, slow) = found[0], found[-2], found[-1]
    assert slow_window.parts.step == pytest.approx(0.270) and base.parts.step == pytest.approx(0.192)
    assert lowered_at <= 40 + 20 + 10  # by the first look whose window is past the slow steps
    assert isinstance(slow, Slowdown) and 100 < step <= 100 + 3 * 20 and slow.cause == "data"
    assert slow.base is base and slow.ratio == pytest.approx(0.192 / 0.288)
    # the same faster window does not lower it again: the baseline moves only by a real margin
    assert [type(f).__name__ for _, f in feed(SlowdownWatch(window=20, threshold=0.3, world_size=2),
                                                range(1, 400), 2)] == ["Baseline"]


def test_a_resumed_run_is_compared_with_its_baseline_before_the_stop(tmp_path) -> None:
    """The first attempt records its baseline; the second, on a host half as fast, takes it from
    the events (the newest of its world size) and says so after its warm-up, with no baseline
    of its own."""
    first = SlowdownWatch(window=20, threshold=0.3, world_size=2)
    (_, base), = feed(first, range(1, 200), 2)
    events.record(tmp_path, "baseline", **base.fields(), job_id="1", restart=0)
    events.record(tmp_path, "baseline", **{**base.fields(), "world_size": 4, "step_ms": 999.0}, job_id="1",
                  restart=0)
    again = Baseline.from_events(events.read(tmp_path), 2)
    assert again is not None and again.fields() == base.fields()  # as recorded, in ms
    assert Baseline.from_events(events.read(tmp_path), 8) is None
    second = SlowdownWatch(window=20, threshold=0.3, world_size=2, baseline=again)
    found = feed(second, range(200, 400), 2, compute=lambda r, s: 0.300)
    assert [type(f).__name__ for _, f in found] == ["Slowdown"]
    step, slow = found[0]
    assert step <= 200 + 10 + 2 * 20 and slow.slower == (0, 1) and slow.cause == "compute"


def test_one_rank_alone_watches_its_own_steps() -> None:
    """No vote (one rank): rank 0's timer feeds the watch its own step and data wait."""
    class Tick:
        now = 0.0

        def __call__(self) -> float:
            return self.now

    tick, found = Tick(), []
    timer = StepTimer(0, 1, None, report=found.append, clock=tick,
                      slowdown=SlowdownWatch(window=10, threshold=0.3, world_size=1))
    for step in range(1, 101):
        timer.step_started()
        timer.fetched(0.0, 0.050 if step > 50 else 0.001)
        tick.now += 0.100 + (0.050 if step > 50 else 0.001)
        timer.step_done(step)
    assert [type(f).__name__ for f in found] == ["Baseline", "Slowdown"]
    assert found[1].describe().endswith("(150 ms a step against 101 ms); the data wait went from 1 ms to 50 ms")


def test_parts_add_up_to_the_step() -> None:
    p = Parts.of([(1, 0.2, [0.1, 0.15], [0.01, 0.02])])
    assert p.step == pytest.approx(p.data + p.compute + p.allreduce) and p.busy == (0.1, 0.15)


def test_status_json_openmetrics_and_plot_show_the_slowdown_and_the_host_line(tmp_path, capsys, monkeypatch) -> None:
    """A run dir as rank 0 writes it: a baseline, a slowdown from step 41 that ended at step 70,
    a second that lasts, and an oversubscribed host. `status` says each in a line, --json and
    OpenMetrics carry them, and `plot` draws a band over the slow steps."""
    pytest.importorskip("matplotlib")
    pytest.importorskip("prometheus_client")
    from prometheus_client.openmetrics.parser import text_string_to_metric_families

    from ddpjob import fileio
    from ddpjob.cli import main
    from ddpjob.launch import plot, summary

    monkeypatch.chdir(tmp_path)
    run = tmp_path / "runs" / "slow"
    run.mkdir(parents=True)
    fileio.write_json_atomic(run / "config.json", {})
    fileio.write_json_atomic(run / "job.json", {"backend": "local", "job_id": "9", "submitted_at": 100.0})
    ids = {"job_id": "9", "restart": 0}
    events.record(run, "start", world_size=2, **ids)
    for s in range(1, 101):
        fileio.append_jsonl(run / "metrics.jsonl", {"kind": "train", "step": s, "restart": 0, "time": 110.0 + s,
                                                    "loss": 1.0 / s})
    base = Baseline(30, Parts(0.1, 0.002, 0.06, 0.038, (0.062, 0.062)), 2)
    events.record(run, "baseline", **base.fields(), **ids)
    slow = Slowdown(41, 60, Parts(0.2, 0.1, 0.06, 0.04, (0.16, 0.16)), base, (0, 1))
    events.record(run, "slowdown", **slow.fields(), **ids)
    events.record(run, "slowdown", **Recovered(70, 0.98).fields(), **ids)
    events.record(run, "slowdown", **Slowdown(85, 95, Parts(0.25, 0.1, 0.11, 0.04, (0.21, 0.21)), base,
                                              (0, 1)).fields(), **ids)
    events.record(run, "straggler", rank=1, host="n1", cause="host", busy_ms=20.0, median_ms=10.0, data_ms=0.5,
                  wait_ms=9.5, load=9.0, cores=2, step=40, first_step=21, **ids)
    lines = summary.summary(run)
    assert (f"slowdown    {slow.describe()}; back at step 70 (job 9)") in lines
    assert any(ln.startswith("slowdown    the job runs at 0.40x its own speed since step 85") for ln in lines)
    assert ("straggler   none: host n1 oversubscribed (load 9.0 on 2 cores), steps 21-40: rank 1 waited 9.5 ms a "
            "step more for a core (job 9)") in lines
    assert main(["status", "runs/slow", "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert [(s["since"], s["until_step"], s["ratio"], s["cause"]) for s in rec["slowdowns"]] == [
        (41, 70, 0.5, "data"), (85, None, 0.4, "data")]
    assert rec["baseline_step_ms"] == 100.0 and rec["stragglers"][0]["cause"] == "host"
    assert main(["status", "runs/slow", "--format", "openmetrics"]) == 0
    got = {(s.name, s.labels.get("run")): s.value
           for f in text_string_to_metric_families(capsys.readouterr().out) for s in f.samples}
    assert got[("ddpjob_run_speed_ratio", str(run))] == 0.4 and got[("ddpjob_run_slowdowns_total", str(run))] == 2
    assert got[("ddpjob_run_baseline_step_seconds", str(run))] == 0.1
    record = plot.plot_runs([run], tmp_path / "slow.png")
    assert record.bands["slow"] == [(41, 70, "slowdown 0.50x (data)"), (85, 100, "slowdown 0.40x (data)")]


def test_since_is_where_the_steps_turned_slow_not_a_stray_slow_step_before() -> None:
    from ddpjob.rank.slowdown import change_point

    steps = list(range(50, 70))
    slow = [s in (52, 55) or s >= 61 and s != 64 for s in steps]
    assert change_point(steps, slow) == 61
    assert change_point(steps, [True] * 20) == 50
