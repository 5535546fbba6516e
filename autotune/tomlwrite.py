"""Writing the few TOML shapes the tool emits (study files, fleet files); ``tomllib`` only reads."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from typing import Any


def toml_key(key: str) -> str:
    """A bare key when TOML allows one, else a quoted key."""
    return key if re.fullmatch(r"[A-Za-z0-9_-]+", key) else json.dumps(key)


def toml_value(value: Any) -> str:
    """One TOML value: booleans, numbers, strings, arrays, and inline tables for mappings."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return repr(value) if math.isfinite(value) else json.dumps(str(value))
    if isinstance(value, str):
        return json.dumps(value)  # JSON string escapes are valid TOML basic-string escapes
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, Mapping):
        return "{" + ", ".join(f"{toml_key(str(k))} = {toml_value(v)}" for k, v in value.items()) + "}"
    raise TypeError(f"cannot write {type(value).__name__} to TOML")
