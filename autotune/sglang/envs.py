"""SGLang 0.5.23's environment variables (its ``Envs`` table): name lookup with did-you-mean, typed values, and
the split of a trial's config into flags and environment.

The bundled table ``data/sglang-0.5.23-env.json`` is ``sglang/srt/environ.py``'s ``class Envs`` dumped by
``benchmarks/dump_sglang_env.py``. A config keeps a variable under ``env:NAME`` (``ENV_PREFIX``) so that it
travels with the flags through the study, its storage and its records, while everything that turns a config
into SGLang flags reads ``split_env(config)[0]`` and never sees it.
"""

from __future__ import annotations

import difflib
import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from functools import lru_cache
from importlib import resources
from typing import Any

from autotune.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "EnvTable",
    "EnvVar",
    "assignment",
    "env_strings",
    "lever",
    "parse_bool",
    "parse_envs",
    "render",
    "split_env",
]

BUNDLED_VERSION = "0.5.23"
ENV_PREFIX = "env:"
_TRUE, _FALSE = ("true", "1", "yes", "y"), ("false", "0", "no", "n")  # EnvBool.parse, srt/environ.py L143-150


def parse_bool(value: Any) -> bool | None:
    """An ``EnvBool`` value the way SGLang parses it (true/1/yes/y, false/0/no/n, any case); None for any other."""
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    return True if text in _TRUE else False if text in _FALSE else None


def lever(key: object) -> str | None:
    """The variable a config's ``env:NAME`` key names; None for a flag's key."""
    text = str(key)
    return text[len(ENV_PREFIX) :] if text.startswith(ENV_PREFIX) else None


@dataclass(frozen=True)
class EnvVar:
    """One ``Envs`` field: its type (bool, int, float, str, tuple, json) and literal default (None: computed)."""

    name: str
    type: str
    default: Any = None
    secret: bool = False
    alias: str | None = None


class EnvTable:
    """The variables one SGLang version reads, by name (deprecated aliases resolve to their current name)."""

    def __init__(self, rows: Iterable[EnvVar], *, version: str | None = None):
        self.version = version
        self._by_name = {v.name: v for v in rows}
        self._alias = {v.alias: v.name for v in self._by_name.values() if v.alias}

    @classmethod
    def bundled(cls) -> EnvTable:
        """SGLang 0.5.23's table (read once per process)."""
        return _bundled()

    def __contains__(self, name: object) -> bool:
        return name in self._by_name or name in self._alias

    def lookup(self, name: str) -> EnvVar:
        """The variable ``name`` (exact, upper case); an unknown one is a ``ConfigError`` with a did-you-mean."""
        raw = str(name).strip()
        if raw in self._by_name:
            return self._by_name[raw]
        if raw in self._alias:
            return self._by_name[self._alias[raw]]
        version = f" {self.version}" if self.version else ""
        close = difflib.get_close_matches(raw.upper(), self._by_name, n=2, cutoff=0.8)
        fix = (
            ("did you mean " + " or ".join(close) + "?")
            if close
            else "see the Envs class in sglang/srt/environ.py for the variables this version reads"
        )
        raise ConfigError(f"unknown environment variable for sglang{version}", key=raw, fix=fix)

    def coerce(self, name: str, value: Any) -> Any:
        """``value`` typed the way SGLang parses it (a bool from true/1/yes/y or false/0/no/n); a value SGLang
        would ignore with a warning is a ``ConfigError`` here, before any server starts."""
        var = self.lookup(name)
        text = str(value).strip()
        try:
            if var.type == "bool":
                if (flag := parse_bool(text)) is None:
                    raise ValueError(f'"{text}" is not a valid boolean value')
                return flag
            if var.type == "int" and not isinstance(value, bool):
                return int(value) if isinstance(value, int) else int(text)
            if var.type == "float" and not isinstance(value, bool):
                return float(value) if isinstance(value, (int, float)) else float(text)
            if var.type in ("int", "float"):
                raise ValueError(f'"{text}" is not a valid {var.type} value')
        except ValueError as exc:
            raise ConfigError(
                f"invalid value for {var.name}: {exc}",
                key=var.name,
                fix=f"give a {var.type} (SGLang would ignore it and use {var.default!r})",
            ) from None
        return text

    def names(self) -> list[str]:
        return sorted(self._by_name)


def render(value: Any) -> str:
    """The string a process gets: bools as 1/0 (what ``EnvBool`` reads), the rest as written."""
    if isinstance(value, bool):
        return "1" if value else "0"
    return str(value)


def parse_envs(items: Iterable[str], table: EnvTable | None = None) -> dict[str, str]:
    """``--env NAME=VALUE`` items → checked environment strings."""
    table = table or EnvTable.bundled()
    out: dict[str, str] = {}
    for item in items:
        name, value = assignment(item, "--env", "NAME=VALUE", "SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK=1")
        var = table.lookup(name)
        out[var.name] = render(table.coerce(var.name, value))
    return out


def assignment(item: str, option: str, form: str, example: str) -> tuple[str, str]:
    """One ``option``'s ``NAME=VALUE`` item (``--env``, ``--set``) → (name, value), stripped; an item without ``=``
    or a name is a ``ConfigError`` quoting ``form`` and ``example``."""
    name, sep, value = str(item).partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"{option} expects {form}, got {item!r}", fix=f"e.g. {option} {example}")
    return name.strip(), value.strip()


def split_env(config: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """A trial's config → (its SGLang flags, its environment variables by name)."""
    flags = {k: v for k, v in config.items() if lever(k) is None}
    env = {name: v for k, v in config.items() if (name := lever(k)) is not None}
    return flags, env


def env_strings(config: Mapping[str, Any]) -> dict[str, str]:
    """The environment a trial's server gets from its config (unset values left out)."""
    return {name: render(v) for name, v in split_env(config)[1].items() if v is not None}


@lru_cache(maxsize=1)
def _bundled() -> EnvTable:
    text = resources.files("autotune").joinpath(f"data/sglang-{BUNDLED_VERSION}-env.json").read_text()
    data = json.loads(text)
    rows = (
        EnvVar(
            name=r["name"], type=r["type"], default=r.get("default"), secret=bool(r.get("secret")), alias=r.get("alias")
        )
        for r in data["vars"]
    )
    return EnvTable(rows, version=str(data.get("version") or BUNDLED_VERSION))
