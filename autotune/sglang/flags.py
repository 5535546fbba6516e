"""SGLang's launch flags as data: name lookup, typed values, did-you-mean, and config → argv.

The bundled table is SGLang 0.5.23's real parser dumped to JSON (``data/sglang-0.5.23-flags.json``); the
sglang engine builds the same table from an installed SGLang's own argparse actions (``engines/sglang.py``).
Configs everywhere are keyed by ``dest`` (``max_mamba_cache_size``); this module is the one place that knows how
a user may spell a flag.
"""

from __future__ import annotations

import difflib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from typing import Any, NotRequired, TypedDict

from autotune.errors import ConfigError
from autotune.sglang.envs import ENV_PREFIX, EnvTable, assignment, lever

BUNDLED_VERSION = "0.5.23"

# The keys of one row of a flag table as dumped from SGLang's parser (the bundled table has exactly these).
# A dump of an installed SGLang adds ``action`` (argparse action kind) and ``help_suppressed``.
ROW_KEYS = ("flags", "dest", "default", "type", "choices", "nargs", "is_store_true")


class FlagRow(TypedDict):
    """One row of the flag table as dumped from SGLang's parser (``ROW_KEYS``; a dump from an installed SGLang
    also carries ``action`` and ``help_suppressed``)."""

    flags: list[str]
    dest: str
    default: Any  # the parser's default: any JSON value
    type: str | None  # the parser's type function by name
    choices: list[Any] | None
    nargs: int | str | None
    is_store_true: bool
    action: NotRequired[str | None]
    help_suppressed: NotRequired[bool]


# Flags that were renamed or removed, and what to use instead (SGLang 0.5.23's parser,
# ``srt/arg_groups/fields/*.py``). Consulted only when a name is unknown, so a table that still has a deprecated flag
# (0.5.23 keeps --disable-cuda-graph) accepts it.
RENAMED: dict[str, str] = {
    "mamba_scheduler_strategy": "--mamba-radix-cache-strategy",
    "cuda_graph_max_bs": "--cuda-graph-max-bs-decode (or --cuda-graph-max-bs-prefill)",
    "cuda_graph_bs": "--cuda-graph-bs-decode (or --cuda-graph-bs-prefill)",
    "disable_cuda_graph": "--disable-decode-cuda-graph / --disable-prefill-cuda-graph "
    "(or --cuda-graph-backend-decode disabled)",
    "enable_dp_attention": "--attn-dp-size N",
    "monokernel_backend": "--enable-amd-monokernel",
    "enable_flashinfer_allreduce_fusion": "--flashinfer-allreduce-fusion-backend auto",
}

# Deprecated but still accepted by 0.5.23; the harness may warn about them.
DEPRECATED: dict[str, str] = {
    "disable_cuda_graph": RENAMED["disable_cuda_graph"],
    "enable_dp_attention": RENAMED["enable_dp_attention"],
}

_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}
_SUFFIX = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


@dataclass(frozen=True, kw_only=True)
class FlagSpec:
    """One argparse option of the server: its dest, spellings and value type."""

    dest: str
    option_strings: tuple[str, ...]
    type: str | None = None  # argparse type name: int, float, str, human_readable_int, loads, ...
    default: Any = None
    choices: tuple[Any, ...] | None = None
    nargs: int | str | None = None
    store_true: bool = False
    # What a dump of an installed SGLang adds: the argparse action kind (store, store_true, store_false,
    # store_const, append, extend, count, boolean_optional, help, other) and whether --help hides the flag.
    # Both are informational for equality: the bundled table has neither, and a spec means the same without them.
    action: str | None = field(default=None, compare=False)
    suppressed: bool = field(default=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "option_strings", tuple(self.option_strings))
        if self.choices is not None:
            object.__setattr__(self, "choices", tuple(self.choices))

    @property
    def flag(self) -> str:
        """The canonical spelling: the first ``--long`` option."""
        return next((o for o in self.option_strings if o.startswith("--")), self.option_strings[0])

    @property
    def boolean_optional(self) -> bool:
        """``--x`` / ``--no-x`` (argparse.BooleanOptionalAction): a bool that is rendered either way."""
        return self.nargs == 0 and not self.store_true and any(o.startswith("--no-") for o in self.option_strings)

    @property
    def switch(self) -> bool:
        """Takes no value and is not ``--x/--no-x``: store_true, store_false, store_const, a custom nargs=0
        action. ``True`` renders the bare flag, ``False`` leaves it out."""
        return self.store_true or (self.nargs == 0 and not self.boolean_optional)

    @property
    def repeated(self) -> bool:
        """An ``append`` option: a list is rendered as the flag once per value."""
        return self.action == "append" and self.nargs in (None, "?")

    @property
    def is_list(self) -> bool:
        return self.nargs in ("+", "*") or self.repeated


def _dashless(name: str) -> str:
    return name.lstrip("-").replace("-", "_")


class FlagTable:
    """All flags of one server version, with argparse's lookup rules (exact, alias, unique prefix)."""

    def __init__(self, specs: Iterable[FlagSpec], *, version: str | None = None):
        self.version = version
        self._by_dest: dict[str, FlagSpec] = {}
        self._by_option: dict[str, FlagSpec] = {}
        self._specs: list[FlagSpec] = []
        for spec in specs:
            if spec.dest == "help":
                continue
            self._specs.append(spec)
            self._by_dest.setdefault(spec.dest, spec)
            for option in spec.option_strings:
                if option.startswith("--"):
                    self._by_option[option] = spec

    @classmethod
    def bundled(cls) -> FlagTable:
        """SGLang 0.5.23's table (cached: it is read once per process)."""
        return _bundled()

    @classmethod
    def from_json(cls, rows: list[FlagRow], *, version: str | None = None) -> FlagTable:
        """Rows as dumped from SGLang's parser: ``flags, dest, default, type, choices, nargs, is_store_true``
        (``ROW_KEYS``), plus ``action`` and ``help_suppressed`` when dumped from an installed SGLang."""
        return cls(
            (
                FlagSpec(
                    dest=row["dest"],
                    option_strings=tuple(row["flags"]),
                    type=row.get("type"),
                    default=row.get("default"),
                    nargs=row.get("nargs"),
                    choices=None if (c := row.get("choices")) is None else tuple(c),
                    store_true=bool(row.get("is_store_true")),
                    action=row.get("action"),
                    suppressed=bool(row.get("help_suppressed")),
                )
                for row in rows
            ),
            version=version,
        )

    def __contains__(self, name: object) -> bool:
        if not isinstance(name, str):
            return False
        try:
            self.lookup(name)
        except ConfigError:
            return False
        return True

    def __len__(self) -> int:
        return len(self._by_dest)

    @property
    def dests(self) -> list[str]:
        return list(self._by_dest)

    @property
    def specs(self) -> list[FlagSpec]:
        """Every option but ``--help``, in the parser's order (two options may share a dest)."""
        return list(self._specs)

    def exact(self, name: str) -> FlagSpec | None:
        """The spec ``name`` names as dest, ``--dashed``, ``dashed`` or an alias; never by prefix (None if none)."""
        raw = str(name).strip()
        return self._by_dest.get(_dashless(raw)) or self._by_option.get("--" + raw.lstrip("-").replace("_", "-"))

    def lookup(self, name: str) -> FlagSpec:
        """The spec for ``name`` given as dest, ``--dashed``, ``dashed``, an alias or a unique ``--prefix``."""
        raw = str(name).strip()
        if not raw:
            raise ConfigError("empty flag name")
        dest = _dashless(raw)
        found = self.exact(raw)
        if found is not None:
            return found
        option = "--" + raw.lstrip("-").replace("_", "-")
        # argparse's abbreviation rule: a prefix of exactly one long option; several → ambiguous.
        matches = sorted({o for o in self._by_option if o.startswith(option)})
        specs = {self._by_option[o].dest for o in matches}
        if len(specs) == 1:
            return self._by_option[matches[0]]
        if len(specs) > 1:
            hint = RENAMED.get(dest)
            raise ConfigError(
                f"ambiguous option: {option} could match {', '.join(matches[:6])}",
                key=raw,
                fix=f"use {hint}" if hint else "spell the flag out in full",
            )
        raise ConfigError(self._unknown_message(option), key=raw, fix=self._suggestion(dest))

    def _unknown_message(self, option: str) -> str:
        version = f" {self.version}" if self.version else ""
        return f"{option} is not a flag of sglang{version}"

    def _suggestion(self, dest: str) -> str:
        if dest in RENAMED:
            return f"it was renamed or removed; use {RENAMED[dest]}"
        close = difflib.get_close_matches(dest, self._by_dest, n=3, cutoff=0.7)
        if close:
            return "did you mean " + " or ".join(self._by_dest[c].flag for c in close) + "?"
        return "see `python -m sglang.launch_server --help` for the flags this version knows"

    def deprecation(self, name: str) -> str | None:
        """What to use instead of a flag this version still accepts but deprecates (None if it is current)."""
        dest = self.lookup(name).dest
        return f"{self.lookup(name).flag} is deprecated; use {DEPRECATED[dest]}" if dest in DEPRECATED else None

    def key(self, name: str) -> str:
        """A config key as the study keeps it: the flag's dest, or an environment lever's ``env:NAME`` under the
        variable's current name (``sglang.envs``)."""
        var = lever(name)
        return self.lookup(name).dest if var is None else ENV_PREFIX + EnvTable.bundled().lookup(var).name

    def coerce(self, dest: str, value: Any) -> Any:
        """``value`` as the flag's type (int/float/str/bool/list) or the lever's (``env:NAME``), or ``ConfigError``
        naming flag and value."""
        if (var := lever(dest)) is not None:  # an environment lever kept beside the flags (sglang.envs)
            return None if value is None else EnvTable.bundled().coerce(var, value)
        spec = self.lookup(dest)
        if value is None:
            return None
        if spec.switch or spec.boolean_optional:
            return _to_bool(spec, value)
        if spec.is_list:
            items = value if isinstance(value, (list, tuple)) else str(value).replace(",", " ").split()
            return [_scalar(spec, item) for item in items]
        return _scalar(spec, value)

    def check(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Keys normalised to dest and every value coerced; raises on the first bad flag or value."""
        out: dict[str, Any] = {}
        for key, value in config.items():
            if lever(key) is not None:  # an environment lever kept beside the flags (sglang.envs)
                out[self.key(key)] = self.coerce(key, value)
                continue
            spec = self.lookup(key)
            if spec.dest in out:
                raise ConfigError(f"{spec.flag} is given twice", key=str(key), fix="keep one spelling")
            out[spec.dest] = self.coerce(spec.dest, value)
        return out

    def to_argv(self, config: Mapping[str, Any]) -> list[str]:
        """``--dashed value`` pairs; store-true True → the bare flag; False/None → omitted."""
        argv: list[str] = []
        for key, value in config.items():
            if lever(key) is not None:  # the server's environment, not a flag (``sglang.envs.env_strings``)
                continue
            spec = self.lookup(key)
            value = self.coerce(spec.dest, value)
            if value is None:
                continue
            if spec.switch:
                if value:
                    argv.append(spec.flag)
                continue
            if spec.boolean_optional:
                no = next(o for o in spec.option_strings if o.startswith("--no-"))
                argv.append(spec.flag if value else no)
                continue
            if spec.repeated:
                for item in value:
                    argv += [spec.flag, _render(item)]
                continue
            argv.append(spec.flag)
            if isinstance(value, list):
                argv.extend(_render(v) for v in value)
            else:
                argv.append(_render(value))
        return argv


def _render(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _to_bool(spec: FlagSpec, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in _TRUE:
        return True
    if text in _FALSE:
        return False
    raise ConfigError(f"{spec.flag} takes no value (a switch), got {value!r}", key=spec.dest, fix="use true or false")


def _human_int(text: str) -> int:
    """SGLang's human_readable_int: ``32k`` = 32,000, ``32K`` = 32,768, plain integers as is."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kKmMgGtT])", text)
    if match:
        return int(float(match[1]) * _SUFFIX[match[2]])
    return int(text)


def _scalar(spec: FlagSpec, value: Any) -> Any:
    kind = spec.type or "str"
    try:
        if kind == "int":
            if isinstance(value, float) and not value.is_integer():
                raise ValueError(value)
            if isinstance(value, bool):
                raise ValueError(value)
            result: Any = int(value) if not isinstance(value, str) else int(value.strip())
        elif kind == "human_readable_int":
            result = (
                int(value) if isinstance(value, int) and not isinstance(value, bool) else _human_int(str(value).strip())
            )
        elif kind == "float":
            if isinstance(value, bool):
                raise ValueError(value)
            result = float(value)
        elif kind in ("loads", "json_list_type", "parse_cuda_graph_config_arg"):
            result = value if isinstance(value, (dict, list)) else json.loads(str(value))
        else:
            result = value if isinstance(value, str) else str(value)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            f"{spec.flag} expects {'an integer' if 'int' in kind else 'a number' if kind == 'float' else kind}, "
            f"got {value!r}",
            key=spec.dest,
            fix=f"e.g. {spec.flag} {spec.default}" if spec.default not in (None, "") else None,
        ) from exc
    if spec.choices is not None and result not in spec.choices:
        raise ConfigError(f"{spec.flag} got {value!r}, allowed: {', '.join(map(str, spec.choices))}", key=spec.dest)
    return result


@lru_cache(maxsize=1)
def _bundled() -> FlagTable:
    text = resources.files("autotune").joinpath(f"data/sglang-{BUNDLED_VERSION}-flags.json").read_text()
    return FlagTable.from_json(json.loads(text), version=BUNDLED_VERSION)


def parse_sets(items: Iterable[str], table: FlagTable | None = None) -> dict[str, Any]:
    """``--set FLAG=VALUE`` items → a dest-keyed, typed config (``FLAG`` with or without dashes)."""
    table = table or FlagTable.bundled()
    out: dict[str, Any] = {}
    for item in items:
        name, value = assignment(item, "--set", "FLAG=VALUE", "max-mamba-cache-size=200")
        spec = table.lookup(name)
        if spec.is_list and value:
            out[spec.dest] = table.coerce(spec.dest, value.replace(",", " ").split())
        else:
            out[spec.dest] = table.coerce(spec.dest, value)
    return out
