"""The real engine: ``python -m sglang.launch_server`` from a chosen interpreter.

Flags are validated before any launch against the SGLang that interpreter would run: a small script run in that
interpreter imports ``sglang.srt.server_args.ServerArgs``, lets ``ServerArgs.add_cli_args`` fill an argparse
parser and dumps every action (dest, option strings, type, choices, nargs, default, action kind, help-suppressed)
as JSON in the bundled table's shape. The dump is cached per interpreter + SGLang version (+ install location).
When SGLang is not there or the dump fails, the bundled 0.5.23 table is used and a warning says so, so a renamed
flag costs a ConfigError instead of a server start either way.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, TypedDict, cast

from autotune.errors import ConfigError, EngineError, GpuError
from autotune.harness.engines.base import EngineSettings, GpuReader
from autotune.harness.gpu import HostMemoryReader, NvmlReader
from autotune.sglang.flags import BUNDLED_VERSION, FlagRow, FlagTable
from autotune.sglang.gpus import GpuProfile, load_gpu, profile_for_device

log = logging.getLogger(__name__)

# Flags the harness owns: a config that sets them would fight the launch command.
HARNESS_FLAGS = frozenset({"model_path", "host", "port"})


# The installed SGLang's version and where it is installed (two venvs of one interpreter may differ).
_PROBE_SNIPPET = (
    "import importlib.metadata as m, json; d = m.distribution('sglang'); "
    "print(json.dumps({'version': d.version, 'location': str(d.locate_file(''))}))"
)
_DUMP_MARKER = "AUTOTUNE-SGLANG-FLAGS "
_CACHE_SCHEMA = 2  # 1 was the --help text parse (untyped); such files are rebuilt
DUMP_TIMEOUT_S = 300.0

# Run as ``[python, "-c", DUMP_SCRIPT]`` in the engine's interpreter (any Python 3.8+). It prints one line,
# _DUMP_MARKER + a JSON list of rows shaped like data/sglang-0.5.23-flags.json plus "action" and
# "help_suppressed"; whatever importing SGLang prints goes to stderr or comes before that line.
DUMP_SCRIPT = r"""
import argparse, json, sys
out = sys.stdout
sys.stdout = sys.stderr
from sglang.srt.server_args import ServerArgs
parser = argparse.ArgumentParser()
ServerArgs.add_cli_args(parser)
sys.stdout = out
KINDS = [(getattr(argparse, "BooleanOptionalAction", None), "boolean_optional"),
         (argparse._StoreTrueAction, "store_true"), (argparse._StoreFalseAction, "store_false"),
         (argparse._StoreConstAction, "store_const"), (getattr(argparse, "_ExtendAction", None), "extend"),
         (argparse._AppendAction, "append"), (argparse._AppendConstAction, "append_const"),
         (argparse._CountAction, "count"), (argparse._HelpAction, "help"), (argparse._VersionAction, "version"),
         (argparse._StoreAction, "store")]
def kind(action):
    for cls, name in KINDS:
        if cls is not None and isinstance(action, cls):
            return name
    return "other"
def safe(value):
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError):
        return str(value)
def type_name(t):
    if t is None:
        return None
    return getattr(t, "__name__", None) or type(t).__name__
rows = []
for a in parser._actions:
    rows.append({
        "flags": list(a.option_strings), "dest": a.dest, "default": safe(a.default), "type": type_name(a.type),
        "choices": None if a.choices is None else [safe(c) for c in a.choices], "nargs": safe(a.nargs),
        "is_store_true": isinstance(a, argparse._StoreTrueAction), "action": kind(a),
        "help_suppressed": a.help == argparse.SUPPRESS,
    })
sys.stdout.write("\n" + MARKER + json.dumps(rows) + "\n")
sys.stdout.flush()
""".replace("MARKER", repr(_DUMP_MARKER))


def reject_harness_flags(config: Mapping[str, Any], *, fix: str) -> None:
    """ConfigError for a flag the launch command sets itself (``HARNESS_FLAGS``)."""
    for key in config:
        if key in HARNESS_FLAGS:
            raise ConfigError(f"{key} is set by the harness", key=key, fix=fix)


class FlagCache(TypedDict):
    """The installed SGLang's flag rows as cached on disk, with what they were dumped from (checked on reading)."""

    schema: int
    python: str
    version: str
    location: str | None
    rows: list[FlagRow]


def parse_dump(stdout: str) -> list[FlagRow]:
    """The rows ``DUMP_SCRIPT`` printed (its marked line); ValueError when there is none or it is malformed."""
    for line in reversed(stdout.splitlines()):
        if line.startswith(_DUMP_MARKER):
            rows = json.loads(line[len(_DUMP_MARKER) :])
            if _valid_rows(rows):
                return cast(list[FlagRow], list(rows))
            raise ValueError("the flag dump is not a list of flag rows")
    raise ValueError("no flag dump in the output")


def _valid_rows(rows: Any) -> bool:
    return (
        isinstance(rows, list)
        and bool(rows)
        and all(
            isinstance(r, dict) and isinstance(r.get("dest"), str) and isinstance(r.get("flags"), list) for r in rows
        )
    )


def _cache_dir() -> Path:
    """``$AUTOTUNE_CACHE_DIR``, else ``$XDG_CACHE_HOME/autotune``, else ``~/.cache/autotune``; + ``sglang-flags``."""
    root = os.environ.get("AUTOTUNE_CACHE_DIR")
    if not root:
        xdg = os.environ.get("XDG_CACHE_HOME", "")
        base = xdg if os.path.isabs(xdg) else os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(base, "autotune")
    return Path(root) / "sglang-flags"


class SGLangEngine:
    """Launches SGLang itself. ``device="cpu"`` selects SGLang's CPU backend (measured by host memory)."""

    name = "sglang"
    simulated = False
    shm_dir: Path | None = None  # SGLang's own /dev/shm files are its to clean

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
        self.table_warning: str | None = None  # why flags are checked against the bundled table, if they are
        self._table: FlagTable | None = None
        self._probed = False
        self._install: tuple[str, str] | None = None  # (version, location) of the interpreter's sglang

    @classmethod
    def from_settings(cls, settings: EngineSettings) -> SGLangEngine:
        return cls(model_path=settings.model_path, python=settings.python, env=settings.env, device=settings.device)

    # -- launch -----------------------------------------------------------------------------------------
    def argv(self, config: Mapping[str, Any], *, port: int, host: str = "127.0.0.1") -> list[str]:
        flags = self.flag_table().to_argv(dict(config)) if config else []  # none to render: no interpreter asked
        if self.device == "cpu" and "device" not in config:
            flags = ["--device", "cpu", *flags]
        return [
            self.python,
            "-m",
            "sglang.launch_server",
            "--model-path",
            self.model_path,
            "--host",
            host,
            "--port",
            str(port),
            *flags,
        ]

    def env(self) -> dict[str, str]:
        """The engine's own variables; which GPU is the launcher's (``launch.local`` sets CUDA_VISIBLE_DEVICES)."""
        env = dict(self.extra_env)
        if self.device == "cpu":
            env.setdefault("SGLANG_USE_CPU_ENGINE", "1")
        return env

    # -- validation -------------------------------------------------------------------------------------
    def preflight(self) -> None:
        """Raise EngineError unless the interpreter can import SGLang (checked before any launch)."""
        if not self.sglang_version():
            raise EngineError(
                f"sglang is not importable by {self.python} "
                "(pip install 'sglang==0.5.23' there, or pass --python / engine.python pointing at an interpreter "
                "that has it)"
            )

    def check(self, config: Mapping[str, Any]) -> dict[str, Any]:
        """Dest-keyed, typed flags; a ConfigError under the bundled fallback says why that table was used."""
        reject_harness_flags(config, fix="remove it from the config; use --model/the engine settings")
        table = self.flag_table()
        try:
            return table.check(dict(config))
        except ConfigError as exc:
            if self.table_warning is None:
                raise
            raise type(exc)(exc.message, file=exc.file, key=exc.key, fix=exc.fix, note=self.table_warning) from None

    def flag_table(self) -> FlagTable:
        """The installed SGLang's flags (its own parser, cached per interpreter + version), else the bundled
        0.5.23 table with a warning (``table_warning``, also logged)."""
        if self._table is None:
            self._table = self._load_table()
        return self._table

    def sglang_version(self) -> str | None:
        install = self._probe()
        return install[0] if install else None

    def _probe(self) -> tuple[str, str] | None:
        """(version, install location) of the interpreter's sglang, None if it has none; asked once."""
        if self._probed:
            return self._install
        try:
            proc = subprocess.run(
                [self.python, "-c", _PROBE_SNIPPET],
                capture_output=True,
                text=True,
                timeout=60,
                check=False,
                env=self._subprocess_env(),
            )
        except FileNotFoundError as exc:
            raise EngineError(
                f"Python interpreter {self.python!r} not found (set the engine's python to an interpreter with sglang)"
            ) from exc
        except subprocess.TimeoutExpired:
            return None  # not remembered: a slow first start may pass next time
        self._probed = True
        self._install = None
        if proc.returncode == 0:
            try:
                found = json.loads((proc.stdout.strip().splitlines() or [""])[-1])
                if found.get("version"):
                    self._install = (str(found["version"]), str(found.get("location", "")))
            except (ValueError, AttributeError):
                pass
        return self._install

    def _subprocess_env(self) -> dict[str, str]:
        """What the probe and the dump run with: the launch's environment (a PYTHONPATH there counts)."""
        return {**os.environ, **self.extra_env}

    def cache_path(self) -> Path | None:
        """Where this interpreter's flag dump is cached (None when it has no sglang)."""
        install = self._probe()
        if install is None:
            return None
        version, location = install
        key = hashlib.sha256(f"{os.path.realpath(self.python)}|{version}|{location}".encode()).hexdigest()[:16]
        return self.cache_dir / f"{key}.json"

    def _load_table(self) -> FlagTable:
        install = self._probe()
        if install is None:
            return self._fallback(f"sglang is not importable by {self.python}")
        version, location = install
        cached = self.cache_path()
        rows = self._read_cache(cached, version)
        if rows is None:
            try:
                rows = self.dump_flags()
            except EngineError as exc:
                return self._fallback(str(exc))
            self._write_cache(
                cached,
                FlagCache(
                    schema=_CACHE_SCHEMA,
                    python=os.path.realpath(self.python),
                    version=version,
                    location=location,
                    rows=rows,
                ),
            )
        return FlagTable.from_json(rows, version=version)

    def dump_flags(self) -> list[FlagRow]:
        """The installed SGLang's argparse actions as flag rows (one subprocess); EngineError when it fails."""
        what = f"dumping sglang's flags with {self.python}"
        try:
            proc = subprocess.run(
                [self.python, "-c", DUMP_SCRIPT],
                capture_output=True,
                text=True,
                timeout=DUMP_TIMEOUT_S,
                check=False,
                env=self._subprocess_env(),
            )
        except FileNotFoundError as exc:
            raise EngineError(f"{what}: interpreter not found") from exc
        except subprocess.TimeoutExpired as exc:
            raise EngineError(f"{what} timed out after {DUMP_TIMEOUT_S:.0f} s") from exc
        if proc.returncode != 0:
            last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
            raise EngineError(f"{what} failed (exit {proc.returncode}): {last}")
        try:
            return parse_dump(proc.stdout)
        except ValueError as exc:
            raise EngineError(f"{what} gave no usable table: {exc}") from exc

    def _fallback(self, reason: str) -> FlagTable:
        self.table_warning = (
            f"flags are checked against the bundled sglang {BUNDLED_VERSION} table, not the installed one's "
            f"parser ({reason})"
        )
        log.warning("%s", self.table_warning)
        return FlagTable.bundled()

    @staticmethod
    def _read_cache(path: Path | None, version: str) -> list[FlagRow] | None:
        if path is None or not path.is_file():
            return None
        try:
            data = json.loads(path.read_text())
            if (
                isinstance(data, dict)
                and data.get("schema") == _CACHE_SCHEMA
                and data.get("version") == version
                and _valid_rows(data.get("rows"))
            ):
                return cast(list[FlagRow], list(data["rows"]))
        except (OSError, ValueError):
            pass
        try:
            path.unlink(missing_ok=True)  # an old-format or corrupt cache is rebuilt, not trusted
        except OSError:
            pass
        return None

    @staticmethod
    def _write_cache(path: Path | None, data: FlagCache) -> None:
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data))
            os.replace(tmp, path)  # concurrent workers never read half a file
        except OSError as exc:
            log.warning("cannot cache sglang's flags at %s: %s", path, exc)

    # -- the device the planner plans with ---------------------------------------------------------------
    @classmethod
    def planner_gpu(cls, settings: EngineSettings, gpu_index: int) -> GpuProfile:
        """The GPU the server runs on, read through NVML (name, total memory, compute capability →
        ``sglang.gpus.profile_for_device``); a study's ``sim_gpu`` that names another GPU is a ConfigError saying
        both. Where there is no device to read (SGLang's CPU backend, no NVIDIA driver) ``sim_gpu`` stands in
        (default b200 on the CPU backend; without a driver and without sim_gpu, the GpuError)."""
        if settings.device == "cpu":
            return load_gpu(settings.sim_gpu or "b200")
        try:
            reader = NvmlReader(gpu_index)
        except GpuError:
            if settings.sim_gpu is None:
                raise
            return load_gpu(settings.sim_gpu)  # no driver here to read: the named profile stands
        try:
            name, total_mib, capability = reader.describe()
        finally:
            reader.close()
        device = profile_for_device(name, total_mib, capability)
        if settings.sim_gpu is not None:
            named = load_gpu(settings.sim_gpu)
            if named.name != device.name:
                raise ConfigError(
                    f"sim_gpu is {named.name!r} but GPU {gpu_index} is {name} ({device.name})",
                    key="engine.sim_gpu",
                    fix=f"remove sim_gpu (the device's profile is used) or set it to {device.name!r}",
                )
        return device

    def gpu_reader(self, gpu_index: int | None) -> GpuReader:
        if self.device == "cpu":
            return HostMemoryReader()
        return NvmlReader(0 if gpu_index is None else gpu_index)
