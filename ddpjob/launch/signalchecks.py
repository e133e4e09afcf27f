"""`ddpjob doctor`'s signal checks: where the warning signal goes (every task, never only the batch
shell: a B: signal would leave the ranks without a checkpoint) and whether slurm.signal_lead_s
leaves room for this job's checkpoints, as measured from an earlier run's files. Login side.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from ddpjob.config import JobConfig
from ddpjob.errors import UsageError
from ddpjob.launch.checks import FAIL, PASS, WARN, Check

MIN_LEAD_S = 30  # below this, a checkpoint of anything but a tiny model may not finish in time


def measured_checkpoint_s(cfg: JobConfig, runs_root: Path) -> float | None:
    """How long this job's recent checkpoints took to write, from the files' times: ranks write
    their files, then rank 0 writes manifest.json last. None when no earlier run has one."""
    manifests = [*runs_root.glob(f"{cfg.name}-*/checkpoints/step-*/manifest.json"),
                 *runs_root.glob("checkpoints/step-*/manifest.json")]  # --run-dir of an old run
    worst = None
    for m in sorted(manifests, key=lambda p: p.stat().st_mtime)[-5:]:
        try:
            firsts = [p.stat().st_mtime for p in m.parent.iterdir() if p.is_file() and p != m]
            took = m.stat().st_mtime - min(firsts)
        except (OSError, ValueError):
            continue
        worst = max(worst or 0.0, took)
    return worst


def signal_routing(signal: str, sbatch_extra: Sequence[str], lead_s: object = "?") -> Check:
    """Where the warning signal goes. Takes raw values: config validation rejects a B: signal
    at load time, and doctor still explains why it would break the job."""
    sig = str(signal).upper().removeprefix("SIG")
    from ddpjob.scriptsafe import reserved_by_prefix, split_extra

    # sbatch expands abbreviations (--sig=B:USR2@60 is --signal): look at what sbatch would see.
    culprits = ([f"slurm.signal = {signal!r}"] if "B:" in sig else []) + [
        f"slurm.sbatch_extra '{a}'" for a in sbatch_extra
        if str(a).startswith("--") and split_extra(str(a))[0]
        and reserved_by_prefix(split_extra(str(a))[0]) == "signal"
        and "B:" in str(split_extra(str(a))[1] or "").upper()]
    if culprits:
        return Check("signal routing", FAIL, f"{culprits[0]} would signal only the batch shell, and "
                     "srun does not pass signals on to the training tasks: they would be killed "
                     "at the limit without a checkpoint", "drop the B: and any --signal in "
                     "sbatch_extra: ddpjob sends slurm.signal (USR2) to every task "
                     "slurm.signal_lead_s before the limit")
    return Check("signal routing", PASS, f"SIG{sig} reaches every task {lead_s} s before the "
                 f"limit (--signal={sig}@{lead_s}, no B:)")


def raw_signal_routing(job: str, overrides: Sequence[str]) -> Check | None:
    """After a failed resolve: the routing check on the job file's raw values, if readable."""
    from ddpjob.jobfile import apply_overrides, tomllib

    try:
        raw = apply_overrides(tomllib.loads(Path(job).read_text(encoding="utf-8")), overrides)
        s = raw.get("slurm", {})
        extra = s.get("sbatch_extra", [])
        check = signal_routing(str(s.get("signal", "USR2")),
                               [extra] if isinstance(extra, str) else list(extra))
    except (OSError, ValueError, UsageError, AttributeError, TypeError):
        return None
    return check if check.status == FAIL else None


def signal_checks(cfg: JobConfig, measured_s: float | None = None) -> list[Check]:
    s = cfg.slurm
    out = [signal_routing(s.signal, s.sbatch_extra, s.signal_lead_s)]
    lead = s.signal_lead_s
    took = f"; this job's last checkpoints took up to {measured_s:.1f} s" if measured_s else ""
    if lead < MIN_LEAD_S:
        out.append(Check("signal lead", WARN, f"slurm.signal_lead_s = {lead}: under {MIN_LEAD_S} s "
                         f"a checkpoint may not be written before SLURM kills the job{took}",
                         "set slurm.signal_lead_s to 120 or more"))
    elif measured_s and lead < 3 * measured_s:  # slow filesystems vary: keep a 3x margin
        out.append(Check("signal lead", WARN, f"slurm.signal_lead_s = {lead}{took}: little margin",
                         f"set slurm.signal_lead_s to at least {int(3 * measured_s) + 1}"))
    else:
        out.append(Check("signal lead", PASS, f"{lead} s to checkpoint before the kill{took}"))
    return out
