"""Code-shape limits: no function over 50 statements in the layers that run trials, no module over 350.

Long functions in ``sglang/``, ``harness/`` and ``search/`` are where behaviour hides; long modules anywhere
mean a module does more than one job (``docs/contracts.md`` gives each module one). The limits count logical
lines (Python's NEWLINE tokens: a statement however the formatter wraps it, a docstring as one), so ``ruff
format`` does not move them; they are what 60 and 450 physical lines allowed before the code was formatted.
"""

from __future__ import annotations

import ast
import io
import textwrap
import tokenize
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "autotune"
FUNCTION_LIMIT = 50  # logical lines, ``def`` through the end of the body
FUNCTION_DIRS = ("sglang", "harness", "search")
MODULE_LIMIT = 350  # logical lines


def _modules(root: Path) -> list[Path]:
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def logical_lines(source: str) -> int:
    return sum(1 for t in tokenize.generate_tokens(io.StringIO(source).readline) if t.type == tokenize.NEWLINE)


def test_logical_lines_ignore_how_a_statement_is_wrapped() -> None:
    assert logical_lines("x = f(1, 2)\n") == logical_lines("x = f(\n    1,\n    2,\n)\n") == 1
    assert logical_lines('"""one\ndocstring"""\n\n# a comment\ny = 2\n') == 2


def test_no_function_over_limit() -> None:
    long = []
    for folder in FUNCTION_DIRS:
        for path in _modules(PACKAGE / folder):
            text = path.read_text(encoding="utf-8")
            lines = text.splitlines(keepends=True)
            for node in ast.walk(ast.parse(text, filename=str(path))):
                if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    first = min([node.lineno, *(d.lineno for d in node.decorator_list)])
                    body = textwrap.dedent("".join(lines[first - 1 : node.end_lineno]))
                    count = logical_lines(body)
                    if count > FUNCTION_LIMIT:
                        long.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({count})")
    assert not long, f"functions over {FUNCTION_LIMIT} logical lines:\n" + "\n".join(long)


def test_no_module_over_limit() -> None:
    long = []
    for path in _modules(PACKAGE):
        count = logical_lines(path.read_text(encoding="utf-8"))
        if count > MODULE_LIMIT:
            long.append(f"{path.relative_to(PACKAGE.parent)} ({count})")
    assert not long, f"modules over {MODULE_LIMIT} logical lines:\n" + "\n".join(long)


def test_limits_see_the_package() -> None:
    """A wrong path would make both checks pass vacuously."""
    for folder in FUNCTION_DIRS:
        assert _modules(PACKAGE / folder), folder
    assert logical_lines((PACKAGE / "search" / "study.py").read_text(encoding="utf-8")) > 100
