"""Run a Python module with some flags' values read from files, so that no secret is on its command line or in its
logs: ``python secretargv.py --api-key=@keys/api.key -- -m sglang.launch_server …``. Standard library only, run by
path under the fleet's interpreter. docs/fleet.md ("Keys past loopback").
"""

from __future__ import annotations

import os
import runpy
import signal
import sys

USAGE = "usage: secretargv.py --flag=@FILE [--flag=@FILE ...] -- -m MODULE [ARG ...]"


def split(argv: list[str]) -> tuple[list[str], str, list[str]]:
    """(the flags with their values read, the module, its arguments)."""
    if "--" not in argv:
        raise SystemExit(USAGE)
    cut = argv.index("--")
    secret, rest = argv[:cut], argv[cut + 1 :]
    if len(rest) < 2 or rest[0] != "-m":
        raise SystemExit(USAGE)
    flags: list[str] = []
    for item in secret:
        name, sep, path = item.partition("=@")
        if not sep or not name.startswith("--") or not path:
            raise SystemExit(f"{item!r}: {USAGE}")
        with open(path, encoding="utf-8") as fh:
            # one token, ``--flag=VALUE``: a value that begins with "-" would read as a flag of its own
            flags.append(f"{name}={fh.read().strip()}")
    return flags, rest[1], rest[2:]


def scrub(data: bytes, secrets: list[bytes]) -> bytes:
    for secret in secrets:
        data = data.replace(secret, b"***")
    return data


def filter_output(values: list[str]) -> None:
    """Route this process's stdout and stderr (and its children's) through a forked filter that replaces every
    value with ``***`` and writes whole lines to where they went before. The filter ignores SIGTERM and SIGINT (the
    server drains and keeps writing; the filter ends at end of input) and dies with the group on SIGKILL."""
    secrets = [v.encode() for v in values if v]
    if not secrets:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    read_fd, write_fd = os.pipe()
    if os.fork() == 0:
        os.close(write_fd)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        keep = max(len(s) for s in secrets)
        pending = b""
        while chunk := os.read(read_fd, 65536):
            # scrubbed before any byte leaves; a value cut by the read stays in ``pending`` until it is whole
            pending = scrub(pending + chunk, secrets)
            cut = pending.rfind(b"\n") + 1 or (len(pending) - keep if len(pending) > 65536 else 0)
            if cut:
                os.write(1, pending[:cut])
                pending = pending[cut:]
        if pending:
            os.write(1, pending)
        os._exit(0)
    os.close(read_fd)
    os.dup2(write_fd, 1)
    os.dup2(write_fd, 2)
    os.close(write_fd)


def main(argv: list[str]) -> None:
    flags, module, args = split(argv)
    filter_output([flag.partition("=")[2] for flag in flags])
    sys.argv = [module, *args, *flags]
    runpy.run_module(module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main(sys.argv[1:])
