"""A reader of `#SBATCH` lines that behaves like sbatch's own (test helper).

sbatch scans the script line by line: `#SBATCH` (or the old `#SLURM`) at the very start of a
line holds options; any other line that is blank or a comment is skipped; the first other line
(a command) ends the scan. On an options line, whitespace splits arguments, ' and " group, a
backslash escapes the next character (inside quotes too), an unquoted # starts a comment, an
argument starting with ':' or an unmatched quote is fatal, and a line containing "packjob" or
"hetjob" starts another job component. getopt_long then accepts any unambiguous prefix of a
long option and short options with their argument attached or in the next word.
"""

from __future__ import annotations

# sbatch's long options (sbatch --help, Slurm 23/24) -> whether they take an argument.
_NO_ARG = {"contiguous", "exclusive", "get-user-env", "help", "hold", "ignore-pbs",
           "kill-on-invalid-dep", "no-kill", "no-requeue", "overcommit", "oversubscribe",
           "parsable", "quiet", "reboot", "requeue", "spread-job", "test-only", "usage",
           "use-min-nodes", "verbose", "version", "wait", "wait-all-nodes", "batch-only"}
_WITH_ARG = {"account", "acctg-freq", "array", "batch", "bb", "bbf", "begin", "chdir",
             "cluster-constraint", "clusters", "comment", "constraint", "container",
             "container-id", "core-spec", "cores-per-socket", "cpu-freq", "cpus-per-gpu",
             "cpus-per-task", "deadline", "delay-boot", "dependency", "distribution", "error",
             "exclude", "export", "export-file", "extra", "extra-node-info", "gid", "gpu-bind",
             "gpu-freq", "gpus", "gpus-per-node", "gpus-per-socket", "gpus-per-task", "gres",
             "gres-flags", "hint", "input", "job-name", "licenses", "mail-type", "mail-user",
             "mcs-label", "mem", "mem-bind", "mem-per-cpu", "mem-per-gpu", "mincpus", "network",
             "nice", "nodefile", "nodelist", "nodes", "ntasks", "ntasks-per-core",
             "ntasks-per-gpu", "ntasks-per-node", "ntasks-per-socket", "open-mode", "output",
             "partition", "power", "prefer", "priority", "profile", "propagate", "qos",
             "reservation", "resv-ports", "signal", "sockets-per-node", "switches",
             "thread-spec", "threads-per-core", "time", "time-min", "tmp", "tres-per-task",
             "uid", "wckey", "wrap"}
LONG = {**{o: False for o in _NO_ARG}, **{o: True for o in _WITH_ARG}}
SHORT = {"A": "account", "a": "array", "b": "begin", "B": "extra-node-info", "c": "cpus-per-task",
         "C": "constraint", "d": "dependency", "D": "chdir", "e": "error", "F": "nodefile",
         "G": "gpus", "h": "help", "H": "hold", "i": "input", "J": "job-name", "k": "no-kill",
         "L": "licenses", "m": "distribution", "M": "clusters", "n": "ntasks", "N": "nodes",
         "o": "output", "O": "overcommit", "p": "partition", "q": "qos", "Q": "quiet",
         "s": "oversubscribe", "S": "core-spec", "t": "time", "u": "usage", "v": "verbose",
         "V": "version", "w": "nodelist", "W": "wait", "x": "exclude"}


class SbatchError(ValueError):
    """What sbatch would refuse the script for (fatal parse error, unknown option...)."""


def arguments(script: str) -> list[str]:
    """The argv sbatch builds from the script's #SBATCH lines."""
    argv: list[str] = []
    for line in script.split("\n"):
        if line.startswith(("#SBATCH", "#SLURM")):
            rest = line[7:] if line.startswith("#SBATCH") else line[6:]
            if "packjob" in line.lower() or "hetjob" in line.lower():
                raise SbatchError(f"heterogeneous-job separator in {line!r}")
            argv += _split(rest, line)
            continue
        stripped = line.lstrip(" \t\r\v\f")
        if stripped and not stripped.startswith("#"):
            break  # the first command ends the scan
    return argv


def _split(rest: str, line: str) -> list[str]:
    out, i, n = [], 0, len(rest)
    while True:
        while i < n and rest[i].isspace():
            i += 1
        if i >= n:
            return out
        if rest[i] == ":":
            raise SbatchError(f"unexpected ':' in {line!r}")
        arg, quote, escape, started = [], "", False, False
        while i < n and (quote or not rest[i].isspace()):
            ch = rest[i]
            i += 1
            if escape:
                escape = False
            elif ch == "\\":
                escape = True
                continue
            elif quote:
                if ch == quote:
                    quote = ""
                    continue
            elif ch in "\"'":
                quote, started = ch, True
                continue
            elif ch == "#":
                i = n
                break
            arg.append(ch)
            started = True
        if quote:
            raise SbatchError(f"unmatched {quote} in {line!r}")
        if arg or started:
            out.append("".join(arg))


def resolve_long(name: str) -> str:
    """getopt_long: an exact name, else the one option `name` is a prefix of."""
    if name in LONG:
        return name
    hits = [o for o in LONG if o.startswith(name)]
    if len(hits) != 1:
        raise SbatchError(f"--{name} is {'ambiguous' if hits else 'unrecognized'}")
    return hits[0]


def options(script: str) -> list[tuple[str, str | None]]:
    """(full option name, value) for every option the #SBATCH lines set, in order."""
    argv, out, i = arguments(script), [], 0
    while i < len(argv):
        a = argv[i]
        i += 1
        if a.startswith("--"):
            name, eq, value = a[2:].partition("=")
            full = resolve_long(name)
            if LONG[full] and not eq:
                if i >= len(argv):
                    raise SbatchError(f"--{full} needs a value")
                value, i = argv[i], i + 1
            out.append((full, value if LONG[full] else None))
        elif a.startswith("-") and len(a) > 1 and a[1] in SHORT:
            full = SHORT[a[1]]
            value = a[2:] or None
            if LONG[full] and value is None:
                if i >= len(argv):
                    raise SbatchError(f"-{a[1]} needs a value")
                value, i = argv[i], i + 1
            out.append((full, value))
        else:
            raise SbatchError(f"not an option: {a!r}")  # getopt stops: sbatch rejects the rest
    return out
