"""sbatch script text from templates/sbatch.sh.tmpl: a pure function of the resolved config.

Second step of the flow (config -> render -> run dir -> `sbatch`). `render_sbatch` does no I/O,
so golden files pin its output; `load_template` reads the template shipped in the package
(`ddpjob.templates`) or a user's copy. Every value reaching the shell is `shlex.quote`d, every
`#SBATCH` value is validated or quoted for sbatch's own parser, and anything else is refused.
"""

from __future__ import annotations

import difflib
import functools
import hashlib
import importlib.resources
import os
import re
import shlex
import stat
import string
from collections.abc import Mapping
from pathlib import Path

from ddpjob import exitcodes, fileio, rundir, scriptsafe
from ddpjob.config import JobConfig
from ddpjob.launch import container
from ddpjob.launch import slurmopts
from ddpjob.errors import UsageError
from ddpjob.version import __version__

TEMPLATE_NAME = "sbatch.sh.tmpl"
TEMPLATE_LIMIT = 1 << 20  # bytes: the shipped template is 5 KB; more is a wrong file
# sbatch's own "#SBATCH" parser: see ddpjob/scriptsafe.py, whose checks both renderers share.
_DIRECTIVE_SAFE = re.compile(r"[A-Za-z0-9_@%+=:,./-]*", re.ASCII)
_CONTROL = scriptsafe.CONTROL
_ENV_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*", re.ASCII)


_PATTERN = r"""
    \$(?:
      (?P<escaped>(?!))                       # no escape sequence: `$$` is the shell's PID
    | (?P<named>(?!))                         # bare $name is always shell
    | \{(?P<braced>[a-z][a-z0-9_]*)\}         # ${placeholder}
    | (?P<invalid>(?!))
    )
"""


class ShellTemplate(string.Template):
    """`${lower_case}` placeholders only: `$VAR`, `${UPPER}`, `$(...)`, `$?`, `$1` stay shell."""

    # string.Template ignores case by default, which would capture ${UPPER} too
    flags = 0  # type: ignore[assignment]
    pattern = _PATTERN  # type: ignore[assignment]


def load_template(path: str | Path | None = None) -> str:
    """The text of a user's template, or of the one shipped with ddpjob (path None)."""
    if path is None:
        return _default_template()
    try:  # the bounded read: a FIFO or a device named by mistake must not block sbatch
        return fileio.read_bounded(path, TEMPLATE_LIMIT, errors="strict")
    except FileNotFoundError:
        raise UsageError(f"template '{path}' not found, expected a copy of {TEMPLATE_NAME}",
                         "copy templates/sbatch.sh.tmpl from ddpjob and pass its path") from None
    except fileio.RecordError:
        mode = os.stat(path).st_mode
        kind = ("a directory" if stat.S_ISDIR(mode) else "a FIFO" if stat.S_ISFIFO(mode) else
                "a device" if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else "too large")
        raise UsageError(f"template '{path}' is {kind}, expected a text file of at most "
                         f"{TEMPLATE_LIMIT >> 20} MiB", f"pass the path of your copy of {TEMPLATE_NAME}") from None
    except UnicodeDecodeError:
        raise UsageError(f"template '{path}' is not UTF-8 text, expected a shell script template",
                         f"start again from a copy of {TEMPLATE_NAME}") from None
    except OSError as exc:
        raise UsageError(f"cannot read template '{path}' ({exc.strerror})",
                         "check the path and its permissions") from None


@functools.lru_cache(maxsize=1)
def _default_template() -> str:
    return importlib.resources.files("ddpjob.templates").joinpath(TEMPLATE_NAME).read_text("utf-8")


def render_sbatch(cfg: JobConfig, *, run_dir: Path, python: str, template: str | None = None,
                  extra_env: Mapping[str, str] = {}) -> str:
    """The sbatch script for `cfg`, training in `run_dir` with interpreter `python`.

    Pure: the same arguments give the same text (template None = the shipped template, read
    once). Raises UsageError for a string that could not reach the job unchanged.
    """
    text = _default_template() if template is None else template
    values = placeholders(cfg, run_dir=run_dir, python=python, extra_env=extra_env)
    tmpl = ShellTemplate(text)
    unknown = sorted(set(tmpl.get_identifiers()) - set(values))
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(values), n=1)
        raise UsageError(f"the template uses the unknown placeholder ${{{unknown[0]}}}, expected "
                         f"one of: {', '.join(sorted(values))}",
                         (f"did you mean ${{{close[0]}}}? Shell" if close else "fix its spelling; shell")
                         + " variables are UPPER_CASE or written $name")
    return tmpl.substitute(values)


def placeholders(cfg: JobConfig, *, run_dir: Path, python: str,
                 extra_env: Mapping[str, str] = {}) -> dict[str, str]:
    """Every placeholder a template may use, each already quoted for where it appears."""
    s = cfg.slurm
    run = _check_run_dir(run_dir)
    python = _check_python(python)
    signal = s.signal  # canonical since validation ("USR2")
    # first: slurmopts.sbatch_options checks the job's strings (validate.job_strings, the one rule)
    directives = sbatch_directives(cfg, run)
    config_json = cfg.to_json().encode()
    return {
        "version": __version__,
        "name": cfg.name,  # validated: letters, digits, _ . + -
        "nodes": str(s.nodes),
        "tasks_per_node": str(s.tasks_per_node),
        "world_size": str(s.world_size),
        "config_digest": "sha256:" + hashlib.sha256(config_json).hexdigest()[:16],
        "resume_hash": cfg.hash(),
        "sbatch_directives": "\n".join(f"#SBATCH {d}" for d in directives),
        "setup": "\n".join(s.setup) or "# (none)",
        "run_dir": shlex.quote(run),
        "code_path": shlex.quote(f"{run}/code/python"),  # launch/freeze.py
        "exports": "\n".join(f"export {k}={shlex.quote(v)}" for k, v in _check_env(extra_env)),
        "rank_log": shlex.quote(f"{slurm_pattern_escape(run)}/{rundir.LOGS}/rank-%t.log"),
        "python": shlex.quote(python),  # the batch shell's (host) interpreter
        "rank_python": shlex.quote(container.interpreter(cfg, python)),  # the ranks' (container's)
        # [slurm] container: "" without one, so a template without a container renders as before
        "container_srun": "".join(" " + shlex.quote(o) for o in container.srun_options(cfg, run, python)),
        "container_exec": "".join(shlex.quote(w) + " " for w in container.exec_prefix(cfg, run, python)),
        # [slurm] warm_start (slurmopts.warm_start): "# (off)" and "" without, as before it existed
        "warm_server": "\n".join(slurmopts.warm_server_lines(cfg, shlex.quote(python), '"$DDPJOB_RUN_DIR"')) or "# (off)",
        "warm_client": slurmopts.WARM_CLIENT + " " if slurmopts.warm_start(cfg) else "",
        "umask": "0027" if s.share_group else "0077",  # rundir.private_umask's
        "exit_ok": str(exitcodes.OK),  # ddpjob/exitcodes.py: the ranks' statuses, one definition
        "exit_requeue": str(exitcodes.REQUEUE),
        "exit_restart": str(exitcodes.RESTART),
        "signal": shlex.quote(signal),
        "batch_signals": " ".join(slurmopts.BATCH_SIGNALS),  # what the batch shell traps besides ${signal}
        "node_count": slurmopts.node_count(cfg),  # the allocation's, not the submission's
        "task_count": slurmopts.task_count(cfg, "DDPJOB_NODES"),
        "forward_signal": shlex.quote("" if signal in slurmopts.NOT_FORWARDED else signal),
        # the trap and the one srun restart loop (`ddpjob_srun ARGS`), as submitit's script has them
        "batch_shell": "\n".join(slurmopts.batch_shell_lines(cfg, shlex.quote(python), shlex.quote(run))),
    }


def sbatch_directives(cfg: JobConfig, run_dir: str) -> list[str]:
    """The `#SBATCH` arguments in a fixed order: [slurm]'s (launch/slurmopts.py, the mapping the
    submitit backend uses too), the batch log, then slurm.sbatch_extra quoted for sbatch."""
    own, extra = slurmopts.sbatch_options(cfg)
    log = f"{slurm_pattern_escape(run_dir)}/{rundir.LOGS}/batch-%j.out"
    return [*map(slurmopts.as_flag, own), directive_quote(f"--output={log}"), directive_quote(f"--error={log}"),
            *(directive_quote(slurmopts.as_flag(o)) for o in extra)]


def directive_quote(arg: str) -> str:
    """One argument for sbatch's `#SBATCH` parser (not a shell): bare if plain, else "...",
    with backslash and double quote escaped. Control characters cannot be written at all: what
    reaches here was checked (the run dir by scriptsafe.run_dir, sbatch_extra by job_strings)."""
    if _CONTROL.search(arg):  # a check, not an assert: `python -O` must not drop it
        raise UsageError(f"{arg!r} holds a control character, expected printable text in an #SBATCH line",
                         "remove it from the job file (slurm.sbatch_extra, the run dir)")
    if _DIRECTIVE_SAFE.fullmatch(arg):
        return arg
    return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'


def slurm_pattern_escape(path: str) -> str:
    """A literal path inside a SLURM file-name pattern (--output): `%` is written `%%`."""
    return path.replace("%", "%%")


def _check_run_dir(run_dir: Path) -> str:
    return scriptsafe.run_dir(str(run_dir))


def _check_python(python: str) -> str:
    if not python or python.startswith("-") or _CONTROL.search(python):
        raise UsageError(f"python interpreter {python!r} is not a command, expected an absolute "
                         "path or a program name", "pass sys.executable")
    _check_utf8(python, "python interpreter")
    return python


def _check_env(env: Mapping[str, str]) -> list[tuple[str, str]]:
    for key, value in env.items():
        if not _ENV_NAME.fullmatch(key):
            raise UsageError(f"environment variable name {key!r} is not a shell name, expected "
                             "letters, digits and _", "e.g. NCCL_DEBUG")
        if "\0" in value:
            raise UsageError(f"environment variable {key} contains a NUL byte", "remove it")
        _check_utf8(value, f"environment variable {key}")
    return sorted(env.items())


def _check_utf8(value: str, what: str) -> None:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(f"{what} {value!r} is not valid UTF-8 text, expected a printable path",
                         "rename it with valid UTF-8 characters") from None
