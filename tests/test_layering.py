"""The layering the package keeps: engine <- chunk_plan <- planner <- cluster <- run and CLI.

The engine runs a plan and imports neither the planner nor Ray nor the cluster; the planner
searches one and imports no cluster, checkpoint or run-level API; checkpoints know nothing of the
cluster; and no two subpackages import each other, imports inside functions included. The graph
is read from the source with `ast`, so an import no test happens to run still counts.
"""

from __future__ import annotations

import ast
import os
import subprocess
import sys
from pathlib import Path


ROOT = Path(__file__).resolve().parent.parent

# unit -> the elixir_ray units it may import (ALLOWED), or may not (FORBIDDEN); a unit is a
# subpackage of elixir_ray (engine, planner, ...) or a top-level module (api, cli, ...)
ALLOWED = {
    "chunk_plan": {"chunk_plan", "units"},
    "engine": {"engine", "chunk_plan", "units"},
}
FORBIDDEN = {
    "planner": {"cluster", "checkpoint", "run"},
    "checkpoint": {"cluster"},
}
# unit -> outside packages it may not import
FORBIDDEN_OUTSIDE = {
    "chunk_plan": {"ray", "pyarrow"},
    "engine": {"ray", "pyarrow"},
    "planner": {"ray"},
}


def imports_of(path: Path, module: str) -> set[str]:
    """The absolute names `path` (the module `module`) imports, anywhere in it: at the top, inside
    functions and under `if`; relative imports resolved; `from a import b` as both `a` and `a.b`."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1])
                source = f"{base}.{node.module}" if node.module else base
            else:
                source = node.module
            found.add(source)
            found.update(f"{source}.{alias.name}" for alias in node.names)
    return found


def unit_of(name: str, package_dir: Path) -> str | None:
    """The unit of elixir_ray a module name belongs to ("elixir_ray.engine.wrap" -> "engine");
    None outside elixir_ray, and for the package's own __init__ (the lazy public names)."""
    parts = name.split(".")
    if parts[0] != "elixir_ray" or len(parts) < 2:
        return None
    if (package_dir / parts[1]).is_dir() or (package_dir / f"{parts[1]}.py").is_file():
        return parts[1]
    return None  # a public name of elixir_ray/__init__, resolved where it is defined


def import_graph(package_dir: Path) -> tuple[dict[str, set[str]], dict[str, set[str]]]:
    """(unit -> the elixir_ray units it imports, unit -> the outside top-level packages it imports),
    over every module under `package_dir` (the elixir_ray folder)."""
    inside: dict[str, set[str]] = {}
    outside: dict[str, set[str]] = {}
    for path in sorted(package_dir.rglob("*.py")):
        relative = path.relative_to(package_dir.parent).with_suffix("")
        module = ".".join(relative.parts[:-1] if relative.name == "__init__" else relative.parts)
        unit = unit_of(module, package_dir)
        if unit is None:
            continue
        for name in imports_of(path, module):
            target = unit_of(name, package_dir)
            if target is not None:
                if target != unit:
                    inside.setdefault(unit, set()).add(target)
            elif not name.startswith("elixir_ray"):
                outside.setdefault(unit, set()).add(name.split(".")[0])
    return inside, outside


def violations(inside: dict[str, set[str]], outside: dict[str, set[str]]) -> list[str]:
    """Each import the rules above refuse, as "unit imports target"."""
    found = []
    for unit, targets in sorted(inside.items()):
        if unit in ALLOWED:
            found += [f"{unit} imports {t}" for t in sorted(targets - ALLOWED[unit])]
        found += [f"{unit} imports {t}" for t in sorted(targets & FORBIDDEN.get(unit, set()))]
    for unit, names in sorted(outside.items()):
        found += [f"{unit} imports {n}" for n in sorted(names & FORBIDDEN_OUTSIDE.get(unit, set()))]
    return found


def subpackage_cycles(inside: dict[str, set[str]], package_dir: Path) -> list[list[str]]:
    """The import cycles between subpackages (folders of elixir_ray), each as the units around it,
    smallest first: a pair that imports each other is [a, b, a]."""
    packages = {u for u in inside if (package_dir / u).is_dir()} | {t for ts in inside.values() for t in ts
                                                                     if (package_dir / t).is_dir()}
    edges = {u: {t for t in inside.get(u, ()) if t in packages} for u in packages}
    cycles = []
    for start in sorted(packages):  # each cycle once, found from its smallest unit
        stack = [(start, [start])]
        while stack:
            unit, path = stack.pop()
            for target in sorted(edges[unit]):
                if target == start:
                    cycles.append(path + [start])
                elif target > start and target not in path:
                    stack.append((target, path + [target]))
    return sorted(cycles, key=len)


def test_the_subpackages_import_only_downwards():
    package_dir = ROOT / "elixir_ray"
    inside, outside = import_graph(package_dir)
    assert {"engine", "chunk_plan", "planner", "checkpoint", "cluster"} <= set(inside)  # the graph was read
    assert violations(inside, outside) == []
    assert subpackage_cycles(inside, package_dir) == []


def test_the_checker_finds_a_planted_violation_and_cycle_lazy_imports_included(tmp_path):
    """A copy of the rules' world with one engine module that imports the planner inside a
    function, and a planner module that imports the engine: both the rule and the cycle fail."""
    package_dir = tmp_path / "elixir_ray"
    for folder, name, text in [
        ("engine", "wrap.py", "import torch\n\ndef search():\n    from elixir_ray.planner.api import plan\n"),
        ("planner", "api.py", "from ..engine import wrap\nfrom elixir_ray.chunk_plan.plan import Plan\n"),
        ("chunk_plan", "plan.py", "import json\n"),
        ("checkpoint", "store.py", "def restore():\n    import ray\n    from elixir_ray.cluster import worker\n"),
        ("cluster", "worker.py", "import ray\nfrom elixir_ray.engine import wrap\n"),
    ]:
        (package_dir / folder).mkdir(parents=True, exist_ok=True)
        (package_dir / folder / "__init__.py").write_text("")
        (package_dir / folder / name).write_text(text)
    (package_dir / "api.py").write_text("import ray\n")
    inside, outside = import_graph(package_dir)
    assert inside["engine"] == {"planner"} and inside["planner"] == {"engine", "chunk_plan"}
    assert violations(inside, outside) == ["checkpoint imports cluster", "engine imports planner"]
    assert subpackage_cycles(inside, package_dir) == [["engine", "planner", "engine"]]
    # and an outside package the engine may not use
    (package_dir / "engine" / "wrap.py").write_text("def save():\n    import pyarrow.fs\n")
    inside, outside = import_graph(package_dir)
    assert violations(inside, outside) == ["checkpoint imports cluster", "engine imports pyarrow"]
    assert subpackage_cycles(inside, package_dir) == []


NO_RAY = """
import sys

class NoRay:
    '''Makes ray unimportable, as on a machine without it.'''

    def find_spec(self, name, path=None, target=None):
        if name == "ray" or name.startswith("ray."):
            raise ImportError(f"{name} is not installed here")
        return None

sys.meta_path.insert(0, NoRay())
"""


def _python(code: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", NO_RAY + code], capture_output=True, text=True, timeout=300,
                          cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})


def test_the_engine_and_the_planner_import_without_ray_pyarrow_or_the_run_level_packages():
    out = _python("""
import elixir_ray.chunk_plan
import elixir_ray.engine
loaded = sorted(m for m in sys.modules if m.split(".")[0] in ("pyarrow", "ray"))
assert not loaded, loaded
others = sorted(m for m in sys.modules if m.startswith("elixir_ray.")
                and m.split(".")[1] not in ("engine", "chunk_plan", "units"))
assert not others, others
import pkgutil
import elixir_ray.planner
for info in pkgutil.iter_modules(elixir_ray.planner.__path__, "elixir_ray.planner."):
    __import__(info.name)
import elixir_ray
assert callable(elixir_ray.wrap) and callable(elixir_ray.plan) and elixir_ray.Plan.__name__ == "Plan"
assert "ray" not in sys.modules
print("imported")
""")
    assert out.returncode == 0 and out.stdout.strip() == "imported", out.stderr
    refused = _python("import ray")  # the finder does make ray unimportable
    assert refused.returncode != 0 and "ray is not installed here" in refused.stderr


def test_the_public_options_are_keyword_only():
    import inspect

    import elixir_ray

    for fn, first in ((elixir_ray.wrap, ("module", "optimizer")), (elixir_ray.plan, ("module", "sample_inputs"))):
        params = list(inspect.signature(fn).parameters.values())
        assert tuple(p.name for p in params[:2]) == first
        assert all(p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD for p in params[:2])
        assert params[2:] and all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params[2:]), fn
