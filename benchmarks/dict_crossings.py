"""How many lines of ``autotune/`` hold ``dict[str, Any]``, per 1,000 lines: the records that cross the layers as
string-keyed dicts instead of typed, frozen records (``docs/contracts.md``: plain data only where stored).

    python benchmarks/dict_crossings.py             # the figure for autotune/
    python benchmarks/dict_crossings.py --max 6     # exit 1 when the figure is above 6 per 1,000 lines
    python benchmarks/dict_crossings.py --by-file   # the files holding most of them, first

A line counts once however many times it names the type; every line of every ``.py`` file counts toward the
total (blank and comment lines included, as ``wc -l`` counts them).
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from pathlib import Path

PATTERN = "dict[str, Any]"
ROOT = Path(__file__).resolve().parents[1] / "autotune"


@dataclass(frozen=True)
class Count:
    """Lines that hold ``PATTERN``, all lines, and per file the lines that hold it."""

    hits: int
    lines: int
    by_file: tuple[tuple[str, int], ...]

    @property
    def per_1000(self) -> float:
        return 1000.0 * self.hits / self.lines if self.lines else 0.0


def count(root: Path = ROOT) -> Count:
    """Count ``PATTERN`` lines in every ``.py`` file under ``root`` (caches skipped)."""
    hits = lines = 0
    by_file: list[tuple[str, int]] = []
    for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        text = path.read_text(encoding="utf-8").splitlines()
        found = sum(1 for line in text if PATTERN in line)
        hits, lines = hits + found, lines + len(text)
        if found:
            by_file.append((str(path.relative_to(root.parent)), found))
    return Count(hits, lines, tuple(sorted(by_file, key=lambda f: (-f[1], f[0]))))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the package to count (default: autotune/)")
    parser.add_argument("--max", type=float, help="exit 1 when the figure per 1,000 lines is above this")
    parser.add_argument("--by-file", action="store_true", help="also list the files, most lines first")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"Error: {args.root}: no such folder (pass --root with the package to count)", file=sys.stderr)
        return 2
    c = count(args.root)
    print(f"{PATTERN}: {c.hits} lines of {c.lines:,} in {args.root.name}/ = {c.per_1000:.1f} per 1,000 lines")
    if args.by_file:
        for name, n in c.by_file:
            print(f"  {n:4d}  {name}")
    if args.max is not None and c.per_1000 > args.max:
        print(f"above --max {args.max:g} per 1,000 lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
