"""``launch_fleet.sh``: a bash script that starts each server of the fleet (and its router) detached, with a log
and a pid file each, for a fleet run without autotune's own ``fleet up``. Every argv token goes through
``shlex.quote``; secrets stay ``${NAME}`` references the script's runner must set.
"""

from __future__ import annotations

import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from autotune.redaction import reference


@dataclass(frozen=True)
class ScriptEntry:
    """One process the script starts: its log and pid file, its GPUs as CUDA_VISIBLE_DEVICES lists them (``0,1``;
    empty leaves CUDA_VISIBLE_DEVICES alone), and its command."""

    log: str
    pid: str
    gpus: str
    argv: list[str]


def _env_lines(env: Mapping[str, str]) -> list[str]:
    """``export`` lines; a ``${NAME}`` reference stops the script (``set -u``) unless its runner sets NAME."""
    lines = []
    for key, value in env.items():
        name = reference(value)
        if name is None:
            lines.append(f"export {key}={shlex.quote(value)}")
        else:
            lines += [
                f': "${{{name}:?set {name} in your environment: autotune writes no secret to disk}}"',
                f'export {key}="${{{name}}}"',
            ]
    return lines


def launch_script(
    servers: Sequence[ScriptEntry],
    *,
    header: str,
    env: Mapping[str, str] | None = None,
    elsewhere: Sequence[str] = (),
    private: bool = False,
) -> str:
    """A bash script starting each server detached (own session, so its pid is its process group), with a
    log and a pid file per server. Every argv token goes through ``shlex.quote``; ``env`` is exported first
    (references to secrets as ``${NAME}``). A server's ``gpus`` is its group as CUDA_VISIBLE_DEVICES lists it
    (``0,1``); empty leaves CUDA_VISIBLE_DEVICES alone (SGLang's CPU backend). ``elsewhere`` names servers on other
    hosts, which this script cannot start. ``private``: files it makes are the user's alone (a fleet with keys,
    whose servers log them)."""
    lines = [
        "#!/usr/bin/env bash",
        *(f"# {line}" for line in header.splitlines()),
        "set -euo pipefail",
        'cd "$(dirname "$0")"',
        *(["umask 077  # the fleet's keys: SGLang logs its arguments, its --api-key among them"] if private else []),
        "",
    ]
    if env:
        lines += ["# The study's engine environment.", *_env_lines(env), ""]
    lines += [
        "start() {  # start LOG PIDFILE GPUS ARGV...  (GPUS: 3 or 0,1; empty leaves CUDA_VISIBLE_DEVICES alone)",
        "  local log=$1 pidfile=$2 gpus=$3",
        "  shift 3",
        '  if [[ -f "$pidfile" ]] && kill -0 "$(cat "$pidfile")" 2>/dev/null; then',
        '    echo "already running: $pidfile (pid $(cat "$pidfile"))"',
        "    return 0",
        "  fi",
        '  mkdir -p "$(dirname "$log")" "$(dirname "$pidfile")"',
        '  if [[ -n "$gpus" ]]; then',
        '    CUDA_VISIBLE_DEVICES="$gpus" setsid "$@" >"$log" 2>&1 </dev/null &',
        "  else",
        '    setsid "$@" >"$log" 2>&1 </dev/null &',
        "  fi",
        '  echo $! >"$pidfile"',
        '  echo "started ${gpus:+gpu $gpus: }pid $! (log $log)"',
        "}",
        "",
    ]
    for server in servers:
        tokens = [server.log, server.pid, server.gpus, *server.argv]
        lines.append("start " + " ".join(shlex.quote(str(t)) for t in tokens))
    if elsewhere:
        lines += [
            "",
            "# On other hosts (start them with: autotune fleet up --fleet fleet.toml):",
            *(f"#   {name}" for name in elsewhere),
        ]
    return "\n".join(lines) + "\n"
