#!/usr/bin/env python3
"""A fake ``docker`` CLI for the container launcher's tests: containers cannot run on our machines.

``run -d`` starts the image's command on this host under a small supervisor (which records the exit code, as the
daemon does); ``-e`` sets its environment (``-e NAME`` takes the value from this CLI's environment, like docker),
``--gpus device=N`` / ``--device nvidia.com/gpu=N`` become ``CUDA_VISIBLE_DEVICES=N`` (so the simulated engine
registers on GPU N), and ``-p IP:H:C`` requires H == C and makes the command's ``--host 0.0.0.0`` listen on IP
(so tests stay on loopback). The image name is ignored. Also: ``inspect -f``, ``logs``, ``stop -t``, ``kill``,
``rm -f``, ``wait``, ``ps``. State lives in ``$FAKEDOCKER_STATE``; every call's argv is appended to its
``calls.jsonl`` for assertions.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

STATE = Path(os.environ.get("FAKEDOCKER_STATE") or "/nonexistent-fakedocker-state")
VALUE_FLAGS = {
    "--name",
    "--gpus",
    "--device",
    "--shm-size",
    "-p",
    "--publish",
    "-e",
    "--env",
    "-v",
    "--volume",
    "--label",
    "--ulimit",
    "--entrypoint",
    "-w",
    "--network",
}


def box(name: str) -> Path:
    return STATE / "containers" / name


def load(name: str) -> dict | None:
    try:
        return json.loads((box(name) / "state.json").read_text())
    except (OSError, ValueError):
        return None


def save(name: str, state: dict) -> None:
    tmp = box(name) / "state.json.tmp"
    tmp.write_text(json.dumps(state))
    tmp.replace(box(name) / "state.json")


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    stat = Path(f"/proc/{pid}/stat")
    return not (stat.exists() and stat.read_text().split(") ")[-1].startswith("Z"))


def running(state: dict) -> bool:
    return state.get("exit_code") is None and pid_alive(state.get("supervisor"))


def fail(message: str, code: int = 1) -> int:
    print(f"Error: {message}", file=sys.stderr)
    return code


def parse_run(args: list[str]) -> tuple[dict, list[str]]:
    opts: dict = {"env": [], "publish": [], "volumes": [], "gpus": [], "detach": False, "name": None}
    i = 0
    while i < len(args) and args[i].startswith("-"):
        flag, eq, inline = args[i].partition("=")
        if flag in VALUE_FLAGS and not eq:
            value, i = args[i + 1], i + 2
        else:
            value, i = (inline if eq else None), i + 1
        if flag in ("-d", "--detach"):
            opts["detach"] = True
        elif flag == "--name":
            opts["name"] = value
        elif flag in ("-e", "--env"):
            opts["env"].append(value)
        elif flag in ("-p", "--publish"):
            opts["publish"].append(value)
        elif flag in ("-v", "--volume"):
            opts["volumes"].append(value)
        elif flag == "--gpus":
            opts["gpus"] += value.strip('"').removeprefix("device=").split(",")
        elif flag == "--device" and value.startswith("nvidia.com/gpu="):
            opts["gpus"].append(value.split("=", 1)[1])
    return opts, args[i + 1 :]  # args[i] is the image


def cmd_run(args: list[str]) -> int:
    opts, command = parse_run(args)
    name = opts["name"] or f"fake-{os.getpid()}"
    if not opts["detach"]:
        return fail("the fake CLI runs detached containers only (-d)", 125)
    if not command:
        return fail("no command after the image", 125)
    if load(name) is not None:
        return fail(f'Conflict. The container name "/{name}" is already in use', 125)
    bind = None
    for spec in opts["publish"]:
        ip, host_port, container_port = spec.rsplit(":", 2) if spec.count(":") == 2 else ("0.0.0.0", *spec.split(":"))
        if host_port != container_port:
            return fail(f"the fake CLI publishes a port on itself only, not {spec}", 125)
        bind = ip
    if bind is not None:  # the container's 0.0.0.0 is its own namespace; here it is the published address
        pairs = zip(["", *command[:-1]], command, strict=True)
        command = [bind if prev == "--host" and arg == "0.0.0.0" else arg for prev, arg in pairs]
    env = {k: os.environ[k] for k in ("PATH", "HOME", "LANG", "TMPDIR") if k in os.environ}
    for item in opts["env"]:
        key, eq, value = item.partition("=")
        if eq:
            env[key] = value
        elif key in os.environ:
            env[key] = os.environ[key]
    if opts["gpus"]:
        env["CUDA_VISIBLE_DEVICES"] = ",".join(opts["gpus"])
    box(name).mkdir(parents=True)
    save(name, {"name": name, "command": command, "env": env, "exit_code": None, "supervisor": None, "pid": None})
    sup = subprocess.Popen(
        [sys.executable, __file__, "_supervise", name],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
        env={**os.environ, "FAKEDOCKER_STATE": str(STATE)},
    )
    deadline = time.monotonic() + 10
    while (state := load(name)) is not None and state.get("pid") is None and time.monotonic() < deadline:
        time.sleep(0.01)
    print(f"{sup.pid:064x}")
    return 0


def cmd_supervise(name: str) -> int:
    """The daemon's part: run the command, keep its output, record its exit code."""
    state = load(name)
    assert state is not None
    with open(box(name) / "log", "wb") as log:
        try:
            proc = subprocess.Popen(
                state["command"],
                stdout=log,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
                env=state["env"],
                start_new_session=True,
            )
        except OSError as exc:
            log.write(f"exec failed: {exc}\n".encode())
            save(name, {**state, "supervisor": os.getpid(), "pid": 0, "exit_code": 127})
            return 0
        save(name, {**state, "supervisor": os.getpid(), "pid": proc.pid})
        code = proc.wait()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the container's other processes go with it
    except ProcessLookupError:
        pass
    if (state := load(name)) is not None:
        save(name, {**state, "exit_code": 128 - code if code < 0 else code})
    return 0


def signal_group(state: dict, sig: int) -> None:
    try:
        os.killpg(int(state["pid"]), sig)
    except (ProcessLookupError, TypeError, ValueError):
        pass


def wait_exit(name: str, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while (state := load(name)) is not None and running(state):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return True


def cmd_stop(args: list[str]) -> int:
    grace = 10.0
    if args[:1] in (["-t"], ["--time"]):
        grace, args = float(args[1]), args[2:]
    for name in args:
        state = load(name)
        if state is None:
            return fail(f"No such container: {name}")
        if running(state):
            signal_group(state, signal.SIGTERM)
            if not wait_exit(name, grace):
                signal_group(state, signal.SIGKILL)
                wait_exit(name, 10)
        print(name)
    return 0


def cmd_kill(args: list[str]) -> int:
    for name in args:
        state = load(name)
        if state is None or not running(state):
            return fail(f"cannot kill container: {name}: container is not running")
        signal_group(state, signal.SIGKILL)
        wait_exit(name, 10)
        print(name)
    return 0


def cmd_rm(args: list[str]) -> int:
    force = "-f" in args or "--force" in args
    for name in [a for a in args if not a.startswith("-")]:
        state = load(name)
        if state is None:
            if not force:
                return fail(f"No such container: {name}")
            continue
        if running(state):
            if not force:
                return fail(f"cannot remove container {name}: container is running", 1)
            signal_group(state, signal.SIGKILL)
            wait_exit(name, 10)
        shutil.rmtree(box(name), ignore_errors=True)
        print(name)
    return 0


def cmd_inspect(args: list[str]) -> int:
    fmt = "{{json .}}"
    if args[:1] in (["-f"], ["--format"]):
        fmt, args = args[1], args[2:]
    for name in args:
        state = load(name)
        if state is None:
            return fail(f"No such object: {name}")
        code = state.get("exit_code")
        fields = {
            "{{.State.Running}}": "true" if running(state) else "false",
            "{{.State.ExitCode}}": str(code if code is not None else 0),
            "{{.State.Pid}}": str(state.get("pid") if running(state) else 0),
            "{{.Name}}": f"/{name}",
        }
        out = fmt
        for key, value in fields.items():
            out = out.replace(key, value)
        print(out)
    return 0


def cmd_logs(args: list[str]) -> int:
    name = args[-1]
    if load(name) is None:
        return fail(f"No such container: {name}")
    sys.stdout.buffer.write((box(name) / "log").read_bytes() if (box(name) / "log").exists() else b"")
    return 0


def cmd_wait(args: list[str]) -> int:
    for name in args:
        if load(name) is None:
            return fail(f"No such container: {name}")
        wait_exit(name, 1e9)
        print((load(name) or {}).get("exit_code"))
    return 0


def cmd_ps(args: list[str]) -> int:
    every = "-a" in args or "--all" in args
    for path in sorted((STATE / "containers").glob("*")) if (STATE / "containers").is_dir() else []:
        state = load(path.name)
        if state is not None and (every or running(state)):
            print(path.name)
    return 0


COMMANDS = {
    "run": cmd_run,
    "stop": cmd_stop,
    "kill": cmd_kill,
    "rm": cmd_rm,
    "inspect": cmd_inspect,
    "logs": cmd_logs,
    "wait": cmd_wait,
    "ps": cmd_ps,
}


def main(argv: list[str]) -> int:
    if argv[:1] == ["_supervise"]:
        return cmd_supervise(argv[1])
    if not STATE.parent.is_dir():
        return fail("FAKEDOCKER_STATE is not set to a directory", 2)
    STATE.mkdir(exist_ok=True)
    with open(STATE / "calls.jsonl", "a") as calls:
        calls.write(json.dumps(argv) + "\n")
    if not argv or argv[0] not in COMMANDS:
        return fail(f"the fake CLI does not implement {argv[:1]}", 2)
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
