"""SGLang's YAML config file (``--config sglang.yaml``): a dest-keyed config split into the YAML mapping and
the flags YAML cannot hold, written, read back and expanded exactly as SGLang 0.5.23's loader does.

``sglang.yaml`` is written in the form SGLang's own ``--config`` loader reads (dash keys, store-true flags as
``true``, lists as YAML lists). A few flags cannot live there (SGLang rejects BooleanOptionalAction flags and
two deprecated ones in YAML), so those travel on the launch command line instead, where they still apply.
Used by ``apply`` (writing), ``fleet`` and ``rollout`` (reading a server's config).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml

from autotune.errors import ConfigError
from autotune.sglang.flags import FlagSpec, FlagTable

SGLANG_VERSION = "0.5.23"
# SGLang answers "Unsupported config option" for these in a YAML config (SGLang 0.5.23
# ``srt/utils/server_args_config_parser.py``).
YAML_REJECTED = frozenset({"disable_cuda_graph", "enable_dp_attention"})
# Per-server values: the launch command sets them, so a shared config file must not.
PER_SERVER = frozenset({"model_path", "host", "port", "config", "base_gpu_id"})


METRICS_FLAG = "enable_metrics"


def deployed_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """The winner's flags as the fleet runs them: with ``--enable-metrics``, which the rollout's canary and
    ``autotune watch`` read (Prometheus counters only: SGLang's scheduling and outputs do not change)."""
    return {**config, METRICS_FLAG: True}


def _flags() -> FlagTable:
    return FlagTable.bundled()


def dash_name(spec: FlagSpec) -> str:
    """The canonical ``dash-name`` of a flag (its first long option string, without the dashes)."""
    return spec.flag[2:]


def _yaml_safe(spec: FlagSpec) -> bool:
    return spec.dest not in YAML_REJECTED and not spec.boolean_optional


# -- the SGLang YAML form ------------------------------------------------------------------------------
def split_config(config: Mapping[str, Any], *, flags: FlagTable | None = None) -> tuple[dict[str, Any], list[str]]:
    """Split a dest-keyed config into (YAML mapping with dash keys, argv for flags YAML cannot hold).

    False/None values mean "absent" and are dropped, and so are per-server keys (the launcher sets them).
    """
    flags = flags or _flags()
    checked = flags.check(dict(config))
    document: dict[str, Any] = {}
    cli: dict[str, Any] = {}
    for key, value in checked.items():
        spec = flags.lookup(key)
        if spec.dest in PER_SERVER:
            continue  # the launch command sets these per server
        if value is None or (value is False and spec.store_true):
            continue
        if not _yaml_safe(spec):
            cli[spec.dest] = value
            continue
        if isinstance(value, dict):
            value = json.dumps(value)  # SGLang passes a mapping on as a JSON string
        document[dash_name(spec)] = list(value) if isinstance(value, (list, tuple)) else value
    return document, flags.to_argv(cli) if cli else []


def yaml_text(document: Mapping[str, Any], *, header: str = "") -> str:
    body = yaml.safe_dump(dict(document), sort_keys=False, default_flow_style=False)
    comment = "".join(f"# {line}\n" for line in header.splitlines())
    return comment + body


def yaml_to_argv(document: Mapping[str, Any], *, flags: FlagTable | None = None) -> list[str]:
    """Expand a YAML config exactly as SGLang 0.5.23's loader does: ``--key value``, ``true`` → bare flag
    for store-true flags (``false`` dropped), lists → ``--key v1 v2``. Unknown keys are ConfigErrors."""
    flags = flags or _flags()
    argv: list[str] = []
    for key, value in document.items():
        spec = flags.lookup(key)
        if "--" + str(key) not in spec.option_strings:
            raise ConfigError(
                f"{key} is not a flag name of sglang {SGLANG_VERSION}", key=str(key), fix=f"use {dash_name(spec)}"
            )
        if not _yaml_safe(spec):
            raise ConfigError(f"sglang rejects {key} in a YAML config", key=str(key), fix="pass it on the command line")
        if isinstance(value, bool) and spec.store_true:
            argv += [f"--{key}"] if value else []
        elif isinstance(value, bool):
            argv += [f"--{key}", str(value).lower()]
        elif isinstance(value, list):
            argv += [f"--{key}", *(str(v) for v in value)] if value else []
        else:
            argv += [f"--{key}", str(value)]
    return argv


def read_config_file(path: Path, *, flags: FlagTable | None = None) -> dict[str, Any]:
    """An ``sglang.yaml`` → the dest-keyed, typed config it stands for."""
    flags = flags or _flags()
    try:
        document = yaml.safe_load(Path(path).read_text()) or {}
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path), fix="check the path") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"not valid YAML ({exc.__class__.__name__})", file=str(path)) from None
    if not isinstance(document, dict):
        raise ConfigError("the top level must be a mapping of flag: value", file=str(path))
    try:
        yaml_to_argv(document, flags=flags)
        config = {flags.lookup(key).dest: value for key, value in document.items()}
        return flags.check(config)
    except ConfigError as exc:
        raise ConfigError(str(exc), file=str(path)) from None


def config_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[tuple[str, Any, Any]]:
    """(flag, old, new) for every flag whose value differs; an absent flag reads as None."""

    def present(config: Mapping[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in config.items() if v is not None and v is not False}

    a, b = present(old), present(new)
    return [(key, a.get(key), b.get(key)) for key in sorted(set(a) | set(b)) if a.get(key) != b.get(key)]
