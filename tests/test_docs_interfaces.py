"""The pages that name an interface name all of it: docs/contracts.md's rows list every member of the engine and
runner Protocols, and every status a trial can end with is explained somewhere in docs/."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

from autotune.harness.engines.base import Engine, EngineClass, InstalledSGLang, Predictor
from autotune.results import STATUSES
from autotune.search.runner import RepeatingRunner, SweepRunner

DOCS = Path(__file__).resolve().parents[1] / "docs"
CONTRACTS = (DOCS / "contracts.md").read_text(encoding="utf-8")


def members(protocol: Any) -> set[str]:
    """A Protocol's own attributes and methods (annotations included), not typing's machinery."""
    return set(getattr(protocol, "__annotations__", {})) | {n for n in vars(protocol) if not n.startswith("_")}


def row(module: str) -> str:
    """The contracts table's row for ``module`` (the text between its first and last ``|``)."""
    found = [line for line in CONTRACTS.splitlines() if line.startswith(f"| `{module}`")]
    assert found, f"docs/contracts.md has no row for {module}"
    return found[0]


@pytest.mark.parametrize(
    ("module", "protocol"),
    [
        ("harness/engines/base.py", Engine),
        ("harness/engines/base.py", EngineClass),
        ("harness/engines/base.py", Predictor),
        ("harness/engines/base.py", InstalledSGLang),
        ("search/runner.py", RepeatingRunner),
        ("search/runner.py", SweepRunner),
    ],
)
def test_the_contracts_row_names_every_member(module, protocol):
    text = row(module)
    missing = sorted(m for m in members(protocol) if f"`{m}" not in text)
    assert not missing, f"docs/contracts.md's {module} row does not name {protocol.__name__}.{missing}"


def test_members_are_read_from_the_protocols():
    assert {"argv", "check", "device", "model_path", "shm_dir"} <= members(Engine)
    assert members(Predictor) == {"predict"} and "repeat" in members(RepeatingRunner)
    assert members(SweepRunner) == {"engine", "folder", "start"}


def test_every_status_is_explained_in_the_docs():
    text = "\n".join(p.read_text(encoding="utf-8") for p in DOCS.glob("*.md"))
    missing = [s for s in STATUSES if not re.search(rf"`{s}`", text)]
    assert not missing, f"statuses no page of docs/ names: {missing}"
