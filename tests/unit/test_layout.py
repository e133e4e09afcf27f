"""The package layout's rules: the login side (cli, config, launch/) never imports torch at
import time, every torch.distributed collective is called from ddpjob/node/dist.py and its two
siblings only (gradsync.py: the gradients; modelsync.py: a model's whole state), and
the packages import down the layer order (shared -> ledger -> node -> store -> rank -> face ->
train),
never in a circle."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import ddpjob

PACKAGE = Path(ddpjob.__file__).resolve().parent
COLLECTIVES = {"all_reduce", "all_reduce_coalesced", "all_reduce_multigpu", "broadcast",
               "broadcast_object_list", "all_gather", "all_gather_object", "all_gather_into_tensor",
               "gather", "gather_object", "scatter", "scatter_object_list", "reduce", "reduce_scatter",
               "reduce_scatter_tensor", "all_to_all", "all_to_all_single", "barrier",
               "monitored_barrier", "new_group", "new_subgroups", "send", "recv", "isend", "irecv",
               "batch_isend_irecv"}

LOGIN_SIDE = """
import importlib, pkgutil, sys
import ddpjob.cli, ddpjob.config, ddpjob.launch
names = [m.name for m in pkgutil.iter_modules(ddpjob.launch.__path__, "ddpjob.launch.")]
assert len(names) >= 8, names
for name in names:
    importlib.import_module(name)
    assert "torch" not in sys.modules, f"importing {name} imported torch"
print(len(names))
"""


def test_login_side_never_imports_torch() -> None:
    out = subprocess.run([sys.executable, "-c", LOGIN_SIDE], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert int(out.stdout.split()[-1]) >= 8


def _distributed_names(tree: ast.AST) -> set[str]:
    """Local names bound to torch.distributed or one of its submodules."""
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name.startswith("torch.distributed") and a.asname:
                    names.add(a.asname)
        elif isinstance(node, ast.ImportFrom) and node.module:
            for a in node.names:
                full = f"{node.module}.{a.name}"
                if full.startswith("torch.distributed") and a.name not in COLLECTIVES:
                    names.add(a.asname or a.name)
    return names


def _dotted(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    return "?"


def collective_calls(source: str) -> list[str]:
    """`line: what` for every torch.distributed collective the source names."""
    tree = ast.parse(source)
    aliases = _distributed_names(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("torch.distributed"):
            found += [f"{node.lineno}: from {node.module} import {a.name}"
                      for a in node.names if a.name in COLLECTIVES]
        elif isinstance(node, ast.Attribute) and node.attr in COLLECTIVES:
            owner = _dotted(node.value)
            if owner in aliases or owner.startswith("torch.distributed") or \
                    owner.split(".")[0] in aliases:
                found.append(f"{node.lineno}: {owner}.{node.attr}")
    return found


def test_collective_finder_sees_the_usual_spellings() -> None:
    src = ("import torch\nimport torch.distributed as tdist\nimport torch.distributed.nn.functional as fn\n"
           "from torch import distributed as d\nfrom torch.distributed import barrier\n"
           "tdist.all_reduce(x)\nfn.all_reduce(x)\nd.new_group()\ntorch.distributed.broadcast(x, 0)\n"
           "tdist.is_initialized()\n")
    assert sorted(collective_calls(src)) == [
        "5: from torch.distributed import barrier", "6: tdist.all_reduce", "7: fn.all_reduce",
        "8: d.new_group", "9: torch.distributed.broadcast"]


# The owners of ddpjob's collectives: the group's (dist.py), the gradients' (gradsync.py), a
# model's whole state's (modelsync.py).
OWNERS = ("ddpjob/node/dist.py", "ddpjob/node/gradsync.py", "ddpjob/node/modelsync.py")


def test_collectives_only_in_node_dist() -> None:
    offenders = {}
    seen = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        found = collective_calls(path.read_text(encoding="utf-8"))
        if rel in OWNERS:
            seen[rel] = found
        elif found:
            offenders[rel] = found
    assert offenders == {}, f"collectives outside {', '.join(OWNERS)}: {offenders}"
    for rel in OWNERS:
        assert seen.get(rel), f"the finder found no collective in {rel}: it is broken"


# ------------------------------------------------------------------ the layer order
# Lowest first; a module may import its own layer and the ones below it. shared = the modules
# at ddpjob/'s top (config, rundir, slurm, freeze, ...); face = ddpjob/__init__.py and api.py,
# the public API, which re-exports the rank layer for user scripts and the built-in trainer.
# integrations: the trainer callbacks a user's HF / Lightning program imports (node and shared only).
# launch (the login side) stands above all and never imports rank or face: it reaches the rank
# layer only by name (a module path in a script or a pickle).
LEVELS = {"shared": 0, "ledger": 1, "node": 2, "store": 3, "rank": 4, "face": 5, "train": 6, "integrations": 6,
          "launch": 7}
BY_NAME_ONLY = {("launch", "rank"), ("launch", "face")}
# Imports that break the order on purpose, at most 4, each with its reason.
ALLOWED = {
    # launch/submit.py's line that names train.entry at submission (entry.describe: the
    # built-in trainer's name); NodeTask (rank/task.py) is named by module path only
    ("ddpjob.launch.submit", "ddpjob.rank.entry"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _is_module(name: str) -> bool:
    where = PACKAGE.parent.joinpath(*name.split("."))
    return where.with_suffix(".py").is_file() or (where / "__init__.py").is_file()


def _target(name: str) -> str:
    """The ddpjob module that `name` (a module, or a name inside one) lives in."""
    parts = name.split(".")
    while len(parts) > 1 and not _is_module(".".join(parts)):
        parts.pop()
    return ".".join(parts)


def layer(module: str) -> str:
    parts = module.split(".")
    if module in ("ddpjob", "ddpjob.api"):
        return "face"
    if len(parts) > 2 or (PACKAGE / parts[1] / "__init__.py").is_file():
        return parts[1]
    return "shared"


def imports_of(source: str, module: str, is_package: bool = False) -> list[tuple[int, str]]:
    """(line, ddpjob module) for every import of ddpjob's, at module level and inside functions.
    The bare package counts as the face (`import ddpjob`, `from ddpjob import __version__`):
    its __init__ hands out the public API, so only the train layer (and user code) may import
    it; the version has a module of its own (ddpjob/version.py) for everyone else."""
    found = []
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the importing module's package
                anchor = module.split(".")[: len(module.split(".")) - node.level + (1 if is_package else 0)]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" for a in node.names]
        for name in names:
            if name == "ddpjob" or name.startswith("ddpjob."):
                found.append((node.lineno, _target(name)))
    return found


def import_graph() -> dict[str, set[str]]:
    """module -> the ddpjob modules it imports."""
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = _module_name(path)
        graph[module] = {t for _, t in imports_of(path.read_text(encoding="utf-8"), module,
                                                  path.name == "__init__.py")}
    return graph


def against_the_order(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    return {(a, b) for a, targets in graph.items() for b in targets
            if LEVELS[layer(a)] < LEVELS[layer(b)] or (layer(a), layer(b)) in BY_NAME_ONLY}


def package_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Layers that reach each other through imports (strongly connected, more than one)."""
    edges: dict[str, set[str]] = {}
    for a, targets in graph.items():
        for b in targets:
            if layer(a) != layer(b):
                edges.setdefault(layer(a), set()).add(layer(b))

    def reach(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for nxt in edges.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        return seen

    reached = {name: reach(name) for name in LEVELS}
    cycles = {frozenset({a} | {b for b in reached[a] if a in reached[b]}) for a in LEVELS if a in reached[a]}
    return sorted(sorted(c) for c in cycles)


def test_the_import_finder_sees_function_level_and_relative_imports() -> None:
    src = ("import os\nimport ddpjob\nfrom ddpjob import config, __version__\n"
           "def f():\n    from ddpjob.node import dist\n    import ddpjob.rank.runner as r\n"
           "from .records import MetricLog\nfrom ddpjob.node.cluster import ClusterEnv\n")
    assert imports_of(src, "ddpjob.rank.job") == [
        (2, "ddpjob"), (3, "ddpjob.config"), (3, "ddpjob"), (7, "ddpjob.rank.records"),
        (8, "ddpjob.node.cluster"), (5, "ddpjob.node.dist"), (6, "ddpjob.rank.runner")]
    assert [layer(m) for m in ("ddpjob", "ddpjob.api", "ddpjob.slurm", "ddpjob.node.dist",
                               "ddpjob.rank", "ddpjob.launch.submit")] == [
        "face", "face", "shared", "node", "rank", "launch"]
    graph = {"ddpjob.node.x": {"ddpjob.store.y"}, "ddpjob.store.y": {"ddpjob.node.z"},
             "ddpjob.launch.a": {"ddpjob.rank.b"}, "ddpjob.train.t": {"ddpjob.api"}}
    assert package_cycles(graph) == [["node", "store"]]
    assert against_the_order(graph) == {("ddpjob.node.x", "ddpjob.store.y"),
                                        ("ddpjob.launch.a", "ddpjob.rank.b")}


def test_layers_import_downward_only() -> None:
    """shared -> ledger -> node -> store -> rank -> face -> train, launch beside them on the login side:
    no package imports one that imports it back, and nothing imports up the order beyond
    ALLOWED (which may only shrink: each entry is a debt)."""
    assert len(ALLOWED) <= 4
    graph = import_graph()
    assert {"ddpjob.rank.job", "ddpjob.node.dist", "ddpjob.launch.submit"} <= set(graph), \
        "the finder missed modules: it is broken"
    assert package_cycles(graph) == [], "packages that import each other"
    upward = against_the_order(graph)
    assert upward - ALLOWED == set(), "imports against the layer order (shared -> node -> store -> " \
        "rank -> face -> train; launch reaches rank by name only)"
    assert ALLOWED - upward == set(), "ALLOWED names imports that are gone: drop them"
