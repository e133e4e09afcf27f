"""Command line: `ddpjob <command>`.

The only place that turns exceptions into exit codes. Each subcommand's arguments are declared
here; the work lives in its own module, imported lazily so that login-node commands do not pay
for importing torch. Errors: one line, exit 2 for usage and 1 for runtime, traceback only with
--debug.
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Sequence
from typing import Any, NoReturn

from ddpjob import exitcodes, jobfile, rundir
from ddpjob.errors import DDPJobError, UsageError
from ddpjob.version import __version__


class _Parser(argparse.ArgumentParser):
    """argparse, but a usage error is one `ddpjob: error:` line with a hint, not usage + error."""

    def error(self, message: str) -> NoReturn:
        raise UsageError(f"{message} (in `{self.prog}`)", f"see `{self.prog} --help`")


def _path(what: str):
    """argparse type for a path argument: one the OS can open (no component over 255 bytes, no
    control characters), checked before any command touches the filesystem with it."""
    def check(value: str) -> str:
        from ddpjob import scriptsafe

        if not value:  # '' would silently mean "the default" or the working directory
            raise UsageError(f"{what} is empty, expected a path", f"give a non-empty {what}")
        return scriptsafe.path_text(value, what, f"pass a shorter or plain {what}")

    check.__name__ = what  # argparse names the type in its own messages
    return check


def _number(what: str, high: float, example: str):
    """argparse type for a positive finite number up to `high` (nan, inf, 0, -5 and 1e9 MB are
    no payload or timeout anyone means)."""
    def check(value: str) -> float:
        import math

        try:
            x = float(value)
        except ValueError:
            x = math.nan
        if not (math.isfinite(x) and 0 < x <= high):
            raise UsageError(f"{what} is {value!r}, expected a number above 0 and at most {high:g}",
                             f"e.g. {what} {example}")
        return x

    check.__name__ = what
    return check


def _handler(spec: str):  # "module:function", imported only when the command runs
    def call(args: argparse.Namespace) -> int:
        module, func = spec.split(":")
        return int(getattr(importlib.import_module(module), func)(args) or 0)

    return call


def _add_format(p: argparse.ArgumentParser) -> None:
    """status / ls: a table for people, or one record per run for scripts and dashboards."""
    p.add_argument("--format", choices=["table", "json", "openmetrics"], default="table",
                   help="json: one JSON object per run (JSON Lines; docs/status-json.md); openmetrics: "
                        "the same as Prometheus series (docs/openmetrics.md; extra: openmetrics)")
    p.add_argument("--json", dest="format", action="store_const", const="json", help="the same as --format json")


def _add_job_overrides(p: argparse.ArgumentParser, run_dir: bool = True) -> None:
    """Flags shared by submit/sbatch/run/doctor: they override the job file."""
    g = p.add_argument_group("job overrides (win over the job file)")
    for flag, kind, what in jobfile.CLI_FLAGS:
        g.add_argument(f"--{flag.replace('_', '-')}", type=kind, help=what)
    g.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="typed override of any job-file key, e.g. --set train.lr=0.05 (repeatable)")
    if run_dir:
        g.add_argument("--run-dir", type=_path("--run-dir"), help="run directory (default: a new folder under ./runs/)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="ddpjob", description="Preemption-proof PyTorch DDP training on SLURM.")
    parser.add_argument("--version", action="version", version=f"ddpjob {__version__}")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    sub.required = True

    dashes = ("-- PROGRAM ARGS...: run this command on every rank instead of the job file's entry "
              "([train] command; each word one argument, no shell: docs/commands.md)")
    p = sub.add_parser("submit", help="submit a job file (submitit on SLURM, or local processes)",
                       usage="ddpjob submit [options] job [-- PROGRAM ARGS...]", epilog=dashes)
    p.add_argument("job", type=_path("job file"), help="job file (TOML)")
    p.add_argument("--backend", choices=["auto", "slurm", "local"], default="auto",
                   help="auto = slurm when sbatch is on PATH, else local")
    p.add_argument("--sweep", action="append", default=[], metavar="SECTION.KEY=V1,V2",
                   help="grid search: one run per combination, as one SLURM job array (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="run the job's own preflight checks, print the script and per-rank view; submit nothing")
    p.add_argument("--wait", action="store_true", help="block until the job ends, streaming rank 0's log")
    _add_job_overrides(p)
    p.set_defaults(func=_handler("ddpjob.launch.submit:cmd_submit"))

    p = sub.add_parser("sbatch", help="write a standalone sbatch script for a job file",
                       usage="ddpjob sbatch [options] job -o OUTPUT [-- PROGRAM ARGS...]", epilog=dashes)
    p.add_argument("job", type=_path("job file"), help="job file (TOML)")
    p.add_argument("-o", "--output", required=True, type=_path("-o"), help="where to write the script ('-' = stdout)")
    p.add_argument("--template", type=_path("--template"), help="your own copy of templates/sbatch.sh.tmpl")
    p.add_argument("--no-data-check", action="store_true",
                   help="do not require data.root here (the compute nodes see another filesystem)")
    _add_job_overrides(p)
    p.set_defaults(func=_handler("ddpjob.launch.sbatch:cmd_sbatch"))

    p = sub.add_parser("run", help="train on this node (under srun, torchrun, or alone)")
    p.add_argument("target", type=_path("run target"), help="job file (TOML) or an existing run directory")
    p.add_argument("--allow-code-change", action="store_true",
                   help="resume a checkpoint written by other code (the code on disk was edited)")
    p.add_argument("--from-scratch", action="store_true",
                   help="start at step 0 although the run has checkpoints, none of which can be resumed "
                   "(they are moved to checkpoints/rejected/)")
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help=argparse.SUPPRESS)  # torch.distributed.launch (legacy) passes this
    _add_job_overrides(p)
    p.set_defaults(func=_handler("ddpjob.rank.runner:cmd_run"))

    p = sub.add_parser("selftest", help="check the process group: all-reduce, broadcast, bandwidth")
    p.add_argument("--backend", choices=["auto", "nccl", "gloo"], default="auto")
    p.add_argument("--size-mb", type=_number("--size-mb", 65536, "16"), default=16.0,
                   help="all-reduce payload for the bandwidth test (MB, at most 65536)")
    p.add_argument("--timeout", type=_number("--timeout", 86400, "60"), default=60.0,
                   help="seconds to wait for the other ranks (at most a day)")
    p.add_argument("--local_rank", "--local-rank", dest="local_rank", type=int, default=None,
                   help=argparse.SUPPRESS)
    p.set_defaults(func=_handler("ddpjob.node.selftest:cmd_selftest"))

    p = sub.add_parser("resume", help="bring a stopped, cancelled or failed run back (other resources allowed)")
    p.add_argument("run", type=_path("run directory"), help="run directory")
    p.add_argument("--wait", action="store_true", help="block until the job ends, streaming rank 0's log")
    p.add_argument("--allow-code-change", action="store_true",
                   help="freeze the code on disk now and resume the checkpoints of the old code with it")
    _add_job_overrides(p, run_dir=False)
    p.set_defaults(func=_handler("ddpjob.launch.resume:cmd_resume"))

    p = sub.add_parser("status", help="state, restarts, last step and checkpoint of runs")
    p.add_argument("target", nargs="?", type=_path("status target"), help="run directory or SLURM job id (default: all runs)")
    p.add_argument("--runs-root", default="runs", type=_path("--runs-root"), help="where runs live (default: ./runs)")
    _add_format(p)
    p.set_defaults(func=_handler("ddpjob.launch.control:cmd_status"))

    p = sub.add_parser("logs", help="print a run's logs")
    p.add_argument("run", type=_path("run directory"), help="run directory")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("-f", "--follow", action="store_true", help="keep following, across requeues")
    p.set_defaults(func=_handler("ddpjob.launch.control:cmd_logs"))

    p = sub.add_parser("cancel", help="cancel a run's job")
    p.add_argument("run", type=_path("run directory"), help="run directory")
    p.set_defaults(func=_handler("ddpjob.launch.stop:cmd_cancel"))

    p = sub.add_parser("stop", help="checkpoint a run's job and end it (`ddpjob resume` continues)")
    p.add_argument("run", type=_path("run directory"), help="run directory")
    p.set_defaults(func=_handler("ddpjob.launch.stop:cmd_stop"))

    p = sub.add_parser("ls", help="list runs")
    p.add_argument("--runs-root", default="runs", type=_path("--runs-root"))
    _add_format(p)
    p.set_defaults(func=_handler("ddpjob.launch.control:cmd_ls"))

    p = sub.add_parser("verify", help="run a job small, interrupted every way, and say whether it resumes exactly")
    p.add_argument("job", type=_path("job file"), help="job file (TOML)")
    p.add_argument("--steps", type=int, default=30, help="steps of each run (default 30)")
    p.add_argument("--kinds", default=",".join(["signal", "kill", "stop", "world"]),
                   help="interruptions, comma-separated: signal, kill, stop, world (default: all)")
    p.add_argument("--at", type=int, help="interrupt at this step (default: a step drawn per kind)")
    p.add_argument("--seed", type=int, help="seed of the drawn steps (default: a new draw each time)")
    p.add_argument("--keep", action="store_true", help="keep the temporary run dirs for inspection")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="typed override of any job-file key (repeatable)")
    p.set_defaults(func=_handler("ddpjob.launch.verify:cmd_verify"))

    p = sub.add_parser("doctor", help="preflight checks on the login node")
    p.add_argument("job", nargs="?", type=_path("job file"), help="job file to check against the cluster")
    p.add_argument("--srun", action="store_true", help="also run a tiny real srun on a compute node")
    _add_job_overrides(p)
    p.set_defaults(func=_handler("ddpjob.launch.doctor:cmd_doctor"))

    p = sub.add_parser("data", help="download/verify/extract a dataset once, on the login node")
    p.add_argument("dataset", choices=["cifar10"])
    p.add_argument("--root", required=True, type=_path("--root"), help="data root (the job file's data.root)")
    p.add_argument("--from", dest="from_file", help="an archive fetched by other means")
    p.add_argument("--url", help="download address (default: the official one)")
    p.add_argument("--md5", help="expected md5 of a custom archive (default: the official archive's)")
    p.add_argument("--no-verify", action="store_true",
                   help="skip the checksum of a custom archive (its contents are still validated)")
    p.set_defaults(func=_handler("ddpjob.launch.dataprep:cmd_data"))

    p = sub.add_parser("plot", help="plot loss/accuracy/lr/throughput of runs, with restart markers")
    p.add_argument("runs", nargs="+", type=_path("run directory"), help="run directories")
    p.add_argument("-o", "--output", required=True, type=_path("-o"), help="PNG file to write")
    p.set_defaults(func=_handler("ddpjob.launch.plot:cmd_plot"))
    return parser


def console() -> NoReturn:
    """The `ddpjob` command (and `python -m ddpjob`): main(), then the process ends with its
    status; without the interpreter's teardown where a failed rank left its process group
    standing (node/dist.py: end_if_left_standing says why)."""
    code = main()
    dist = sys.modules.get("ddpjob.node.dist")  # never imported by the login-side commands
    if dist is not None:
        dist.end_if_left_standing(code)
    sys.exit(code)


def _command_after_dashes(argv: list[str]) -> tuple[list[str], list[str]]:
    """`ddpjob submit|sbatch JOB.toml [flags] -- PROGRAM ARGS...`: what follows `--` is the job's
    [train] command (docs/commands.md), each word one argument as the shell handed it over."""
    if "--" not in argv:
        return argv, []
    cut = argv.index("--")
    head, command = argv[:cut], argv[cut + 1:]
    verb = next((a for a in head if not a.startswith("-")), None)
    if verb not in ("submit", "sbatch"):
        raise UsageError(f"`--` followed by a command is for `ddpjob submit` and `ddpjob sbatch`, not "
                         f"`ddpjob {verb or ''}`".rstrip(), "set [train] command in the job file")
    if not command:
        raise UsageError("nothing follows `--`, expected the command to run on every rank",
                         "e.g. `ddpjob submit job.toml -- python train.py --out_dir out`")
    return head, command


def _replacing(job: Any, command: list[str]) -> None:
    """One line where the command after `--` takes the place of another in the job file (a
    mistake we can see is said, never silent)."""
    try:
        with open(job, "rb") as f:
            old = jobfile.tomllib.load(f).get("train", {}).get("command")
    except (OSError, ValueError, AttributeError):
        return  # the job file's own errors are resolve's to say
    if old and list(old) != command:
        print(f"ddpjob: note: the command after `--` replaces train.command {json.dumps(old)} of {job}",
              file=sys.stderr, flush=True)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # torch.distributed.launch (legacy, without --use-env) puts --local-rank=N *before* the
    # subcommand; `run` and `selftest` declare it, so move it behind them.
    while argv and argv[0].startswith(("--local-rank=", "--local_rank=")):
        argv.append(argv.pop(0))
    debug = "--debug" in argv
    try:
        argv, command = _command_after_dashes(argv)
        args = build_parser().parse_args(argv)
        if command:
            _replacing(args.job, command)
            args.overrides.append("train.command=" + json.dumps(command, ensure_ascii=False))
        return args.func(args)
    except DDPJobError as exc:
        if debug:
            raise
        print(exc.line(), file=sys.stderr, flush=True)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ddpjob: interrupted", file=sys.stderr)
        return exitcodes.INTERRUPTED
    except BrokenPipeError:
        return exitcodes.ERROR
    except PermissionError as exc:  # another user's file or folder: the setting, not a bug of ddpjob's
        if debug:
            raise
        found = rundir.whose(exc.filename) if exc.filename else str(exc)
        print(DDPJobError(f"permission denied: {found}, expected files ddpjob may use as you",
                          rundir.UNREADABLE_HINT).line(), file=sys.stderr, flush=True)
        return exitcodes.ERROR
    except Exception as exc:  # a bug, not a user error: still one line unless --debug
        if debug:
            raise
        msg = " ".join(f"{type(exc).__name__}: {exc}".split())
        print(f"ddpjob: error: internal error, {msg}. Hint: rerun with --debug for the traceback "
              "and report it.", file=sys.stderr, flush=True)
        return exitcodes.ERROR


if __name__ == "__main__":
    raise SystemExit(main())
