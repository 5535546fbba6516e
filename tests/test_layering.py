"""The package's imports point down its layers, and nothing but the sim engine reaches into the simulator.

Walks every module's imports with ``ast`` (module level and inside functions alike) and fails on an import
that points up a layer, on a circle between the packages, on a lazy import that is not for a heavy optional
dependency, and on any import of ``autotune.sim`` outside the simulator, its engine and the benchmarks.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "autotune"

# Lower layers never import higher ones. ``prompts`` reads the prompt file for both config (its check) and the
# harness (its replay); it depends on ``errors`` only.
LAYERS: dict[str, int] = {
    "errors": 0,
    "results": 0,
    "progress": 0,
    "redaction": 0,
    "tomlwrite": 0,
    "prompts": 0,
    "settle": 0,
    "job": 0,
    "tls": 0,
    "sglang": 1,
    "config": 2,
    "launch": 3,  # WHERE a server runs: below the harness (trial) and deploy (fleet), which start servers through it
    "harness": 4,
    "search": 5,
    "report": 6,
    "deploy": 6,
    "inspect": 6,
    "watch": 7,  # compares a live fleet (inspect's probe) with the deployed winner (deploy's load_winner)
    "cli": 8,
}
# The simulator is its own program: SGLang's model and the bottom layer only.
SIM_MAY_IMPORT = {"sim", "sglang", "errors", "results", "progress", "redaction", "tomlwrite", "prompts", "settle"}
# Imports among the packages of one layer, each with its reason (none today).
SIDEWAYS: set[tuple[str, str]] = set()
# The only modules outside ``autotune/sim/`` that may import ``autotune.sim``.
SIM_DOORS = {"autotune/harness/engines/sim.py"}
# In-function imports are for heavy optional dependencies only (and the CLI's lazy command registry), each with
# a comment on its line saying why.
LAZY_OK = {"plotly", "asyncssh", "pynvml", "importlib", "tokenizers"}
# Modules still being written when this test landed (the numerics guard): their lazy imports are hoisted when
# they land. Remove an entry once its module passes.
PENDING_LAZY = {"autotune/deploy/numerics.py", "autotune/deploy/apply.py", "autotune/search/numerics.py"}
# ``search/`` shows its parts, each importing only the parts below it: ``storage/`` (URL → storage, liveness, the
# disk guard) < the study loop (its modules named here, so a new one is placed on purpose) < ``confirm/`` <
# ``views/`` (read-models for cli, report, deploy: they read what the loop and the confirmation stored) <
# ``sweep.py`` (run_sweep). ``scaleout/`` (workers, Slurm workers) sits on the loop beside the confirmation and
# the views; only its command in ``cli/`` imports it.
SEARCH_PARTS: dict[str, int] = {"storage": 0, "loop": 1, "confirm": 2, "views": 3, "scaleout": 3, "sweep": 4}
SEARCH_LOOP = {
    "study",
    "space",
    "starts",
    "edges",
    "correction",
    "objective",
    "runner",
    "seeding",
    "skips",
    "warm",
    "numerics",
    "folders",
    "preflight",
    "signals",
    "stopping",
    "pruning",
    "wall",
}


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _name(path: Path, root: Path = ROOT) -> str:
    rel = path.relative_to(root).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, root: Path = ROOT) -> list[tuple[str, int, bool]]:
    """(imported module, line, inside a function) for every import in ``path``; relative ones resolved."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    here = _name(path, root).split(".")
    if path.name != "__init__.py":
        here = here[:-1]
    out: list[tuple[str, int, bool]] = []

    def visit(node: ast.AST, nested: bool, guarded: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = nested or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            typing_only = guarded or (isinstance(child, ast.If) and "TYPE_CHECKING" in ast.unparse(child.test))
            if isinstance(child, ast.Import):
                out.extend((alias.name, child.lineno, inner) for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    base = ".".join(here[: len(here) - child.level + 1] + ([base] if base else []))
                out.append((base, child.lineno, inner))
                out.extend((f"{base}.{alias.name}", child.lineno, inner) for alias in child.names)
            visit(child, inner, typing_only)

    visit(tree, False, False)
    return out


def _unit(module: str) -> str | None:
    """``autotune.search.study`` → ``search``; ``autotune.errors`` → ``errors``; outside autotune → None."""
    parts = module.split(".")
    if parts[0] != "autotune" or len(parts) < 2:
        return None
    return parts[1]


def _is_module(module: str) -> bool:
    rel = Path(*module.split("."))
    return (ROOT / rel.with_suffix(".py")).is_file() or (ROOT / rel / "__init__.py").is_file()


def _edges() -> list[tuple[str, str, str, int, bool]]:
    """(from unit, to unit, file, line, lazy) for every import between two units of the package."""
    edges = []
    for path in _modules():
        src = _unit(_name(path))
        for module, line, lazy in _imports(path):
            dst = _unit(module)
            if src is None or dst is None or not _is_module(module):
                continue
            edges.append((src, dst, str(path.relative_to(ROOT)), line, lazy))
    return edges


def test_every_unit_has_a_layer():
    units = {_unit(_name(p)) for p in _modules()} - {None, "sim", "__main__", "data"}
    assert units <= set(LAYERS), f"modules outside the layer table: {sorted(units - set(LAYERS))}"


def test_imports_point_down():
    bad = []
    for src, dst, where, line, _ in _edges():
        if src == dst or src == "sim" or dst == "sim" or src == "__main__":
            continue
        sideways = LAYERS[dst] == LAYERS[src] and LAYERS[src] > 0 and (src, dst) not in SIDEWAYS
        if LAYERS[dst] > LAYERS[src] or sideways:
            bad.append(f"{where}:{line}: {src} (layer {LAYERS[src]}) imports {dst} (layer {LAYERS[dst]})")
    assert not bad, "imports that point up or sideways:\n" + "\n".join(bad)


def test_no_circle_between_packages_or_modules_of_deploy():
    graph: dict[str, set[str]] = {}
    for path in _modules():
        name = _name(path)
        for module, _, _ in _imports(path):
            if module.startswith("autotune.") and _is_module(module) and module != name:
                graph.setdefault(name, set()).add(module)
    units: dict[str, set[str]] = {}
    for src, dsts in graph.items():
        for dst in dsts:
            a, b = _unit(src), _unit(dst)
            if a and b and a != b:
                units.setdefault(a, set()).add(b)
    deploy = {
        k: {d for d in v if d.startswith("autotune.deploy.")}
        for k, v in graph.items()
        if k.startswith("autotune.deploy.")
    }
    for name, edges in (("packages", units), ("deploy's modules", deploy)):
        cycle = _find_cycle(edges)
        assert cycle is None, f"a circle between {name}: {' -> '.join(cycle or [])}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def dfs(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (found := dfs(nxt)):
                return found
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (found := dfs(node)):
            return found
    return None


def test_the_simulator_is_reached_only_through_its_engine():
    bad = []
    for path in [*_modules(), *sorted((ROOT / "benchmarks").glob("*.py"))]:
        rel = str(path.relative_to(ROOT))
        if rel.startswith(("autotune/sim/", "benchmarks/")) or rel in SIM_DOORS:
            continue
        bad += [
            f"{rel}:{line}: imports {m}"
            for m, line, _ in _imports(path)
            if m == "autotune.sim" or m.startswith("autotune.sim.")
        ]
    assert not bad, "imports of autotune.sim outside its engine:\n" + "\n".join(bad)


def test_the_simulator_imports_only_sglang_and_the_bottom_layer():
    bad = [
        f"{where}:{line}: sim imports {dst}"
        for src, dst, where, line, _ in _edges()
        if src == "sim" and dst not in SIM_MAY_IMPORT
    ]
    assert not bad, "\n".join(bad)


def test_lazy_imports_are_for_heavy_optional_dependencies_only():
    bad = []
    for path in _modules():
        rel = str(path.relative_to(ROOT))
        if rel.startswith("autotune/sim/") or rel in PENDING_LAZY:
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for module, line, lazy in _imports(path):
            top = module.split(".")[0]
            if not lazy or module in ("", "__future__"):
                continue
            if top not in LAZY_OK:
                bad.append(f"{rel}:{line}: {module}")
            elif top != "importlib" and "#" not in lines[line - 1]:
                bad.append(f"{rel}:{line}: {module} (say why it is lazy in a comment on the line)")
    bad = sorted(set(bad))
    assert not bad, "in-function imports of light or internal modules (hoist them):\n" + "\n".join(bad)


def test_the_walker_sees_imports_inside_functions_and_resolves_relative_ones(tmp_path):
    source = tmp_path / "autotune" / "search" / "x.py"
    source.parent.mkdir(parents=True)
    source.write_text(
        "import os\nfrom . import space\n\ndef f():\n    from autotune.deploy import apply\n", encoding="utf-8"
    )
    found = {(m, lazy) for m, _, lazy in _imports(source, tmp_path)}
    assert {("os", False), ("autotune.search.space", False), ("autotune.deploy.apply", True)} <= found


def test_watch_sits_above_inspect_and_deploy_below_the_cli_with_no_lazy_allowance():
    assert LAYERS["inspect"] < LAYERS["watch"] < LAYERS["cli"] and LAYERS["deploy"] < LAYERS["watch"]
    uses = {dst for src, dst, *_ in _edges() if src == "watch"}
    assert {"inspect", "deploy"} <= uses  # the reason for its layer: both are read, neither reads watch
    assert not {dst for src, dst, *_ in _edges() if dst == "watch" and src not in ("watch", "cli")}
    assert not [m for m in PENDING_LAZY if "/watch" in m]


def test_launch_sits_between_config_and_the_harness_and_both_starters_use_it():
    """WHERE a server runs is below the trial and the fleet, which start servers through it, and above config."""
    assert LAYERS["config"] < LAYERS["launch"] < LAYERS["harness"] < LAYERS["deploy"]
    uses = {src for src, dst, *_ in _edges() if dst == "launch" and src != "launch"}
    assert {"harness", "deploy"} <= uses
    assert not {dst for src, dst, *_ in _edges() if src == "launch"} - {
        "launch",
        "errors",
        "redaction",
        "config",
        "tls",
    }


def _search_part(module: str) -> str | None:
    """``autotune.search.confirm.noise`` → ``confirm``; ``autotune.search.study`` → ``loop``; elsewhere None."""
    parts = module.split(".")
    if parts[:2] != ["autotune", "search"] or len(parts) < 3:
        return None
    if parts[2] in SEARCH_PARTS:
        return parts[2]
    return "loop" if parts[2] in SEARCH_LOOP else f"unplaced:{parts[2]}"


def test_every_search_module_is_in_one_part():
    unplaced = sorted({part for p in _modules() if (part := _search_part(_name(p))) and part.startswith("unplaced")})
    assert not unplaced, f"search modules in no part (add to SEARCH_LOOP or a package): {unplaced}"
    assert {_search_part(_name(p)) for p in _modules()} >= set(SEARCH_PARTS)


def test_the_parts_of_search_import_down():
    bad = []
    for path in _modules():
        src = _search_part(_name(path))
        for module, line, _ in _imports(path):
            dst = _search_part(module)
            if src is None or dst is None or src == dst or not _is_module(module):
                continue
            if SEARCH_PARTS[dst] >= SEARCH_PARTS[src]:
                bad.append(f"{path.relative_to(ROOT)}:{line}: search/{src} imports search/{dst}")
    assert not bad, "imports between the parts of search/ that point up or sideways:\n" + "\n".join(bad)


def test_scale_out_is_started_by_its_command_only_and_search_has_no_command_line():
    users = {
        str(path.relative_to(ROOT))
        for path in _modules()
        if _unit(_name(path)) != "search" and any(m.startswith("autotune.search.scaleout") for m, *_ in _imports(path))
    }
    assert users and all(where.startswith("autotune/cli/") for where in users), users
    for path in (PACKAGE / "search").rglob("*.py"):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        assert not [m for m, *_ in _imports(path) if m.split(".")[0] == "click"], f"{path}: argument parsing is cli/'s"
        assert not [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == "main"], path
        assert "__main__" not in ast.unparse(tree), f"{path}: a second entry point"


def test_the_walker_places_search_modules_in_their_part():
    assert _search_part("autotune.search.storage.liveness") == "storage"
    assert _search_part("autotune.search.runner") == "loop"
    assert _search_part("autotune.search.sweep") == "sweep"
    assert _search_part("autotune.search.newthing") == "unplaced:newthing"
    assert _search_part("autotune.harness.trial") is None


def test_no_circle_between_any_two_modules_type_checking_imports_included():
    """A type two modules share lives below both: no module imports one that imports it back, however indirectly
    (a package's ``__init__`` re-exporting its modules is a namespace here, not a module)."""
    packages = {_name(p) for p in _modules() if p.name == "__init__.py"}
    graph: dict[str, set[str]] = {}
    for path in _modules():
        name = _name(path)
        for module, _, _ in _imports(path):
            if module.startswith("autotune.") and _is_module(module) and module != name and module not in packages:
                graph.setdefault(name, set()).add(module)
    cycle = _find_cycle(graph)
    assert cycle is None, f"an import circle: {' -> '.join(cycle or [])}"
