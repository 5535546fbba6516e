"""How the result records become plain data and back: the dicts a study stores (Optuna user attributes,
``result.json``) read into the records, keys this version does not know ignored (forward compatible)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, fields
from typing import Any, Self


def from_known(cls: Any, data: Mapping[str, Any] | None) -> Any:
    """Build a dataclass from a dict, ignoring keys this version does not know (forward compatible)."""
    if data is None:
        return None
    names = {f.name for f in fields(cls)}
    return cls(**{k: v for k, v in data.items() if k in names})


def typed(cls: Any, value: Any) -> Any:
    """``value`` as a ``cls`` record: itself when it is one, else read from its stored dict."""
    return value if isinstance(value, cls) else cls.from_dict(value)


class Sparse:
    """A record stored without its None fields, as the dict it replaced was written (an absent key reads None);
    its lists are tuples here, and a field holding a record is stored as that record's own ``to_dict()``."""

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)  # type: ignore[call-overload]
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if hasattr(value, "to_dict"):
                data[f.name] = value.to_dict()
        return {k: list(v) if isinstance(v, tuple) else v for k, v in data.items() if v is not None}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any] | None) -> Self | None:
        if not data:
            return None
        return from_known(cls, {k: tuple(v) if isinstance(v, list) else v for k, v in data.items()})
