"""The package layout's two rules: the login side (cli, config, launch/) never imports torch at
import time, and every torch.distributed collective is called from ddpjob/node/dist.py only."""

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


def test_collectives_only_in_node_dist() -> None:
    offenders = {}
    seen_in_dist = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE.parent).as_posix()
        found = collective_calls(path.read_text(encoding="utf-8"))
        if rel == "ddpjob/node/dist.py":
            seen_in_dist = found
        elif found:
            offenders[rel] = found
    assert offenders == {}, f"collectives outside ddpjob/node/dist.py: {offenders}"
    assert seen_in_dist, "the finder found no collective in ddpjob/node/dist.py: it is broken"
