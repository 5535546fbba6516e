"""Run a Python module with some flags' values read from files, so that no secret is on its command line.

    python secretargv.py --api-key=@keys/api.key -- -m sglang.launch_server --port 30000 ...

Each ``--flag=@FILE`` before ``--`` becomes ``--flag VALUE`` (the file's text, stripped) at the end of the module's
arguments inside this process: other users' ``ps`` shows the file's name, never the value. Standard library only,
run as a script by path: the fleet's interpreter (SGLang's, the router's) need not have autotune installed.
"""

from __future__ import annotations

import runpy
import sys

USAGE = "usage: secretargv.py --flag=@FILE [--flag=@FILE ...] -- -m MODULE [ARG ...]"


def split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(the flags with their values read, the module, its arguments)."""
    if "--" not in argv:
        raise SystemExit(USAGE)
    cut = argv.index("--")
    secret, rest = argv[:cut], argv[cut + 1:]
    if len(rest) < 2 or rest[0] != "-m":
        raise SystemExit(USAGE)
    flags: list[str] = []
    for item in secret:
        name, sep, path = item.partition("=@")
        if not sep or not name.startswith("--") or not path:
            raise SystemExit(f"{item!r}: {USAGE}")
        with open(path, encoding="utf-8") as fh:
            flags += [name, fh.read().strip()]
    return flags, rest[1], rest[2:]


def main(argv: list[str]) -> None:
    flags, module, args = split(argv)
    sys.argv = [module, *args, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
