"""``benchmarks/suite_durations.py``: seconds per test file from pytest's JUnit XML, and a before/after table."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "suite_durations.py"
_spec = importlib.util.spec_from_file_location("suite_durations", SCRIPT)
durations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(durations)


def _report(path: Path, cases: list[tuple[str, float]]) -> Path:
    rows = "".join(
        f'<testcase classname="tests.{name}" name="t{i}" time="{seconds}"/>' for i, (name, seconds) in enumerate(cases)
    )
    path.write_text(f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>')
    return path


def test_seconds_add_up_per_file_and_the_table_gives_each_ratio(tmp_path, capsys):
    before = _report(tmp_path / "before.xml", [("test_a", 10.0), ("test_a", 30.0), ("test_b", 5.0)])
    after = _report(tmp_path / "after.xml", [("test_a", 4.0), ("test_a", 6.0), ("test_b", 5.0), ("test_c", 1.0)])
    assert durations.per_file(before) == {"test_a": (40.0, 2), "test_b": (5.0, 1)}

    assert durations.main([str(before), str(after), "--wall", "45", "12"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| `test_a.py` | 2 | 40.0 | 10.0 | 0.25 |"  # slowest before first
    assert out[3] == "| `test_b.py` | 1 | 5.0 | 5.0 | 1.00 |"
    assert out[4] == "| `test_c.py` | 1 | – | 1.0 | – |"  # new in the after run
    assert out[5] == "| **all files (sum of test times)** | 4 | 45 | 16 | 0.36 |"
    assert out[-1] == "wall clock: 45 s → 12 s"
