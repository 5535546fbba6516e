"""``python -m autotune.sim [SGLang flags] [--sim-* flags]``: one simulated SGLang 0.5.23 server process.

It behaves like a real launch from the outside: flag errors exit 2, bad flag combinations exit 1 with a
traceback, memory failures at startup print SGLang's messages and die by SIGKILL (137), as does a group with
fewer visible GPUs than the server's ranks need (``invalid device ordinal``), the port opens before
warm-up ends, and SIGTERM drains. Memory is planned from what the simulated GPU has free when it starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import random
import secrets
import signal
import socket
import sys
import tempfile
from pathlib import Path
from typing import Any

from autotune.errors import AutotuneError
from autotune.sim import args as sim_args
from autotune.sim import logs
from autotune.sim.status import ServerStatus


def die_by_sigkill() -> None:
    """SGLang's parent SIGKILLs its whole tree, itself included, when a child fails."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.kill(os.getpid(), signal.SIGKILL)


def _bad_args(message: str) -> int:
    # Argument resolution fails in the launcher's main process: a plain traceback and status 1.
    line = message if logs.error_line(message) == message else f"ValueError: {message}"
    sys.stderr.write(
        "Traceback (most recent call last):\n"
        '  File "site-packages/sglang/launch_server.py", line 86, in <module>\n'
        "    server_args = prepare_server_args(sys.argv[1:])\n"
        f"{line}\n"
    )
    sys.stderr.flush()
    return 1


SEM_CHARS = "abcdefghijklmnopqrstuvwxyz0123456789_"  # multiprocessing's random semaphore names


class ShmFiles:
    """What a real launch puts in /dev/shm, held open and mapped while it runs, as SGLang's processes hold them.

    Real-shaped names (no pid): the load-report segment, the CPU all-reduce buffer named after the dist port (a
    few KiB here, ~270 MB in SGLang) and multiprocessing semaphores. A clean exit unlinks only the semaphores.
    """

    def __init__(self, directory: str, *, host: str, dist_port: int):
        base = Path(directory)
        base.mkdir(parents=True, exist_ok=True)
        self._maps: list[mmap.mmap] = []
        self._fds: list[int] = []
        self.loads = self._create(base / f"sglang_loads_{secrets.token_hex(6)}_{secrets.token_hex(4)}.shm", 16384)
        self.buffer = self._create(base / f"deepspeed_allreduce_buffer_{os.getuid()}_{host}_{dist_port}_0", 8192)
        self.sems = [self._semaphore(base / f"sem.mp-{_sem_name()}") for _ in range(2)]

    def _create(self, path: Path, size: int) -> Path:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.write(fd, b"\0" * size)  # written, not sparse: the pages hold RAM like SGLang's
        self._maps.append(mmap.mmap(fd, size))
        self._fds.append(fd)
        return path

    def _semaphore(self, path: Path) -> Path:
        """glibc's ``sem_open``: map a temporary ``sem.XXXXXX``, link it to the real name, unlink the temporary.
        The mapping then shows in /proc/<pid>/maps only as ``sem.XXXXXX (deleted)`` — no entry names the
        ``sem.mp-*`` file, as on a real SGLang server; only the inode ties the two."""
        fd, tmp = tempfile.mkstemp(prefix="sem.", dir=path.parent)
        try:
            os.write(fd, b"\0" * 32)
            self._maps.append(mmap.mmap(fd, 32))
            os.link(tmp, path)
        finally:
            os.unlink(tmp)
            os.close(fd)
        return path

    def close_clean(self) -> None:
        """A clean exit: multiprocessing's resource tracker unlinks the semaphores; the rest stays (as observed)."""
        for sem in self.sems:
            sem.unlink(missing_ok=True)


def _sem_name() -> str:
    return "".join(secrets.choice(SEM_CHARS) for _ in range(8))


def dist_port(server_args: dict[str, Any], port: int) -> int:
    """SGLang's dist (nccl) port: ``--nccl-port``, else the server port plus a random 100-1000."""
    given = server_args.get("nccl_port")
    return int(given) if given else port + random.randint(100, 1000)


async def _phase(log: logs.Log, lines: list[str], seconds: float) -> None:
    log.lines(lines)
    if seconds > 0:
        await asyncio.sleep(seconds)


async def _startup(st: ServerStatus, log: logs.Log, total_s: float) -> None:
    """Print SGLang's startup sequence over ``total_s`` real seconds; die where SGLang would."""
    plan = st.plan
    if st.missing is not None:  # a rank past CUDA_VISIBLE_DEVICES dies on its first CUDA call, before loading
        log.lines(logs.invalid_device_ordinal(), rank=st.missing.label(st.server_args))
        log(logs.SIGQUIT)
        log(logs.kill_tree(os.getpid(), include_parent=True))
        die_by_sigkill()
    failure = failure_phase(plan)
    if failure == "load":
        log.lines(logs.load_lines(st)[:2])
        await _die(log, plan.message or "CUDA out of memory.", "pool")
    await _phase(log, logs.load_lines(st), 0.5 * total_s)
    st.report_device(busy=False, held_mib=st.weights_mib)
    if failure == "pool":
        await _die(log, plan.message or "Not enough memory. Please try to increase --mem-fraction-static.", "pool")
    await _phase(log, logs.pool_lines(st), 0.1 * total_s)
    st.report_device(busy=False, held_mib=st.pools_mib)
    if failure == "graph":
        log.lines(logs.graph_lines(st, fail=True))
        await _die(log, logs.capture_failure_text(plan.message or "CUDA out of memory."), "graph")
    await _phase(log, logs.graph_lines(st, fail=False), 0.4 * total_s)
    st.report_device(busy=False)
    log.lines(logs.ready_lines(st))


async def _die(log: logs.Log, message: str, phase: str) -> None:
    log.lines(logs.scheduler_exception(message, phase=phase))
    log(logs.SIGQUIT)
    log(logs.kill_tree(os.getpid(), include_parent=True))
    die_by_sigkill()
    await asyncio.sleep(3600)  # unreachable: SIGKILL cannot be caught


def failure_phase(plan: Any) -> str | None:
    """Where a startup OOM strikes: while sizing pools, or while capturing CUDA graphs."""
    if plan.failure != "startup_oom":
        return None
    msg = plan.message or ""
    if "Capture cuda graph" in msg:
        return "graph"
    return "load" if "loading weights" in msg else "pool"


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


def _uvicorn_log_config() -> dict[str, Any]:
    fmt = {"datefmt": "%Y-%m-%d %H:%M:%S", "use_colors": False}
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {
            "default": {
                "()": "uvicorn.logging.DefaultFormatter",
                "fmt": "[%(asctime)s] %(levelprefix)s %(message)s",
                **fmt,
            },
            "access": {
                "()": "uvicorn.logging.AccessFormatter",
                "fmt": '[%(asctime)s] %(levelprefix)s %(client_addr)s - "%(request_line)s" %(status_code)s',
                **fmt,
            },
        },
        "handlers": {
            "default": {"formatter": "default", "class": "logging.StreamHandler", "stream": "ext://sys.stdout"},
            "access": {"formatter": "access", "class": "logging.StreamHandler", "stream": "ext://sys.stdout"},
        },
        "loggers": {
            "uvicorn": {"handlers": ["default"], "level": "INFO", "propagate": False},
            "uvicorn.error": {"level": "INFO"},
            "uvicorn.access": {"handlers": ["access"], "level": "INFO", "propagate": False},
        },
    }


async def _serve(st: ServerStatus, log: logs.Log) -> int:
    import uvicorn

    from autotune.sim.server import SimServer, install_sigterm

    sim = st.args.sim
    await _startup(st, log, max(0.0, sim.startup_s))
    try:
        sock = _listen(st.host, st.port)
    except OSError as exc:
        log(
            f"ERROR:    [Errno {exc.errno}] error while attempting to bind on address ({st.host!r}, {st.port}): "
            f"{exc.strerror}"
        )
        return 1
    server = SimServer(st, log=log, on_fatal=die_by_sigkill)
    # SGLang's --ssl-certfile/--ssl-keyfile: HTTPS, as uvicorn serves it for SGLang
    certfile, keyfile = st.server_args.get("ssl_certfile"), st.server_args.get("ssl_keyfile")
    config = uvicorn.Config(
        server.app,
        log_config=_uvicorn_log_config(),
        lifespan="off",
        timeout_keep_alive=30,
        ssl_certfile=certfile,
        ssl_keyfile=keyfile,
    )
    prefixes = tuple(st.server_args.get("uvicorn_access_log_exclude_prefixes") or ())
    if prefixes:  # SGLang's --uvicorn-access-log-exclude-prefixes: no access line for these paths
        logging.getLogger("uvicorn.access").addFilter(
            lambda rec: (
                not (isinstance(rec.args, tuple) and len(rec.args) > 2 and str(rec.args[2]).startswith(prefixes))
            )
        )

    class _Server(uvicorn.Server):
        def capture_signals(self):  # SIGTERM belongs to the drain handler, not to uvicorn
            return contextlib.nullcontext()

    http = _Server(config)
    done = asyncio.Event()
    install_sigterm(server, done.set)
    server.start()
    task = asyncio.get_running_loop().create_task(http.serve(sockets=[sock]))
    port = sock.getsockname()[1]
    while not http.started and not task.done():
        await asyncio.sleep(0.01)
    scheme = "https" if certfile else "http"
    log(f"INFO:     Uvicorn running on {scheme}://{st.host}:{port} (Press CTRL+C to quit)")
    await asyncio.gather(server.warmup(), asyncio.sleep(max(0.0, sim.warmup_s)))
    if not server.draining:
        server.ready = True
        log(logs.READY)
    await done.wait()
    log(logs.kill_tree(os.getpid(), include_parent=False))
    http.should_exit = True
    await task
    return 0


def main(argv: list[str] | None = None) -> int:
    args = sim_args.parse(sys.argv[1:] if argv is None else argv)  # exits 2 on a flag error
    log = logs.Log(sys.stdout)
    try:
        st = ServerStatus.create(args, pid=os.getpid())
    except AutotuneError as exc:
        return _bad_args(str(exc))
    if st.plan.failure == "bad_args":
        return _bad_args(st.plan.message or "invalid server arguments")
    log(logs.server_args_line(st.resolved_args()))
    st.register_device()
    shm = None
    if args.sim.shm:
        shm = ShmFiles(args.sim.shm, host=st.host, dist_port=dist_port(st.server_args, st.port))
    try:
        rc = asyncio.run(_serve(st, log))
    finally:
        st.release_device()
    if shm is not None:
        shm.close_clean()
    return rc


if __name__ == "__main__":
    sys.exit(main())
