"""``autotune ARGS`` in the test's own process: the same command, exit code and output as ``python -m autotune``,
without a fresh interpreter importing the package for each call (about 1.5 CPU-seconds a call)."""

from __future__ import annotations

import dataclasses

import pytest

from autotune.cli import main


@dataclasses.dataclass(frozen=True)
class Ran:
    """What ``subprocess.run(..., capture_output=True, text=True)`` would have returned."""

    returncode: int
    stdout: str
    stderr: str


def run_cli(capsys: pytest.CaptureFixture[str], *args: str) -> Ran:
    """Run ``autotune ARGS`` through its entry point; stdout and stderr are this call's alone."""
    capsys.readouterr()  # what the test printed before is not this command's output
    try:
        main(list(args))
        code: object = 0
    except SystemExit as exc:
        code = exc.code
    out, err = capsys.readouterr()
    return Ran(returncode=code if isinstance(code, int) else (0 if code is None else 1), stdout=out, stderr=err)
