"""The ssh launcher reads the host's GPUs and cleans the host's /dev/shm through its transport.

No GPU host is reachable from the tests: ``nvidia-smi`` is a fake transport that answers the launcher's queries
the way ``--format=csv,noheader,nounits`` prints (``[N/A]``, ``[Not Supported]`` included). The /dev/shm cleanup
runs for real through the loopback transport (``bash -c`` here, what sshd would run there) on a folder of the
test's own, with the simulator leaving SGLang-shaped files in it.
"""

from __future__ import annotations

import dataclasses
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
from launchcase import SIM_FLAGS
from launchcase_ssh import Loopback

from autotune.errors import FleetError, GpuError
from autotune.harness.engines.sim import SimGpuReader
from autotune.harness.gpu import GpuMonitor
from autotune.harness.tenancy import occupancy
from autotune.launch.base import GpuReading, LaunchSpec
from autotune.launch.memory import wait_released
from autotune.launch.ports import free_port, port_is_free
from autotune.launch.remote_memory import NoReading, RemoteGpuReader, parse_apps, parse_gpus, value
from autotune.launch.remote_shm import RemoteShm, facts_command, parse_facts
from autotune.launch.ssh import SshLauncher, is_loopback
from autotune.sim import device

pytestmark = pytest.mark.timeout(90)

GIB = 1024.0
UUIDS = {
    0: "GPU-1f0e2d3c-0000-4a5b-8c9d-000000000000",
    1: "GPU-1f0e2d3c-1111-4a5b-8c9d-111111111111",
    2: "GPU-1f0e2d3c-2222-4a5b-8c9d-222222222222",
}


class FakeSmi:
    """A GPU host as the transport sees it: answers the two ``nvidia-smi`` queries for the GPUs named by ``-i``."""

    def __init__(self, used_mib: dict[int, float], *, apps: list[str] | None = None):
        self.used_mib = dict(used_mib)
        self.apps = apps or []
        self.commands: list[str] = []
        self.fail: Exception | None = None

    def __call__(self, host: str, command: str, timeout_s: float) -> tuple[int, str, str]:
        assert host == "ops@gpu-node-7:2222" and timeout_s <= 10, (host, timeout_s)
        self.commands.append(command)
        if self.fail is not None:
            raise self.fail
        ids = [int(i) for i in shlex.split(command.split("&&")[0])[-1].split(",")]
        if any(i not in self.used_mib for i in ids):
            return 6, "", "No devices were found"  # nvidia-smi's answer for an index it does not have
        if "--query-compute-apps" in command:
            head = "".join(f"{i}, {UUIDS[i]}\n" for i in ids)
            return 0, f"{head}--apps--\n" + "".join(f"{a}\n" for a in self.apps), ""
        lines = [
            f"{i}, {self.used_mib[i]:.0f}, 143771, {40 + i}, {'[N/A]' if i == 1 else f'{300 + i}.25'}, 1980"
            for i in ids
        ]
        return 0, "\n".join(lines) + "\n", ""


def _remote(transport: FakeSmi) -> SshLauncher:
    return SshLauncher(host="ops@gpu-node-7:2222", transport=transport)


def _no_local(gpus: tuple[int, ...]) -> SimGpuReader:
    raise AssertionError(f"this host's reader was asked for {gpus} of a remote host")


# -- the nvidia-smi answer ---------------------------------------------------------------------------------
def test_nvidia_smi_csv_lines_parse_and_unreported_fields_are_none():
    text = (
        "WARNING: infoROM is corrupted at gpu 0000:19:00.0\n"  # what nvidia-smi may print first
        "0, 81234, 143771, 97, 689.12, 1980\n"
        "1, 1024, 143771, [N/A], [Not Supported], [N/A]\n"
        "No devices were found\n"
        "2, [N/A], 143771, 0, 75.50\n"
    )  # a field short: not a reading
    gpus = parse_gpus(text)
    assert sorted(gpus) == [0, 1]
    assert gpus[0] == GpuReading(
        used_gib=81234 / GIB, total_gib=143771 / GIB, util_pct=97.0, power_w=689.12, sm_clock_mhz=1980.0
    )
    assert gpus[1].used_gib == 1.0 and gpus[1].util_pct is None and gpus[1].power_w is None
    assert [value(v) for v in ("[N/A]", "N/A", "[Not Supported]", "[Insufficient Permissions]", " 12.5 ", "")] == [
        None,
        None,
        None,
        None,
        12.5,
        None,
    ]


def test_compute_apps_map_back_to_the_gpu_index_by_uuid():
    text = (
        f"0, {UUIDS[0]}\n1, {UUIDS[1]}\n--apps--\n"
        f"{UUIDS[1]}, 4242, 70210, python3 -m sglang.launch_server, tp 1\n"
        f"{UUIDS[0]}, 777, [N/A], /usr/bin/tenant\n"
        "garbage\n"
    )
    apps = parse_apps(text)
    assert apps == [
        {
            "gpu": 1,
            "pid": 4242,
            "exited": False,
            "used_gib": 70210 / GIB,
            "name": "python3 -m sglang.launch_server, tp 1",
        },
        {"gpu": 0, "pid": 777, "exited": False, "used_gib": None, "name": "/usr/bin/tenant"},
    ]


# -- the reader the launcher hands out ---------------------------------------------------------------------
def test_a_remote_group_is_read_with_one_call_per_reading():
    smi = FakeSmi({0: 2048, 1: 100_000, 2: 512})
    reader = _remote(smi).memory_reader((0, 1), _no_local)
    assert isinstance(reader, RemoteGpuReader)
    reading = reader.read()
    assert len(smi.commands) == 1
    assert shlex.split(smi.commands[0]) == [
        "nvidia-smi",
        "--query-gpu=index,memory.used,memory.total,utilization.gpu,power.draw,clocks.sm",
        "--format=csv,noheader,nounits",
        "-i",
        "0,1",
    ]
    assert reading.used_gib == pytest.approx(100_000 / GIB)  # the fullest GPU decides headroom
    assert [d.index for d in reading.devices] == [0, 1]
    assert reading.power_w == pytest.approx(300.25)  # GPU 1 reports none: the group's draw is GPU 0's
    with GpuMonitor(reader, interval_s=0.01) as monitor:
        time.sleep(0.2)
    peaks = monitor.peaks()
    assert monitor.errors == 0 and len(monitor.samples) >= 5
    assert len(smi.commands) == 1 + len(monitor.samples)  # never a call per GPU
    assert [g.index for g in peaks.per_gpu] == [0, 1]
    assert peaks.peak_used_gib == pytest.approx(100_000 / GIB, abs=1e-3)


def test_a_single_gpu_reading_and_its_processes_serve_the_tenancy_check():
    smi = FakeSmi({0: 30_000, 1: 0}, apps=[f"{UUIDS[0]}, 999999, 29000, tenant-server"])
    reader = _remote(smi).memory_reader((0,), _no_local)
    assert reader.read().used_gib == pytest.approx(30_000 / GIB)
    assert reader.processes() == [
        {"gpu": 0, "pid": 999999, "exited": False, "used_gib": 29000 / GIB, "name": "tenant-server"}
    ]
    occ = occupancy(reader, 0)
    assert occ.busy and [h.pid for h in occ.holders] == [999999]
    assert "--query-compute-apps=gpu_uuid,pid,used_memory,process_name" in smi.commands[-1]
    assert "-i 0" in smi.commands[-1]


def test_a_failed_reading_is_an_error_the_monitor_counts_and_the_host_is_not_asked_every_sample():
    smi = FakeSmi({0: 1024})
    smi.fail = FleetError("ssh ops@gpu-node-7:2222: ConnectionRefusedError")
    reader = _remote(smi).memory_reader((0,), _no_local)
    with pytest.raises(GpuError, match="cannot read the GPUs of ops@gpu-node-7:2222: ssh"):
        reader.read()
    with GpuMonitor(reader, interval_s=0.01) as monitor:
        time.sleep(0.2)
    assert monitor.errors >= 5 and not monitor.samples
    assert len(smi.commands) == 1  # within RETRY_S every reading fails without a connection attempt
    smi.fail = None
    clock = [0.0]
    reader = RemoteGpuReader(
        lambda c, t: smi("ops@gpu-node-7:2222", c, t), (0, 5), host="gpu-node-7", clock=lambda: clock[0]
    )
    with pytest.raises(GpuError, match=r"failed \(exit 6\): No devices were found"):  # an index it lacks
        reader.read()
    with pytest.raises(GpuError):
        reader.read()
    assert reader.calls == 1
    clock[0] = 2.5  # past RETRY_S: asked again
    with pytest.raises(GpuError):
        reader.read()
    assert reader.calls == 2
    partial = RemoteGpuReader(lambda c, t: (0, "0, 10, 20, 0, 1.0, 1\n", ""), (0, 3), host="gpu-node-7")
    with pytest.raises(GpuError, match="nvidia-smi on gpu-node-7 shows no GPU 3"):
        partial.read()


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "ops@127.0.0.2:2222", "LOCALHOST"])
def test_a_loopback_host_uses_this_hosts_reader(host, tmp_path):
    local = SimGpuReader(0, str(tmp_path))
    launcher = SshLauncher(host=host, transport=FakeSmi({}))
    assert launcher.memory_reader((0,), lambda gpus: local) is local
    assert is_loopback("::1") and not is_loopback("gpu-node-7") and not is_loopback("10.0.0.5")


def test_a_remote_server_without_gpus_gets_a_reader_of_nothing():
    smi = FakeSmi({})
    reader = _remote(smi).memory_reader((), _no_local)
    assert isinstance(reader, NoReading)
    assert reader.read() == GpuReading()  # every value None
    assert wait_released(reader, 1024.0, timeout_s=5.0)  # nothing waits on it
    assert smi.commands == []


# -- /dev/shm on the host ----------------------------------------------------------------------------------
HOLDER = (
    "import mmap, os, sys, time\n"
    "for p in sys.argv[1:]:\n"
    "    fd = os.open(p, os.O_RDWR | os.O_CREAT, 0o600); os.write(fd, b'x' * 4096)\n"
    "    globals().setdefault('maps', []).append(mmap.mmap(fd, 4096)); os.close(fd)\n"  # a mapping, no fd
    "print('held', flush=True); time.sleep(120)\n"
)


def _hold(*paths: Path) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLDER, *map(str, paths)], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "held"
    return proc


def _end(proc: subprocess.Popen) -> None:
    proc.kill()
    proc.wait(10)
    assert proc.stdout is not None
    proc.stdout.close()


def _call(transport: Loopback):
    return lambda command, timeout_s: transport("127.0.0.1", command, timeout_s)


def test_the_rules_hold_over_the_transport(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    (shm / "sglang_loads_000000000000_00000000.shm").write_text("before the start")
    transport = Loopback()
    files = RemoteShm(_call(transport), str(shm), {31500}, host="127.0.0.1")
    files.snapshot()
    assert files.before == {"sglang_loads_000000000000_00000000.shm"}
    server = _hold(shm / "sem.mp-k2x93001", shm / "sglang_loads_0123456789ab_127001ff.shm")  # the server's group
    neighbour = _hold(shm / "sem.mp-neighbr1")  # a live neighbour's semaphore
    odd = "deepspeed_allreduce_buffer_0_x'$(touch PWNED)'_31500_0"  # the server's port, a hostile-looking name
    try:
        (shm / odd).write_text("")
        (shm / "deepspeed_allreduce_buffer_0_127.0.0.1_31999_0").write_text("")  # another server's port
        (shm / "sem.mp-orphaned").write_text("")  # new, and nobody holds it
        (shm / "unrelated_app").write_text("")
        files.observe(server.pid)
        assert sorted(files.owned) == sorted([odd, "sem.mp-k2x93001", "sglang_loads_0123456789ab_127001ff.shm"])
        assert facts_command(str(shm), server.pid).count("ps -e") == 1
    finally:
        _end(server)
    try:
        removed, left = files.release()
    finally:
        _end(neighbour)
    assert removed == sorted([odd, "sem.mp-k2x93001", "sem.mp-orphaned", "sglang_loads_0123456789ab_127001ff.shm"])
    assert left == ["deepspeed_allreduce_buffer_0_127.0.0.1_31999_0", "sem.mp-neighbr1"]
    assert sorted(p.name for p in shm.iterdir()) == sorted(
        ["sglang_loads_000000000000_00000000.shm", "unrelated_app", *left]
    )
    assert not any(Path(d, "PWNED").exists() for d in (tmp_path, shm, Path.cwd()))
    assert all(host == "127.0.0.1" for host, _ in transport.commands)


def test_no_file_name_can_pass_for_another_record(tmp_path):
    shm = tmp_path / "shm"
    shm.mkdir()
    forged = "sglang_x\ni 12345\nf 1 1000 f sglang_forged"  # newlines are legal in a name; NUL is not
    (shm / forged).write_text("")
    (shm / "sglang_loads_a_b.shm").write_text("")
    (shm / "sglang_dir").mkdir()
    (shm / "autotune-link").symlink_to(shm / "sglang_loads_a_b.shm")
    code, out, _ = Loopback()("127.0.0.1", facts_command(str(shm), None), 30)
    assert code == 0
    facts = parse_facts(out)
    assert facts.files == {
        forged: (shm / forged).stat().st_ino,
        "sglang_loads_a_b.shm": (shm / "sglang_loads_a_b.shm").stat().st_ino,
    }
    assert facts.held == set()  # no holders asked for, and none forged
    other_uid = parse_facts(out.replace(f"u {os.getuid()}\0", "u 123456\0"))
    assert other_uid.files == {}  # another user's files are never ours


def test_stop_removes_the_servers_files_on_the_host_and_names_a_foreign_one(tmp_path):
    devices, shm = tmp_path / "devices", tmp_path / "shm"
    shm.mkdir()
    (shm / "sglang_loads_aaaaaaaaaaaa_00000000.shm").write_text("there before the server")
    transport = Loopback()
    launcher = SshLauncher(host="127.0.0.1", remote_dir=str(tmp_path / "remote"), transport=transport)
    port = free_port()
    spec = LaunchSpec(
        argv=[
            sys.executable,
            "-m",
            "autotune.sim",
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            *SIM_FLAGS,
            "--sim-shm",
            str(shm),
        ],
        port=port,
        env={device.ENV_DIR: str(devices)},
        gpus=(0,),
        log_path=tmp_path / "server.log",
        run_dir=tmp_path / "runs",
        shm_dir=shm,
    )
    server = launcher.start(spec, gpu_reader=SimGpuReader(0, str(devices)))
    foreign = None
    try:
        server.wait_ready(60)
        made = sorted(p.name for p in shm.iterdir() if p.name != "sglang_loads_aaaaaaaaaaaa_00000000.shm")
        assert len(made) == 4, made  # the load segment, the all-reduce buffer, two semaphores
        foreign = _hold(shm / "sglang_loads_bbbbbbbbbbbb_ffffffff.shm")  # another server's, during ours
    finally:
        server.stop(grace_s=5.0, release_timeout_s=30.0)
        if foreign is not None:
            _end(foreign)
    assert server.teardown_error is None
    assert port_is_free("127.0.0.1", port) and device.read(0, devices).used_mib == 0
    assert set(server.removed_shm) >= {n for n in made if not n.startswith("sem.mp-")}  # sems: unlinked on exit
    assert server.unattributed_shm == ["sglang_loads_bbbbbbbbbbbb_ffffffff.shm"]
    assert sorted(p.name for p in shm.iterdir()) == [
        "sglang_loads_aaaaaaaaaaaa_00000000.shm",
        "sglang_loads_bbbbbbbbbbbb_ffffffff.shm",
    ]
    assert all(host == "127.0.0.1" for host, _ in transport.commands)


class _Flaky:
    """A GPU reader that fails while ``broken`` is set, or for its next ``fail_next`` readings (the host
    unreachable for a while), counting its failures."""

    def __init__(self, inner: SimGpuReader):
        self.inner, self.broken, self.fail_next, self.failures = inner, False, 0, 0

    def read(self) -> GpuReading:
        if self.broken or self.fail_next > 0:
            self.fail_next -= 1
            self.failures += 1
            raise GpuError("cannot read the GPUs of gpu-node-7: ssh: TimeoutError")
        return self.inner.read()

    def close(self) -> None:
        self.inner.close()


def _plain_server(tmp_path: Path, reader: _Flaky):
    devices = tmp_path / "devices"
    launcher = SshLauncher(host="127.0.0.1", remote_dir=str(tmp_path / "remote"), transport=Loopback())
    port = free_port()
    spec = LaunchSpec(
        argv=[sys.executable, "-m", "autotune.sim", "--host", "127.0.0.1", "--port", str(port), *SIM_FLAGS],
        port=port,
        env={device.ENV_DIR: str(devices)},
        gpus=(0,),
        log_path=tmp_path / "server.log",
        run_dir=tmp_path / "runs",
    )
    server = launcher.start(spec, gpu_reader=reader)
    server.wait_ready(60)
    return server


def test_a_host_whose_gpus_stay_unreadable_after_the_stop_is_reported_within_the_release_timeout(tmp_path):
    reader = _Flaky(SimGpuReader(0, str(tmp_path / "devices")))
    server = _plain_server(tmp_path, reader)
    reader.broken = True
    t0 = time.monotonic()
    server.stop(grace_s=5.0, release_timeout_s=3.0)
    assert time.monotonic() - t0 < 3.0 + 5.0 + 3.0  # the grace, the release timeout, and the host's round trips
    assert server.teardown_error == (
        "GPU memory not checked in the 3 s after the stop: cannot read the GPUs of gpu-node-7: ssh: TimeoutError"
    )
    assert reader.failures >= 3  # tried again while the timeout ran, not given up at the first failure


def test_a_reading_that_fails_a_moment_during_the_release_wait_is_tried_again(tmp_path):
    reader = _Flaky(SimGpuReader(0, str(tmp_path / "devices")))
    server = _plain_server(tmp_path, reader)
    reader.fail_next = 3  # then the host answers again
    server.stop(grace_s=5.0, release_timeout_s=30.0)
    assert reader.failures == 3 and server.teardown_error is None
    assert device.read(0, tmp_path / "devices").used_mib == 0


def test_a_fleets_down_cleans_the_host_from_the_record_its_start_left(tmp_path):
    """``fleet up`` and ``fleet down`` are two commands: the second has only the pid file and the start's record."""
    from types import SimpleNamespace

    from autotune.deploy import remote

    devices, shm = tmp_path / "devices", tmp_path / "shm"
    shm.mkdir()
    (shm / "sglang_loads_aaaaaaaaaaaa_00000000.shm").write_text("there before the fleet")
    port = free_port()
    fleet = SimpleNamespace(remote_dir=str(tmp_path / "remote"))
    server = SimpleNamespace(
        name="s0", host="127.0.0.1", address="127.0.0.1", port=port, log="logs/s0.log", pid="run/s0.pid"
    )
    argv = [
        sys.executable,
        "-m",
        "autotune.sim",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        *SIM_FLAGS,
        "--sim-shm",
        str(shm),
    ]
    spec = remote.server_spec(server, argv, env={device.ENV_DIR: str(devices)}, gpus=(0,))
    up = Loopback()
    handle = SshLauncher(host="127.0.0.1", remote_dir=fleet.remote_dir, transport=up).start(
        dataclasses.replace(spec, shm_dir=shm)
    )
    record = tmp_path / "remote/run/s0.shm"
    foreign = None
    try:
        handle.wait_ready(60)
        handle.release()  # `fleet up` ends here; the server serves on
        assert record.exists() and "sglang_loads_aaaaaaaaaaaa_00000000.shm" in record.read_text()
        made = {p.name for p in shm.iterdir()} - {"sglang_loads_aaaaaaaaaaaa_00000000.shm"}
        assert len(made) == 4, made
        foreign = _hold(shm / "sglang_loads_bbbbbbbbbbbb_ffffffff.shm")
        down = Loopback()
        assert (
            remote.stop_server(fleet, server, grace_s=5.0, transport=down) == []
        )  # a fresh launcher, as `down` makes;
        # it was recorded and everything released in time
    finally:
        if foreign is not None:
            _end(foreign)
        subprocess.run(["bash", "-c", f"kill -9 -{handle.host_pid} 2>/dev/null"], check=False)
    assert sorted(p.name for p in shm.iterdir()) == [
        "sglang_loads_aaaaaaaaaaaa_00000000.shm",
        "sglang_loads_bbbbbbbbbbbb_ffffffff.shm",
    ]
    assert not record.exists() and not (tmp_path / "remote/run/s0.pid").exists()
    assert any("/proc/$p/fd" in command for _, command in down.commands)  # its group was read before the kill


def test_a_group_that_outlives_the_kill_is_a_problem_the_stop_reports():
    """A host whose server group will not die (a process in uninterruptible sleep): the stop signals the group, kills
    it twice, and says so, within its kill wait, instead of reporting the server stopped."""
    sent: list[str] = []

    def host(name: str, command: str, timeout_s: float) -> tuple[int, str, str]:
        sent.append(command)
        if command.startswith("cat "):  # the pid file, and no record of the start's /dev/shm listing
            return 0, "4242\0", ""
        return 0, "alive\n" if "kill -0" in command else "", ""

    launcher = SshLauncher(host="gpu-node-7", remote_dir="/srv/autotune", transport=host)
    problems = launcher.stop_pid_file("run/s0.pid", grace_s=0.2, release_timeout_s=0.2)
    assert problems == ["process group 4242 on gpu-node-7 still there 5 s after the kill"]
    assert [c for c in sent if "-TERM" in c] == ["kill -TERM -4242 2>/dev/null; true"]
    assert sum("kill -KILL -4242" in c for c in sent) == 2  # once after the grace, once more after the wait
    assert "rm -f /srv/autotune/run/s0.pid /srv/autotune/run/s0.shm" in sent  # its files go all the same


FAKE_SMI = """import sys
from autotune.sim import device
args = sys.argv[1:]
fields = next(a.split("=", 1)[1] for a in args if a.startswith("--query-gpu=")).split(",")
for index in (int(i) for i in args[args.index("-i") + 1].split(",")):
    r = device.read(index, sys.argv[0] + ".devices")
    row = {"index": str(index), "memory.used": f"{r.used_mib:.0f}", "utilization.gpu": f"{r.util_pct:.0f}",
           "memory.total": "[N/A]" if r.total_mib is None else f"{r.total_mib:.0f}", "power.draw": "[N/A]",
           "clocks.sm": "[Not Supported]"}
    print(", ".join(row[f] for f in fields))
"""


def test_the_monitor_and_the_release_check_read_the_host_through_its_shell(tmp_path, monkeypatch):
    """The reader's exact line, run by the host's shell: a stand-in ``nvidia-smi`` on its PATH answers from the
    simulated GPUs (as the real one answers from the driver), so the release wait is the host's reading."""
    devices, bin_dir = tmp_path / "devices", tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    smi.write_text(f"#!{sys.executable}\n{FAKE_SMI}")
    smi.chmod(0o755)
    (bin_dir / "nvidia-smi.devices").symlink_to(devices, target_is_directory=True)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    transport = Loopback()
    launcher = SshLauncher(host="127.0.0.1", remote_dir=str(tmp_path / "remote"), transport=transport)
    reader = RemoteGpuReader(
        lambda command, timeout_s: launcher.call(command, timeout_s=timeout_s), (0,), host=launcher.host
    )
    port = free_port()
    spec = LaunchSpec(
        argv=[sys.executable, "-m", "autotune.sim", "--host", "127.0.0.1", "--port", str(port), *SIM_FLAGS],
        port=port,
        env={device.ENV_DIR: str(devices)},
        gpus=(0,),
        log_path=tmp_path / "server.log",
        run_dir=tmp_path / "runs",
    )
    server = launcher.start(spec, gpu_reader=reader)
    try:
        server.wait_ready(60)
        with GpuMonitor(reader, interval_s=0.05) as monitor:
            time.sleep(0.5)
        assert monitor.errors == 0 and monitor.peaks().peak_used_gib > 1.0
        assert monitor.peaks().peak_power_w is None  # [N/A] is no reading, not zero
    finally:
        server.stop(grace_s=5.0, release_timeout_s=30.0)
    assert server.teardown_error is None and device.read(0, devices).used_mib == 0
    smi_calls = [c for _, c in transport.commands if c.startswith("nvidia-smi")]
    assert len(smi_calls) == reader.calls >= 2 + len(monitor.samples)  # the baseline, each sample, the release wait
