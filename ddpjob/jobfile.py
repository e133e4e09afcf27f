"""Reading a job: the TOML job file, `--set` overrides and the resource flags -> a validated
JobConfig (config.py's schema); RUN_DIR/config.json back into one.

First step of the flow (CLI -> jobfile -> render/submit -> nodes). The login node resolves the job
file plus overrides once and writes `RUN_DIR/config.json`; the nodes read only that
(read_run_config), so every rank and every restart trains with the same settings.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import sys
import typing
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ddpjob.config import SECTIONS, JobConfig, field_key
from ddpjob.errors import UsageError
from ddpjob.validate import ENTRY_SCRIPT, canonical_signal, validate

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib


_USER_KEY = re.compile(r"[A-Za-z_][A-Za-z0-9_-]{0,63}")


def _user_value(where: str, v: Any, depth: int = 0) -> Any:
    """[user] values: what TOML and JSON share (no dates), nested at most 4 deep."""
    if isinstance(v, (bool, int, str)) or (isinstance(v, float) and math.isfinite(v)):
        if isinstance(v, str) and len(v) > 4096:
            raise UsageError(f"{where} is a string of {len(v)} characters, expected at most 4096",
                             "keep long text in a file and put its path in [user]")
        return v
    if depth < 4 and isinstance(v, list) and len(v) <= 1000:
        return [_user_value(f"{where}[{i}]", x, depth + 1) for i, x in enumerate(v)]
    if depth < 4 and isinstance(v, Mapping) and len(v) <= 1000:
        return _user_table(where, v, depth + 1)
    raise UsageError(f"{where} is {v!r} ({type(v).__name__}), expected a string, number, boolean, "
                     "or a list or table of those", f"write e.g. {where.split('.')[-1]} = 0.1")


def _user_table(where: str, raw: Any, depth: int = 0) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise UsageError(f"'{where}' is {type(raw).__name__}, expected a table",
                         f"write it as a [{where}] section of key = value lines")
    out = {}
    for k, v in raw.items():
        if not isinstance(k, str) or not _USER_KEY.fullmatch(k):
            raise UsageError(f"key {k!r} in [{where}] is not a plain name, expected letters, digits, "
                             "_ and - (at most 64)", "rename the key, e.g. lr or hidden_size")
        out[k] = _user_value(f"{where}.{k}", v, depth)
    return out


def _type_name(t: Any) -> str:
    return {int: "an integer", float: "a number", bool: "true or false", str: "a string",
            int | str: "an integer or a string"}.get(t, "a list of strings")


def _coerce(where: str, value: Any, t: Any) -> Any:
    """Check one value against a field's type; ints are accepted where floats are expected."""
    if t is bool:
        ok = isinstance(value, bool)
    elif t is int:
        ok = isinstance(value, int) and not isinstance(value, bool)
    elif t is float:
        ok = isinstance(value, (int, float)) and not isinstance(value, bool)
        value = float(value) if ok else value
    elif t is str:
        ok = isinstance(value, str)
    elif t == int | str:  # a count or a word ("auto"): validate.py checks which
        ok = isinstance(value, (int, str)) and not isinstance(value, bool)
    else:  # tuple[str, ...]
        if isinstance(value, str):
            value = [value]
        ok = isinstance(value, list) and all(isinstance(x, str) for x in value)
        value = tuple(value) if ok else value
    if not ok:
        raise UsageError(f"{where} is {value!r} ({type(value).__name__}), expected {_type_name(t)}",
                         f"write e.g. {where.split('.')[-1]} = {_example(t)}")
    return value


def _example(t: Any) -> str:
    return {int: "4", float: "0.1", bool: "true", str: '"text"', int | str: "4"}.get(t, '["a", "b"]')


def _build_section(name: str, cls: type, raw: Mapping[str, Any], source: str) -> Any:
    hints = typing.get_type_hints(cls)
    by_key = {field_key(f): f for f in dataclasses.fields(cls)}
    kwargs: dict[str, Any] = {}
    for k, v in raw.items():
        if k not in by_key:
            raise UsageError(f"unknown key '{name}.{k}' in {source}, expected one of: "
                             f"{', '.join(sorted(by_key))}", _did_you_mean(k, list(by_key)))
        f = by_key[k]
        kwargs[f.name] = _coerce(f"{name}.{k}", v, hints[f.name])
    return cls(**kwargs)


def _did_you_mean(key: str, valid: Sequence[str]) -> str:
    import difflib

    close = difflib.get_close_matches(key, list(valid), n=1)
    return f"did you mean '{close[0]}'?" if close else "check the spelling against the list"


def from_dict(raw: Mapping[str, Any], source: str = "the job file") -> JobConfig:
    """Build and validate a JobConfig from parsed TOML/JSON."""
    if not isinstance(raw, Mapping):
        raise UsageError(f"{source} holds {type(raw).__name__} {str(raw)[:40]!r}, expected a table "
                         "of sections (name, slurm, train, ...)",
                         "the run dir is damaged; resubmit" if source.endswith(".json")
                         else "start from jobs/smoke.toml")
    unknown = set(raw) - set(SECTIONS) - {"name", "user"}
    if unknown:
        k = sorted(unknown)[0]
        raise UsageError(f"unknown key '{k}' in {source}, expected one of: name, "
                         f"{', '.join(SECTIONS)}, user", _did_you_mean(k, ["name", *SECTIONS, "user"]))
    sections = {}
    for name, cls in SECTIONS.items():
        sec = raw.get(name, {})
        if not isinstance(sec, Mapping):
            raise UsageError(f"'{name}' in {source} is {type(sec).__name__}, expected a table",
                             f"write it as a [{name}] section")
        sections[name] = _build_section(name, cls, sec, source)
    name = _coerce("name", raw.get("name", "ddpjob"), str)
    cfg = JobConfig(name=name, user=_user_table("user", raw.get("user", {})), **sections)
    validate(cfg)
    return dataclasses.replace(cfg, slurm=dataclasses.replace(cfg.slurm, signal=canonical_signal(cfg.slurm.signal)))


def apply_overrides(raw: Mapping[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """`train.lr=0.05` -> raw['train']['lr'] = 0.05; values are TOML literals, bare words strings."""
    out: dict[str, Any] = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in raw.items()}
    # The job file's [user] table lists the script's settings: --set changes them, and a key it
    # lacks is a typo (user.lrr) unless there is no table to check against (ddpjob.init() alone)
    known_user = set(out["user"]) if isinstance(out.get("user"), Mapping) and out["user"] else None
    for item in overrides:
        path, value = parse_override(item)
        if len(path) == 1:
            out[path[0]] = value
        else:
            out.setdefault(path[0], {})
            if not isinstance(out[path[0]], dict):
                raise UsageError(f"override '{item}' targets '{path[0]}', which is not a section, "
                                 "expected section.key=value",
                                 "use --set section.key=value")
            old = out[path[0]].get(path[1])
            if path[0] == "user" and known_user is not None and path[1] not in known_user:
                raise UsageError(f"override '{item}' names user.{path[1]}, which the job file's [user] table "
                                 f"does not have, expected one of: {', '.join(sorted(known_user))}",
                                 _did_you_mean(path[1], sorted(known_user)) + " (a new setting goes into "
                                 "the job file's [user] table first)")
            if path[0] == "user" and isinstance(old, float) and type(value) is int:
                value = float(value)  # lr = 0.1 in the file, --set user.lr=1: still a float
            if path[0] == "user" and old is not None and not _same_kind(old, value):
                raise UsageError(f"override '{item}' gives user.{path[1]} a {type(value).__name__}, but "
                                 f"the job file has {old!r} ({type(old).__name__}), expected the same type",
                                 f"e.g. --set user.{path[1]}={json.dumps(old)}")
            out[path[0]][path[1]] = value
    return out


def _same_kind(old: Any, new: Any) -> bool:
    if isinstance(old, bool) or isinstance(new, bool):
        return isinstance(old, bool) and isinstance(new, bool)
    if isinstance(old, int):  # max_steps = 300 stays an integer: 300.5 is a mistake
        return type(new) is int
    if isinstance(old, float):
        return isinstance(new, float)
    return type(old) is type(new)


def parse_override(item: str) -> tuple[list[str], Any]:
    if "=" not in item:
        raise UsageError(f"override '{item}' has no '=', expected section.key=value",
                         "e.g. --set train.lr=0.05")
    key, text = item.split("=", 1)
    path = key.strip().split(".")
    if not (len(path) == 2 and (path[0] in SECTIONS or path[0] == "user") or path == ["name"]) \
            or not all(path):
        raise UsageError(f"override key '{key}' is not section.key, expected a section among "
                         f"{', '.join(SECTIONS)}, user (or 'name')", "e.g. --set train.lr=0.05")
    return path, parse_value(text)


def _too_big(where: str, exc: Exception) -> UsageError:
    """tomllib's own limits: an integer of more than 4300 digits (ValueError), lists or tables
    nested deeper than the interpreter recurses (RecursionError). Nothing is that large."""
    what = "an integer too long to read" if isinstance(exc, ValueError) else "values nested too deeply to read"
    return UsageError(f"{where} holds {what}, expected values of a sensible size",
                      "shorten the number or flatten the list")


def parse_value(text: str) -> Any:
    """A TOML literal (0.05, true, [1, 2], "x"); anything else is taken as a plain string."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError as exc:
        # A bare word is a string; but something that starts like a list, table or quoted
        # string and does not parse is a typo (a missing ] or quote), never a string.
        if text.lstrip()[:1] in ('[', '{', '"', "'"):
            raise UsageError(f"value {text[:80]!r} starts like a TOML list, table or string but "
                             f"does not parse ({exc}), expected a complete TOML literal",
                             "close the brackets and quotes, e.g. "
                             "--set 'slurm.setup=[\"echo a\", \"echo b\"]'") from None
        return text
    except (RecursionError, ValueError) as exc:  # after TOMLDecodeError, itself a ValueError
        raise _too_big(f"value {text[:40]!r}", exc) from None


# The resource flags of submit, sbatch, run, resume and doctor (--nodes, ...): (flag, its type,
# its help). Each sets the [slurm] key of its name, but --name the job's name. The parser, the
# mapping below and the command line recorded in job.json all read this one list.
CLI_FLAGS: tuple[tuple[str, type, str], ...] = (
    ("nodes", int, "[slurm] nodes"),
    ("tasks_per_node", int, "[slurm] tasks_per_node (one rank each)"),
    ("gpus_per_node", int, "[slurm] gpus_per_node (0 = CPU job)"),
    ("partition", str, "[slurm] partition"),
    ("account", str, "[slurm] account"),
    ("qos", str, "[slurm] qos"),
    ("time", str, "[slurm] time limit, e.g. 04:00:00 or 1-00:00:00"),
    ("name", str, "job name"),
)


def cli_flags(args: Any) -> dict[str, Any]:
    """The resource flags as parsed (None = not given)."""
    return {flag: getattr(args, flag, None) for flag, _, _ in CLI_FLAGS}


def cli_flag_words(args: Any) -> list[str]:
    """The flags that were given, as command-line words again (for job.json)."""
    words = []
    for flag, value in cli_flags(args).items():
        if value is not None:
            words += [f"--{flag.replace('_', '-')}", str(value)]
    return words


def with_cli_flags(cfg_raw: dict[str, Any], flags: Mapping[str, Any]) -> dict[str, Any]:
    """Map --nodes/--partition/... onto the raw dict before validation (None = not given)."""
    out = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in cfg_raw.items()}
    for flag, _, _ in CLI_FLAGS:
        if flags.get(flag) is None:
            continue
        if flag == "name":
            out["name"] = flags[flag]
        else:
            out.setdefault("slurm", {})[flag] = flags[flag]
    return out


def resolve(job: str | Path, overrides: Sequence[str] = (), flags: Mapping[str, Any] | None = None
            ) -> JobConfig:
    """Job file + `--set` overrides + CLI flags -> validated config (flags win)."""
    from ddpjob import scriptsafe

    p = Path(scriptsafe.path_text(str(job), "job file", "pass a shorter path"))
    if not p.is_file():
        raise UsageError(f"job file '{job}' not found, expected a TOML file",
                         "the examples are in jobs/ (e.g. jobs/smoke.toml)")
    try:
        raw = tomllib.loads(p.read_text(encoding="utf-8"))
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"job file '{job}' is not valid TOML ({exc}), expected key = value lines "
                         "under [section] headers",
                         "check quotes and brackets near the position shown") from None
    except (RecursionError, ValueError) as exc:
        raise _too_big(f"job file '{job}'", exc) from None
    except OSError as exc:
        raise UsageError(f"cannot read job file '{job}' ({exc.strerror}), expected a readable file",
                         "check the path and its permissions") from None
    raw = apply_overrides(raw, overrides)
    raw = with_cli_flags(raw, flags or {})
    cfg = from_dict(raw, f"'{job}'")
    return _absolute_entry(cfg, p)


def _absolute_entry(cfg: JobConfig, job: Path) -> JobConfig:
    """A script entry is found relative to the working directory (like `python script.py`),
    then relative to the job file; the nodes get its absolute path."""
    entry = cfg.train.entry
    if not ENTRY_SCRIPT.fullmatch(entry):
        return cfg
    for base in (Path.cwd(), job.resolve().parent):
        script = base / entry
        if script.is_file():
            return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, entry=str(script.resolve())))
    raise UsageError(f"train.entry script '{entry}' not found (looked in {Path.cwd()} and "
                     f"{job.resolve().parent}), expected an existing Python file",
                     "give the path relative to where you run ddpjob, or to the job file")


def from_json(text: str, source: str = "config.json") -> JobConfig:
    return from_dict(json.loads(text), source)


def read_run_config(run_dir: str | Path) -> JobConfig:
    p = Path(run_dir) / "config.json"
    try:
        return from_json(p.read_text(encoding="utf-8"), str(p))
    except FileNotFoundError:
        raise UsageError(f"'{run_dir}' has no config.json, expected a ddpjob run directory",
                         "pass a job file (TOML) or a run dir made by `ddpjob submit`") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise UsageError(f"{p} is not valid JSON ({exc}), expected the config written by ddpjob",
                         "the run dir is damaged; resubmit") from None
    except OSError as exc:
        raise UsageError(f"cannot read {p} ({exc.strerror}), expected a readable config.json",
                         "check the run dir's permissions") from None
