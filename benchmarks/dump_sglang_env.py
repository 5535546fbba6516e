"""Dump SGLang's environment-variable table (the ``Envs`` class of ``sglang/srt/environ.py``) to JSON.

Reads the source with ``ast`` (importing sglang needs torch): one row per field, ``name``, ``type`` (``bool``,
``int``, ``float``, ``str``, ``tuple``, ``json``), ``default`` (a literal, or null where the default is computed at
run time, e.g. per platform), ``secret`` and ``alias`` (the deprecated name it still reads). The bundled table
``autotune/data/sglang-0.5.23-env.json`` came from the 0.5.23 wheel::

    pip download sglang==0.5.23 --no-deps -d /tmp/sgl && unzip -q -o /tmp/sgl/sglang-0.5.23*.whl -d /tmp/sgl/src
    python benchmarks/dump_sglang_env.py /tmp/sgl/src/sglang/srt/environ.py --version 0.5.23 \\
        > autotune/data/sglang-0.5.23-env.json
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path
from typing import Any

TYPES = {
    "EnvBool": "bool",
    "EnvInt": "int",
    "EnvFloat": "float",
    "EnvStr": "str",
    "EnvTuple": "tuple",
    "EnvJSON": "json",
}


def _field_type(call: ast.Call) -> str | None:
    """``EnvBool(...)`` → ``bool``; the ``…WithAlias`` forms share their base's type."""
    name = call.func.id if isinstance(call.func, ast.Name) else None
    return TYPES.get((name or "").replace("WithAlias", ""))


def _literal(node: ast.expr | None) -> Any:
    if node is None:
        return None
    try:
        value = ast.literal_eval(node)
    except ValueError:  # computed (a callable, an enum member, an expression): known only at run time
        return None
    return list(value) if isinstance(value, tuple) else value


def rows(source: str) -> list[dict[str, Any]]:
    """One row per ``NAME = EnvX(default, ...)`` in ``class Envs``, in source order."""
    tree = ast.parse(source)
    envs = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Envs")
    out: list[dict[str, Any]] = []
    for node in envs.body:
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        kind = _field_type(node.value)
        target = node.targets[0]
        if kind is None or not isinstance(target, ast.Name):
            continue
        kw = {k.arg: k.value for k in node.value.keywords}
        default = node.value.args[0] if node.value.args else kw.get("default")
        out.append(
            {
                "name": target.id,
                "type": kind,
                "default": _literal(default),
                "secret": bool(_literal(kw.get("secret"))),
                "alias": _literal(kw.get("deprecated_name")),
            }
        )
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("environ", type=Path, help="sglang/srt/environ.py")
    parser.add_argument("--version", required=True, help="the SGLang version the file is from")
    args = parser.parse_args(argv)
    table = {
        "version": args.version,
        "source": "sglang/srt/environ.py (class Envs)",
        "vars": rows(args.environ.read_text()),
    }
    json.dump(table, sys.stdout, indent=1)
    sys.stdout.write("\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
