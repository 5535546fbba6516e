"""Where the test suite's time goes: seconds per test file from pytest's JUnit XML, one run or two side by side.

    python -m pytest -q --junitxml=after.xml
    python benchmarks/suite_durations.py after.xml                 # seconds per file, slowest first
    python benchmarks/suite_durations.py before.xml after.xml      # a Markdown table: before, after, ratio

A file's seconds are the sum of its tests' setup, call and teardown times as pytest measured them. With several
workers (pytest-xdist) the files run side by side, so their sum exceeds the run's wall clock; the table's last
rows give both, and ``--wall`` names the wall-clock seconds of each run where known (pytest prints them).
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def per_file(path: Path) -> dict[str, tuple[float, int]]:
    """``{test file: (seconds, tests)}`` of one JUnit XML report."""
    seconds: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for case in ET.parse(path).getroot().iter("testcase"):
        name = (case.get("classname") or "?").split(".")[-1]
        seconds[name] += float(case.get("time") or 0.0)
        counts[name] += 1
    return {name: (seconds[name], counts[name]) for name in seconds}


def table(before: dict[str, tuple[float, int]], after: dict[str, tuple[float, int]]) -> list[str]:
    """Markdown rows: every file of either run, slowest-before first, with the after/before ratio."""
    rows = ["| test file | tests | before (s) | after (s) | after / before |", "|---|---:|---:|---:|---:|"]
    names = sorted(set(before) | set(after), key=lambda n: (-before.get(n, (0.0, 0))[0], n))
    for name in names:
        b, a = before.get(name), after.get(name)
        ratio = f"{a[0] / b[0]:.2f}" if a and b and b[0] > 0 else "–"
        rows.append(
            f"| `{name}.py` | {(a or b)[1]} | {f'{b[0]:.1f}' if b else '–'} | {f'{a[0]:.1f}' if a else '–'} | {ratio} |"
        )
    total_b, total_a = (sum(s for s, _ in run.values()) for run in (before, after))
    rows.append(
        f"| **all files (sum of test times)** | {sum(n for _, n in after.values())} | {total_b:.0f} "
        f"| {total_a:.0f} | {total_a / total_b:.2f} |"
    )
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=Path, help="one JUnit XML report, or two: before and after")
    parser.add_argument("--wall", nargs="+", type=float, default=None, help="the runs' wall-clock seconds")
    args = parser.parse_args(argv)
    if len(args.reports) > 2:
        parser.error("give one report, or two (before and after)")
    runs = [per_file(path) for path in args.reports]
    if len(runs) == 1:
        for name, (seconds, count) in sorted(runs[0].items(), key=lambda kv: -kv[1][0]):
            print(f"{seconds:8.1f} s {count:5d} tests  {name}.py")
        print(f"{sum(s for s, _ in runs[0].values()):8.1f} s {sum(n for _, n in runs[0].values()):5d} tests  in all")
    else:
        print("\n".join(table(*runs)))
    if args.wall:
        print("\nwall clock: " + " → ".join(f"{s:.0f} s" for s in args.wall))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
