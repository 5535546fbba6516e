"""A config written for one SGLang version, in another version's flag and environment names: looked up by dest or
alias only, renamed where one successor is known, else dropped with one line saying so. docs/search.md ("Re-tuning
from an earlier study").
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from autotune.errors import ConfigError
from autotune.sglang.envs import ENV_PREFIX, EnvTable, lever
from autotune.sglang.flags import RENAMED, FlagSpec, FlagTable

_ONE_FLAG = re.compile(r"^--[a-z0-9][a-z0-9-]*$")  # a RENAMED entry that names a single flag and nothing else


def _renamed(table: FlagTable, dest: str) -> FlagSpec | None:
    """The one flag ``RENAMED`` says replaces ``dest``, when it is a plain flag name the table has."""
    hint = RENAMED.get(dest, "")
    return table.exact(hint) if _ONE_FLAG.match(hint) else None


def _version(table: FlagTable | EnvTable) -> str:
    return f"sglang {table.version}" if table.version else "the installed sglang"


def translate(
    config: Mapping[str, Any], table: FlagTable, envs: EnvTable | None = None
) -> tuple[dict[str, Any], list[str]]:
    """(``config`` in ``table``'s names and types, one line per flag renamed or dropped)."""
    envs = envs or EnvTable.bundled()
    out: dict[str, Any] = {}
    lines: list[str] = []
    for key, value in config.items():
        var = lever(key)
        if var is not None:
            if var not in envs:
                lines.append(f"dropped {var}: not an environment variable of {_version(envs)}")
                continue
            name = envs.lookup(var).name
            if name != var:
                lines.append(f"renamed {var} to {name} ({_version(envs)})")
            try:
                out[ENV_PREFIX + name] = None if value is None else envs.coerce(name, value)
            except ConfigError as exc:
                lines.append(f"dropped {name}={value}: {exc.message}")
            continue
        spec = table.exact(str(key))
        if spec is None and (spec := _renamed(table, str(key))) is not None:
            lines.append(f"renamed --{str(key).replace('_', '-')} to {spec.flag} ({_version(table)})")
        if spec is None:
            hint = f"; sglang says: use {RENAMED[str(key)]}" if str(key) in RENAMED else ""
            lines.append(f"dropped --{str(key).replace('_', '-')}: not a flag of {_version(table)}{hint}")
            continue
        try:
            out[spec.dest] = table.coerce(spec.dest, value)
        except ConfigError as exc:
            lines.append(f"dropped {spec.flag} {value}: {exc.message}")
    return out, lines
