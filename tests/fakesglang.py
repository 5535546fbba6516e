"""A stand-in "interpreter with SGLang" for the engine tests: no torch, no GPU, just SGLang's parser shape.

``make_fake_sglang(tmp)`` writes a ``sglang`` package (with a ``sglang-<version>.dist-info`` so
``importlib.metadata`` finds it) whose ``sglang.srt.server_args.ServerArgs.add_cli_args(parser)`` declares the
options of a flag table the way SGLang declares them: ``store_true``, ``BooleanOptionalAction``, typed values
through functions named like SGLang's (``human_readable_int``, ``loads``, ...), one custom action and
help-suppressed flags. A wrapper script puts the package on ``PYTHONPATH`` and execs this Python, so it can be
passed as the engine's interpreter. Each import of ``server_args`` appends a byte to ``dump-calls``.
"""

from __future__ import annotations

import json
import stat
import sys
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

SERVER_ARGS = r'''
import argparse
import json
import os

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "table.json")) as f:
    TABLE = json.load(f)
with open(os.path.join(HERE, "calls-path.txt")) as f:
    CALLS = f.read()
with open(CALLS, "a") as f:
    f.write("x")
print("INFO: importing the fake sglang prints to stdout, as real imports may")


def human_readable_int(text):
    return int(text)


def loads(text):
    return json.loads(text)


def json_list_type(text):
    return json.loads(text)


def nullable_str(text):
    return None if text.lower() in ("none", "null") else text


def parse_cuda_graph_backend_arg(text):
    return text


def parse_cuda_graph_config_arg(text):
    return json.loads(text)


TYPES = {"int": int, "float": float, "str": str, "human_readable_int": human_readable_int, "loads": loads,
         "json_list_type": json_list_type, "nullable_str": nullable_str,
         "parse_cuda_graph_backend_arg": parse_cuda_graph_backend_arg,
         "parse_cuda_graph_config_arg": parse_cuda_graph_config_arg}


class DeprecatedChoiceAction(argparse.Action):
    """Like SGLang's deprecation shims: a custom action that maps an old option onto a new dest."""

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


class ServerArgs:
    @staticmethod
    def add_cli_args(parser):
        for row in TABLE["rows"]:
            if row["dest"] == "help":
                continue  # the parser's own -h/--help
            kw = {"dest": row["dest"], "default": row["default"]}
            if row["dest"] in TABLE["suppressed"]:
                kw["help"] = argparse.SUPPRESS
            flags = row["flags"]
            if row["is_store_true"]:
                parser.add_argument(*flags, action="store_true", **kw)
            elif row["nargs"] == 0:
                parser.add_argument(flags[0], action=argparse.BooleanOptionalAction, **kw)
            elif row["type"] is None:
                parser.add_argument(*flags, action=DeprecatedChoiceAction, choices=row["choices"], **kw)
            else:
                parser.add_argument(*flags, type=TYPES[row["type"]], choices=row["choices"], nargs=row["nargs"],
                                    **kw)
'''

# Flags the fake hides from --help (deprecated shims, as SGLang hides them). None is a BooleanOptionalAction:
# that action appends to its help text, so argparse would not hide it either.
SUPPRESSED = (
    "disable_cuda_graph",
    "enable_dp_attention",
    "enable_amd_monokernel",
    "enable_flashinfer_allreduce_fusion",
)


@dataclass
class FakeSGLang:
    python: Path  # the wrapper to pass as the engine's interpreter
    root: Path  # what the wrapper puts on PYTHONPATH
    calls: Path  # one byte per import of server_args (i.e. per dump)

    def dumps(self) -> int:
        return len(self.calls.read_text()) if self.calls.exists() else 0


def bundled_rows() -> list[dict[str, Any]]:
    return json.loads(resources.files("autotune").joinpath("data/sglang-0.5.23-flags.json").read_text())


def make_fake_sglang(
    tmp: Path,
    *,
    version: str = "0.5.23",
    rows: list[dict[str, Any]] | None = None,
    suppressed: tuple[str, ...] = SUPPRESSED,
    server_args: str = SERVER_ARGS,
) -> FakeSGLang:
    root = tmp / "site"
    pkg = root / "sglang" / "srt"
    pkg.mkdir(parents=True)
    (root / "sglang" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "server_args.py").write_text(server_args)
    table = {"rows": bundled_rows() if rows is None else rows, "suppressed": list(suppressed)}
    (pkg / "table.json").write_text(json.dumps(table))
    calls = tmp / "dump-calls"
    (pkg / "calls-path.txt").write_text(str(calls))
    dist = root / f"sglang-{version}.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: sglang\nVersion: {version}\n")
    python = tmp / "python-with-sglang"
    python.write_text(f'#!/bin/sh\nPYTHONPATH="{root}${{PYTHONPATH:+:$PYTHONPATH}}" exec "{sys.executable}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    return FakeSGLang(python=python, root=root, calls=calls)
