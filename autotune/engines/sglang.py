"""The real engine: ``python -m sglang.launch_server`` from a chosen interpreter.

Flags are validated before any launch against the SGLang that interpreter would run (its ``--help``, parsed
once per interpreter + version and cached), or against the bundled 0.5.23 table when SGLang is not
installed there, so a renamed flag costs a ConfigError instead of a server start.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from autotune.engines import logparse
from autotune.engines.base import GpuReader
from autotune.errors import ConfigError, EngineError

# Flags the harness owns: a config that sets them would fight the launch command.
HARNESS_FLAGS = frozenset({"model_path", "host", "port"})
_VERSION_SNIPPET = "import importlib.metadata as m; print(m.version('sglang'))"
_OPTION_LINE = re.compile(r"^  (-\S.*?)(?:\s{2,}.*)?$")


def reject_harness_flags(config: Mapping[str, Any], *, fix: str) -> None:
    """ConfigError for a flag the launch command sets itself (``HARNESS_FLAGS``)."""
    for key in config:
        if key in HARNESS_FLAGS:
            raise ConfigError(f"{key} is set by the harness", key=key, fix=fix)


def parse_help(text: str) -> list[dict[str, Any]]:
    """Flag specs (the bundled table's shape) from argparse ``--help`` output.

    argparse prints each option as ``--name METAVAR, --alias METAVAR`` at a two-space indent; a flag without
    a metavar takes no value (store-true), ``{a,b}`` lists choices and ``[X ...]`` means several values.
    """
    specs: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = _OPTION_LINE.match(line)
        if not m:
            continue
        options, metavar = [], ""
        for part in m[1].split(", "):
            name, _, rest = part.strip().partition(" ")
            if not name.startswith("-"):
                break
            options.append(name)
            metavar = metavar or rest.strip()
        longs = [o for o in options if o.startswith("--")]
        if not longs or longs[0] == "--help":
            continue
        choices = None
        if metavar.startswith("{"):
            choices = metavar[1 : metavar.index("}")].split(",")
        nargs: Any = None
        if "..." in metavar:
            nargs = "*" if metavar.startswith("[") else "+"
        elif not metavar:
            nargs = 0
        specs.append(
            {
                "flags": options,
                "dest": longs[0][2:].replace("-", "_"),
                "default": None,
                "type": None,
                "choices": choices,
                "nargs": nargs,
                "is_store_true": not metavar,
            }
        )
    return specs


def _cache_dir() -> Path:
    root = os.environ.get("AUTOTUNE_CACHE_DIR") or os.path.join(os.path.expanduser("~"), ".cache", "autotune")
    return Path(root) / "sglang-flags"


class SGLangEngine(logparse.LogReading):
    """Launches SGLang itself. ``device="cpu"`` selects SGLang's CPU backend (measured by host memory)."""

    name = "sglang"

    def __init__(
        self,
        *,
        model_path: str,
        python: str | None = None,
        env: Mapping[str, str] | None = None,
        device: str = "cuda",
        cache_dir: Path | None = None,
    ):
        if device not in ("cuda", "cpu"):
            raise ConfigError(f"unknown device {device!r}", key="device", fix="use cuda or cpu")
        self.model_path = model_path
        self.python = python or sys.executable
        self.extra_env = dict(env or {})
        self.device = device
        self.cache_dir = cache_dir or _cache_dir()
        self._table = None
        self._version: str | None = None

    # -- launch -----------------------------------------------------------------------------------------
    def argv(self, config: Mapping[str, Any], *, port: int, host: str = "127.0.0.1") -> list[str]:
        flags = self.flag_table().to_argv(dict(config))
        if self.device == "cpu" and "device" not in config:
            flags = ["--device", "cpu", *flags]
        return [
            self.python, "-m", "sglang.launch_server", "--model-path", self.model_path,
            "--host", host, "--port", str(port), *flags,
        ]

    def env(self, *, gpu_index: int | None) -> dict[str, str]:
        env = dict(self.extra_env)
        if gpu_index is not None and self.device == "cuda":
            env["CUDA_VISIBLE_DEVICES"] = str(gpu_index)
        if self.device == "cpu":
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        return env

    # -- validation -------------------------------------------------------------------------------------
    def preflight(self) -> None:
        """Raise EngineError unless the interpreter can import SGLang (checked before any launch)."""
        if self._version is None:
            self._version = self.sglang_version() or ""
        if not self._version:
            raise EngineError(
                f"sglang is not importable by {self.python} "
                "(pip install 'sglang==0.5.23' there, or pass --python / engine.python pointing at an interpreter that has it)"
            )

    def check(self, config: Mapping[str, Any]) -> dict[str, Any]:
        reject_harness_flags(config, fix="remove it from the config; use --model/the engine settings")
        return self.flag_table().check(dict(config))

    def flag_table(self):
        """The installed SGLang's flags (cached per interpreter + version), else the bundled 0.5.23 table."""
        if self._table is None:
            self._table = self._load_table()
        return self._table

    def sglang_version(self) -> str | None:
        try:
            proc = subprocess.run(
                [self.python, "-c", _VERSION_SNIPPET], capture_output=True, text=True, timeout=60, check=False
            )
        except FileNotFoundError as exc:
            raise EngineError(
                f"Python interpreter {self.python!r} not found (set the engine's python to an interpreter with sglang)"
            ) from exc
        except subprocess.TimeoutExpired:
            return None
        return proc.stdout.strip() or None if proc.returncode == 0 else None

    def _load_table(self):
        from autotune.flags import FlagTable

        version = self.sglang_version()
        if version is None:
            return FlagTable.bundled()
        key = hashlib.sha256(f"{os.path.realpath(self.python)}|{version}".encode()).hexdigest()[:16]
        cached = self.cache_dir / f"{key}.json"
        if cached.is_file():
            try:
                return FlagTable.from_json(json.loads(cached.read_text()), version=version)
            except (ValueError, KeyError, TypeError):
                cached.unlink(missing_ok=True)  # a corrupt cache is rebuilt, not trusted
        proc = subprocess.run(
            [self.python, "-m", "sglang.launch_server", "--help"],
            capture_output=True, text=True, timeout=300, check=False,
        )
        specs = parse_help(proc.stdout)
        if proc.returncode != 0 or not specs:
            raise EngineError(
                f"`{self.python} -m sglang.launch_server --help` failed (exit {proc.returncode}): "
                f"{(proc.stderr.strip().splitlines() or ['no output'])[-1]} (check the sglang install)"
            )
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        cached.write_text(json.dumps(specs))
        return FlagTable.from_json(specs, version=version)

    # -- reading the server: classify, failure_line, capacity come from logparse.LogReading -------------
    def gpu_reader(self, gpu_index: int | None) -> GpuReader:
        from autotune.gpu import HostMemoryReader, NvmlReader

        if self.device == "cpu":
            return HostMemoryReader()
        return NvmlReader(0 if gpu_index is None else gpu_index)
