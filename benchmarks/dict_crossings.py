"""How many lines of ``autotune/`` hold ``dict[str, Any]``, per 1,000 lines: the records that cross the layers as
string-keyed dicts instead of typed, frozen records (``docs/contracts.md``: plain data only where stored).

    python benchmarks/dict_crossings.py                 # the figure for autotune/
    python benchmarks/dict_crossings.py --max 6         # exit 1 when the figure is above 6 per 1,000 lines
    python benchmarks/dict_crossings.py --max-records 6 # the same for the records figure (below)
    python benchmarks/dict_crossings.py --by-file       # the files holding most of them, first

A line counts once however many times it names the type; every line of every ``.py`` file counts toward the
total (blank and comment lines included, as ``wc -l`` counts them).

Of those lines, two kinds are plain data by nature and are counted apart (the first figure still counts them):

- storage conversions: the ``def`` line of a ``to_dict`` / ``from_dict`` method, a typed record's conversion to
  and from the plain data it is stored as (Optuna user attributes, ``result.json``, ``--json``);
- free-form mappings: a line on which every ``dict[str, Any]`` annotates a name in ``FREE_FORM`` — data whose
  keys another program defines (SGLang's flags by dest name, a model's ``config.json``, an HTTP body or
  ``/server_info``, keyword arguments handed to a library), not a record of ours.

The rest is the records figure: string-keyed dicts standing where a typed record could.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

PATTERN = "dict[str, Any]"
ROOT = Path(__file__).resolve().parents[1] / "autotune"
# Names whose mapping is free-form by nature, each for the reason given (see the module docstring).
FREE_FORM = {
    "config": "SGLang's flags by dest name (or a model's config.json)",
    "flags": "SGLang's flags by dest name",
    "server_args": "SGLang's server args by dest name",
    "args": "SGLang's server args by dest name",
    "env": "environment variables for the server",
    "sim_options": "the simulator's options, passed through",
    "body": "an HTTP request body",
    "info": "a server's /server_info JSON, or a progress event's fields",
    "server_info": "a server's /server_info JSON",
    "usage": "an OpenAI usage block",
    "kwargs": "keyword arguments handed to a library",
    "options": "keyword arguments handed to a library",
    "doc": "a TOML document being written",
    "raw": "a TOML table as read, before validation",
}
ANNOTATED = re.compile(r"\b(\w+): dict\[str, Any\]")
CONVERSION = re.compile(r"\bdef (to_dict|from_dict)\(")


def kind(line: str) -> str:
    """``conversion``, ``free-form`` or ``record`` for a line holding ``PATTERN`` (the rules: module docstring)."""
    if CONVERSION.search(line):
        return "conversion"
    names = ANNOTATED.findall(line)
    if names and len(names) == line.count(PATTERN) and all(n in FREE_FORM for n in names):
        return "free-form"
    return "record"


@dataclass(frozen=True)
class Count:
    """Lines that hold ``PATTERN``, all lines, per file the lines that hold it, and how many of them are storage
    conversions and free-form mappings (the rest: ``records``)."""

    hits: int
    lines: int
    by_file: tuple[tuple[str, int], ...]
    conversions: int = 0
    free_form: int = 0

    @property
    def per_1000(self) -> float:
        return 1000.0 * self.hits / self.lines if self.lines else 0.0

    @property
    def records(self) -> int:
        return self.hits - self.conversions - self.free_form

    @property
    def records_per_1000(self) -> float:
        return 1000.0 * self.records / self.lines if self.lines else 0.0


def count(root: Path = ROOT) -> Count:
    """Count ``PATTERN`` lines in every ``.py`` file under ``root`` (caches skipped)."""
    hits = lines = 0
    kinds = {"conversion": 0, "free-form": 0, "record": 0}
    by_file: list[tuple[str, int]] = []
    for path in sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts):
        text = path.read_text(encoding="utf-8").splitlines()
        found = [line for line in text if PATTERN in line]
        for line in found:
            kinds[kind(line)] += 1
        hits, lines = hits + len(found), lines + len(text)
        if found:
            by_file.append((str(path.relative_to(root.parent)), len(found)))
    return Count(
        hits,
        lines,
        tuple(sorted(by_file, key=lambda f: (-f[1], f[0]))),
        conversions=kinds["conversion"],
        free_form=kinds["free-form"],
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=ROOT, help="the package to count (default: autotune/)")
    parser.add_argument("--max", type=float, help="exit 1 when the figure per 1,000 lines is above this")
    parser.add_argument(
        "--max-records", type=float, help="exit 1 when the records figure per 1,000 lines is above this"
    )
    parser.add_argument("--by-file", action="store_true", help="also list the files, most lines first")
    args = parser.parse_args(argv)
    if not args.root.is_dir():
        print(f"Error: {args.root}: no such folder (pass --root with the package to count)", file=sys.stderr)
        return 2
    c = count(args.root)
    print(f"{PATTERN}: {c.hits} lines of {c.lines:,} in {args.root.name}/ = {c.per_1000:.1f} per 1,000 lines")
    print(f"  of which storage conversions (to_dict/from_dict): {c.conversions}, free-form mappings: {c.free_form}")
    print(f"records: {c.records} lines = {c.records_per_1000:.1f} per 1,000 lines")
    if args.by_file:
        for name, n in c.by_file:
            print(f"  {n:4d}  {name}")
    if args.max is not None and c.per_1000 > args.max:
        print(f"above --max {args.max:g} per 1,000 lines", file=sys.stderr)
        return 1
    if args.max_records is not None and c.records_per_1000 > args.max_records:
        print(f"records above --max-records {args.max_records:g} per 1,000 lines", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
