"""Code-shape limits: no function over 60 lines in the layers that run trials, no module over 450 lines.

Long functions in ``sglang/``, ``harness/`` and ``search/`` are where behaviour hides; long modules anywhere
mean a module does more than one job (``docs/contracts.md`` gives each module one).
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
FUNCTION_LIMIT = 60  # lines, ``def`` through the last line of the body
FUNCTION_DIRS = ("sglang", "harness", "search")
MODULE_LIMIT = 450  # lines


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def test_no_function_over_limit() -> None:
    long = []
    for folder in FUNCTION_DIRS:
        for path in _modules(PACKAGE / folder):
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    lines = (node.end_lineno or node.lineno) - node.lineno + 1
                    if lines > FUNCTION_LIMIT:
                        long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({lines} lines)")
    assert not long, f"functions over {FUNCTION_LIMIT} lines:\n" + "\n".join(long)


def test_no_module_over_limit() -> None:
    long = []
    for path in _modules(PACKAGE):
        lines = len(path.read_text(encoding="utf-8").splitlines())
        if lines > MODULE_LIMIT:
            long.append(f"{path.relative_to(PACKAGE.parent)} ({lines} lines)")
    assert not long, f"modules over {MODULE_LIMIT} lines:\n" + "\n".join(long)


def test_limits_see_the_package() -> None:
    """A wrong path would make both checks pass vacuously."""
    for folder in FUNCTION_DIRS:
        assert _modules(PACKAGE / folder), folder
