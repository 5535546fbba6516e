"""The fleet's keys, for a fleet that binds beyond loopback: one API key and one admin key, in user-only files,
never on a command line. docs/fleet.md ("Keys past loopback").
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

from autotune.deploy.fleetfile import KEYS_DIR, Fleet, present_keys, private_folder, replace_file
from autotune.launch.ssh import is_loopback

SCRIPT = Path(__file__).with_name("secretargv.py")
ADMIN_ID = "autotune:autotune fleet:admin"  # the control-plane key's id, name and role


def folder(fleet: Fleet) -> Path:
    return fleet.resolve(KEYS_DIR)


def api_file(fleet: Fleet) -> Path:
    return folder(fleet) / "api.key"


def admin_file(fleet: Fleet) -> Path:
    return folder(fleet) / "admin.key"


def admin_arg_file(fleet: Fleet) -> Path:
    """``--control-plane-api-keys``'s value (``id:name:role:key``), for the router's launch."""
    return folder(fleet) / "router-admin.arg"


def ensure(fleet: Fleet) -> None:
    """The fleet's keys, made once (a folder and files only the user can read, one writer at a time: servers start
    in parallel); kept as they are afterwards."""
    with private_folder(folder(fleet)):
        for path in (api_file(fleet), admin_file(fleet)):
            if not path.is_file():
                # prefixed: a bare token begins with "-" one time in 64, which a command line would read as a flag
                replace_file(path, f"autotune-{secrets.token_urlsafe(32)}\n", private=True)
        if not admin_arg_file(fleet).is_file():
            replace_file(admin_arg_file(fleet), f"{ADMIN_ID}:{admin_file(fleet).read_text().strip()}\n", private=True)
    present_keys(fleet)


def wrap(argv: list[str], values: dict[str, Path], *, script: str | None = None) -> list[str]:
    """``[python, -m, module, ...]`` started so that each ``values`` flag is read from its file in the process."""
    if len(argv) < 3 or argv[1] != "-m":
        raise ValueError(f"cannot pass keys to {argv[:3]}: not a 'python -m module' command")
    flags = [f"{flag}=@{path}" for flag, path in values.items()]
    return [argv[0], script or str(SCRIPT), *flags, "--", *argv[1:]]


def server_argv(fleet: Fleet, argv: list[str], *, relative: bool = False) -> list[str]:
    """A server's command with the fleet's API key (none for a fleet without keys)."""
    if not fleet.keys:
        return argv
    ensure(fleet)
    path = api_file(fleet)
    return wrap(argv, {"--api-key": path.relative_to(fleet.base_dir) if relative else path})


def router_argv(fleet: Fleet, argv: list[str], *, relative: bool = False) -> list[str]:
    """The router's command with the API key (the job's and its workers') and the control-plane admin key."""
    if not fleet.keys:
        return argv
    ensure(fleet)
    files = {"--api-key": api_file(fleet), "--control-plane-api-keys": admin_arg_file(fleet)}
    return wrap(argv, {k: p.relative_to(fleet.base_dir) if relative else p for k, p in files.items()})


def private_log(fleet: Fleet, path: Path) -> None:
    """On a fleet with keys, a log only the user can read: SGLang logs its arguments, its ``--api-key`` among them
    (0.5.23 redacts only the watermark's secrets: ``srt/entrypoints/engine.py`` L173-174)."""
    if fleet.keys:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.touch(mode=0o600, exist_ok=True)
        os.chmod(path, 0o600)


def exposed(fleet: Fleet) -> list[str]:
    """What of the fleet listens beyond loopback, in words (empty: everything is on 127.0.0.1)."""
    out = [f"server {s.name} binds {s.bind}" for s in fleet.servers if not s.local or not is_loopback(s.bind)]
    if fleet.router is not None and fleet.router.router and not is_loopback(fleet.router.host):
        out.append(f"the router binds {fleet.router.host}")
    return out
