"""Checks for every string that ends up in a generated job script.

Shared by both sides that write scripts: config.validate (at load), launch/render.py (the
`ddpjob sbatch` template) and launch/submit.py (submitit's script). One set of rules, so a value
the template path refuses is refused on the submitit path too. No torch, no I/O.

sbatch reads `#SBATCH` lines with its own parser, not a shell's: whitespace splits, quotes
group, a backslash escapes (also inside quotes), an unquoted `#` starts a comment, a line
containing "hetjob"/"packjob" anywhere starts a new job component, and getopt_long accepts any
unambiguous prefix of a long option (`--sig` is `--signal`).
"""

from __future__ import annotations

import re
import shlex
from collections.abc import Iterable

from ddpjob.errors import UsageError

CONTROL = re.compile(r"[\x00-\x1f\x7f]")
HETJOB = re.compile(r"hetjob|packjob", re.IGNORECASE)
MAX_LINE = 4096
MAX_COMPONENT = 255  # bytes: NAME_MAX on Linux filesystems
MAX_PATH = 4095  # bytes: PATH_MAX - 1
SBATCH_EXTRA = re.compile(r"--([a-z][a-z0-9-]*)(=.*)?", re.ASCII | re.DOTALL)
# sbatch options ddpjob derives from the job file or needs for itself (logs, signal routing,
# the script body): setting them again through sbatch_extra would silently break resume.
RESERVED_SBATCH: dict[str, str] = {
    **{o: f"set slurm.{o.replace('-', '_')} instead" for o in
       ("nodes", "gpus-per-node", "cpus-per-task", "mem", "partition", "account", "qos", "time",
        "constraint")},
    "job-name": "set name instead", "ntasks-per-node": "set slurm.tasks_per_node instead",
    "ntasks": "set slurm.nodes and slurm.tasks_per_node instead",
    "requeue": "set slurm.requeue instead", "no-requeue": "set slurm.requeue = false instead",
    "signal": "set slurm.signal and slurm.signal_lead_s instead",
    "output": "ddpjob writes the logs to RUN_DIR/logs; remove it",
    "error": "ddpjob writes the logs to RUN_DIR/logs; remove it",
    "open-mode": "ddpjob appends to the logs across requeues; remove it",
    "wrap": "a job file cannot replace the script; use slurm.setup for shell lines",
    "array": "use `ddpjob submit --sweep` for job arrays",
}


def one_line(value: str, what: str, hint: str, *, tab: bool = False,
             limit: int = MAX_LINE) -> str:
    """`value` as one line of UTF-8 text: no control characters (a tab only if `tab`), no
    lone surrogates (undecodable bytes of a path), at most `limit` characters."""
    bad = CONTROL.search(value.replace("\t", " ") if tab else value)
    if bad:
        kind = "a newline" if bad.group() == "\n" else f"the control character {bad.group()!r}"
        raise UsageError(f"{what} {value[:80]!r} contains {kind}, expected one line of text", hint)
    if len(value) > limit:
        raise UsageError(f"{what} has {len(value)} characters, expected at most {limit}", hint)
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} {value[:80]!r} is not valid UTF-8 text, expected printable "
                         "characters", hint) from None
    return value


def directive_value(value: str, what: str, hint: str) -> str:
    """A value on an `#SBATCH` line (either script): one line, no backslash (sbatch drops it,
    and it turns off SLURM's %j patterns), no hetjob/packjob."""
    one_line(value, what, hint)
    if "\\" in value:
        raise UsageError(f"{what} {value[:80]!r} contains a backslash, which sbatch's #SBATCH "
                         "parser drops and which turns off SLURM's %j/%t log-name patterns", hint)
    if HETJOB.search(value):
        raise UsageError(f"{what} {value[:80]!r} contains 'hetjob'/'packjob', which sbatch reads "
                         "as a heterogeneous-job separator on #SBATCH lines", hint)
    return value


def path_text(value: str, what: str, hint: str) -> str:
    """A path the OS must accept: no component over 255 bytes, at most 4095 bytes in all."""
    one_line(value, what, hint, limit=MAX_PATH)
    raw = value.encode("utf-8", "surrogateescape")
    long = next((c for c in raw.split(b"/") if len(c) > MAX_COMPONENT), None)
    if long is not None:
        raise UsageError(f"{what} has a path component of {len(long)} bytes "
                         f"({long[:40].decode(errors='replace')}...), expected at most "
                         f"{MAX_COMPONENT}", hint)
    if len(raw) > MAX_PATH:
        raise UsageError(f"{what} is {len(raw)} bytes long, expected at most {MAX_PATH}", hint)
    return value


def run_dir(path: str, *, submitit: bool = False) -> str:
    """The absolute run dir as it appears in a script (paths, #SBATCH --output, srun)."""
    hint = "choose another --run-dir (plain letters, digits, / . _ - are safe)"
    if not path.startswith("/"):  # also rules out a leading '-' read as an option
        raise UsageError(f"run dir '{path[:80]}' is relative, expected an absolute path",
                         "pass Path.absolute() of the run directory")
    path_text(path, "run dir", hint)
    directive_value(path, "run dir", hint)
    if submitit and "%" in path:
        # submitit names its logs and pickles with SLURM patterns (%j_%t_log.out) inside the
        # folder and does not escape the folder itself: a % there would rename the logs.
        raise UsageError(f"run dir {path!r} contains '%', which submitit's SLURM log patterns "
                         "would expand", "choose a --run-dir without '%' (or use `ddpjob sbatch`)")
    return path


def setup_lines(lines: Iterable[str]) -> list[str]:
    """slurm.setup: one shell line per entry; none may be a comment, because in submitit's
    script setup comes before the first command, where sbatch still reads `#SBATCH` lines."""
    out = []
    for line in lines:
        one_line(line, "slurm.setup line", "split it into several list entries", tab=True)
        if line.lstrip().startswith("#"):
            raise UsageError(f"slurm.setup line {line[:80]!r} starts with '#', expected a shell "
                             "command (a comment there could be read as an #SBATCH directive)",
                             "remove the line, or put the comment behind a command: `: # note`")
        _complete_shell(line)
        out.append(line)
    return out


def _complete_shell(line: str) -> None:
    """A setup line must end where it ends: an open quote, a trailing backslash or a here-doc
    would swallow the script's next lines (ddpjob's own commands) into the user's."""
    try:
        shlex.split(line, comments=True)
    except ValueError as exc:
        raise UsageError(f"slurm.setup line {line[:80]!r} is not a complete shell line ({exc}), "
                         "expected balanced quotes and no trailing backslash",
                         "close the quote, or split the command into complete lines") from None
    if re.search(r"<<(?!<)", line):
        raise UsageError(f"slurm.setup line {line[:80]!r} starts a here-document, expected one "
                         "complete shell line", "put the text in a file and read it from there")


def reserved_by_prefix(option: str) -> str | None:
    """The reserved option `option` names, exactly or as an abbreviation getopt_long would
    expand (`sig` -> `signal`, `out` -> `output`, `gpus` -> `gpus-per-node`), else None."""
    return next((r for r in sorted(RESERVED_SBATCH) if r.startswith(option)), None)


def sbatch_extra(arg: str) -> str:
    """One slurm.sbatch_extra entry: a long option `--name[=value]` that is not, and does not
    abbreviate, an option ddpjob sets itself. Short options (`-p`) are refused outright."""
    example = "e.g. sbatch_extra = [\"--exclusive\", \"--mail-type=END\"]"
    if CONTROL.search(arg):
        raise UsageError(f"slurm.sbatch_extra entry {arg[:80]!r} contains a newline or control "
                         "character, expected one '--option=value' argument on one line", example)
    m = SBATCH_EXTRA.fullmatch(arg)
    if not m:
        raise UsageError(f"slurm.sbatch_extra entry {arg[:80]!r} is not one '--option=value' "
                         "argument, expected a long option on one line", example)
    directive_value(arg, "slurm.sbatch_extra entry", example)
    reserved = reserved_by_prefix(m.group(1))
    if reserved is not None:
        how = "sets" if reserved == m.group(1) else "abbreviates (sbatch expands it to)"
        raise UsageError(f"slurm.sbatch_extra entry {arg!r} {how} --{reserved}, which ddpjob "
                         "controls, expected other sbatch options", RESERVED_SBATCH[reserved])
    return arg


def split_extra(arg: str) -> tuple[str, str | None]:
    """`--mail-type=END` -> ("mail-type", "END"); `--exclusive` -> ("exclusive", None)."""
    key, eq, value = arg[2:].partition("=")
    return key, (value if eq else None)
