"""The one fake of ddpjob/slurm.py for unit tests: scripted answers per command prefix.

    def test_x(fake_slurm):                       # conftest fixture: installs FakeSlurm
        fake_slurm.answer("scontrol requeue", rc=1, stderr="Requeue of job is disabled")
        fake_slurm.answer("scontrol show job", stdout="JobState=RUNNING PreemptTime=2026-01-01T00:00:00")
        fake_slurm.missing("scontrol")            # as if the binary were not on PATH
        fake_slurm.hang("squeue")                 # as if it timed out
        ... code under test ...
        assert fake_slurm.called("sbatch")

The longest matching prefix wins; an answer given as a list is used once per call, in order
(the last one repeats). A command with no scripted answer fails the test (no silent defaults).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from ddpjob import slurm


@dataclass
class Call:
    args: list[str]
    env: Mapping[str, str] | None
    cwd: str | None


@dataclass
class FakeSlurm:
    answers: dict[tuple[str, ...], list[slurm.Result]] = field(default_factory=dict)
    calls: list[Call] = field(default_factory=list)

    def answer(self, prefix: str, stdout: str = "", *, rc: int = 0, stderr: str = "",
               then: Sequence[dict] = ()) -> FakeSlurm:
        """`prefix` answers rc/stdout/stderr (then, on later calls, each dict of `then`)."""
        key = tuple(prefix.split())
        self.answers[key] = [self._result(key, rc, stdout, stderr)] + [
            self._result(key, d.get("rc", 0), d.get("stdout", ""), d.get("stderr", "")) for d in then]
        return self

    def missing(self, prefix: str) -> FakeSlurm:
        key = tuple(prefix.split())
        self.answers[key] = [slurm.Result(key, None, error=f"{key[0]}: command not found")]
        return self

    def hang(self, prefix: str) -> FakeSlurm:
        key = tuple(prefix.split())
        self.answers[key] = [slurm.Result(key, None, error=f"{prefix} gave no answer within 30 s")]
        return self

    @staticmethod
    def _result(key: tuple[str, ...], rc: int, stdout: str, stderr: str) -> slurm.Result:
        error = "" if rc == 0 else f"{' '.join(key[:3])} failed: {' '.join((stderr or stdout).split())}"
        return slurm.Result(key, rc, stdout, stderr, error)

    def __call__(self, args: Sequence[str], timeout: float, env: Mapping[str, str] | None,
                 cwd: str | None) -> slurm.Result:
        args = list(args)
        self.calls.append(Call(args, env, cwd))
        keys = [k for k in self.answers if tuple(args[:len(k)]) == k]
        if not keys:
            raise AssertionError(f"fake_slurm: no scripted answer for {args}")
        queue = self.answers[max(keys, key=len)]
        res = queue.pop(0) if len(queue) > 1 else queue[0]
        return slurm.Result(tuple(args), res.rc, res.stdout, res.stderr, res.error)

    def called(self, prefix: str) -> list[list[str]]:
        key = prefix.split()
        return [c.args for c in self.calls if c.args[:len(key)] == key]
