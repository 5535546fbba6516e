"""The Slurm launcher on the real cluster (CI: a single-node one from ``.ci/slurm.sh``): a simulated server as a
batch job, stopped by ``scancel``; a job cancelled from outside; the batch script's quoting; the harness's death.
The argv and error tests need no cluster. Every cluster test leaves ``squeue`` empty (``launchcase_slurm``)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
from launchcase_slurm import case, empty_queue, queue, slurm_missing

from autotune.errors import ServerError
from autotune.launch import LaunchSpec
from autotune.launch.base import GpuReading
from autotune.launch.ports import free_port, port_is_free
from autotune.launch.slurm import (
    CANCELLED_CODE,
    GONE,
    SlurmJob,
    SlurmLauncher,
    SlurmSettings,
    exit_code,
    job_script,
)

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def cluster():
    why = slurm_missing()
    if why:
        pytest.skip(why)
    with empty_queue():
        yield


def _sim(env, label: str = "sim", **kw) -> LaunchSpec:
    port = free_port()
    return LaunchSpec(
        argv=env.sim_argv(port),
        port=port,
        env=dict(env.env),
        gpus=(0,),
        log_path=env.work / f"{label}.log",
        run_dir=env.work / "runs",
        name=f"autotune-test-{label}-{port}",
        **kw,
    )


def _job_fields(job_id: str) -> dict[str, str]:
    out = subprocess.run(["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True).stdout
    return dict(w.split("=", 1) for w in out.split() if "=" in w)


def test_slurm_exit_codes_read_like_popen():
    assert exit_code("0:0") == 0
    assert exit_code("3:0") == 3
    assert exit_code("0:15") == -15
    assert exit_code("0:9") == -9


def test_only_a_cancel_that_is_not_ours_marks_the_job_cancelled(tmp_path):
    spec = LaunchSpec(argv=["srv"], port=1, log_path=tmp_path / "s.log")
    outside, ours, failed = (SlurmJob(spec, "n") for _ in range(3))
    for job, job_id in ((outside, "7"), (ours, "8"), (failed, "9")):
        job.job_id = job_id
    ours._stopping = True  # what stop() sets before its own scancel
    outside._note("CANCELLED", "0:0", "None")
    ours._note("CANCELLED", "0:0", "None")
    failed._note("FAILED", "1:0", "NonZeroExitCode")
    assert outside.cancelled and "Slurm job 7 CANCELLED" in (outside.reason or "")
    assert outside.exit_code == CANCELLED_CODE
    assert not ours.cancelled and not failed.cancelled and failed.exit_code == 1


def test_sbatch_argv_carries_the_settings_and_the_gpu_count(tmp_path):
    launcher = SlurmLauncher(
        SlurmSettings(partition="gpu", account="lab", time="00:30:00", extra_args=("--constraint=h200",))
    )
    spec = LaunchSpec(argv=["srv"], port=1, log_path=tmp_path / "s.log", gpus=(2, 3))
    argv = launcher.sbatch_argv(spec, "job-a", tmp_path / "job-a.sbatch")
    assert argv[:2] == ["sbatch", "--parsable"] and argv[-1] == str(tmp_path / "job-a.sbatch")
    assert ["--job-name", "job-a"] == argv[argv.index("--job-name") : argv.index("--job-name") + 2]
    assert ["--output", str(tmp_path / "s.log")] == argv[argv.index("--output") : argv.index("--output") + 2]
    for arg in (
        "--gres=gpu:2",
        "--partition=gpu",
        "--account=lab",
        "--time=00:30:00",
        "--constraint=h200",
        "--export=ALL",
    ):
        assert arg in argv
    cpu = launcher.sbatch_argv(LaunchSpec(argv=["srv"], port=1, log_path=tmp_path / "s.log"), "b", tmp_path / "b")
    assert not any(a.startswith("--gres") for a in cpu)
    bare = SlurmLauncher().sbatch_argv(spec, "c", tmp_path / "c")
    assert not any(a.startswith(("--partition", "--account", "--time")) for a in bare)  # the cluster's defaults


def test_the_script_selects_the_specs_gpus_only_when_slurm_bound_none(tmp_path):
    spec = LaunchSpec(argv=["srv", "--port", "1"], port=1, log_path=tmp_path / "s.log", gpus=(1, 0))
    script = job_script(spec, SlurmLauncher().device_env(spec.gpus))
    assert (
        'if [ -z "${SLURM_JOB_GPUS:-}" ]; then export CUDA_DEVICE_ORDER=PCI_BUS_ID CUDA_VISIBLE_DEVICES=1,0; fi'
        in script
    )
    assert script.rstrip().endswith("exec srv --port 1")
    assert "CUDA" not in job_script(spec, {})


def test_no_sbatch_is_a_clear_server_error(tmp_path, monkeypatch):
    monkeypatch.setenv("PATH", str(tmp_path))  # nothing on it
    spec = LaunchSpec(argv=["srv"], port=free_port(), log_path=tmp_path / "s.log")
    with pytest.raises(ServerError, match="sbatch/scancel/scontrol not found"):
        SlurmLauncher().start(spec)


def test_a_sim_server_job_starts_serves_and_is_stopped_by_scancel(cluster, tmp_path):
    with case(tmp_path) as env:
        spec = _sim(env)
        job = env.launcher.start(spec)
        try:
            job.wait_ready(30)
            assert job.alive and job.poll() is None
            fields = _job_fields(job.job_id)
            assert fields["JobState"] == "RUNNING" and fields["JobName"] == spec.name
            assert any(line.startswith(f"{job.job_id} {spec.name} RUNNING") for line in queue())
            with httpx.Client(timeout=5, trust_env=False) as client:
                assert client.get(f"{job.base_url}/health").status_code == 200
        finally:
            code = job.stop(grace_s=5.0, release_timeout_s=20.0)
        assert code == 0, job.log_tail()  # SIGTERM drained and exited cleanly
        assert "COMPLETED" in (job.reason or "")
        assert "SIGTERM received" in job.log_text()  # the grace signal reached the server itself (exec)
        assert not job.alive and queue() == []
        assert port_is_free(spec.host, spec.port) and job.teardown_error is None
        assert not job.cancelled  # our own scancel is no outside cancel


def test_a_job_cancelled_from_outside_is_reported_dead_with_a_reason(cluster, tmp_path):
    with case(tmp_path) as env:
        spec = _sim(env, label="outside")
        job = env.launcher.start(spec)
        try:
            job.wait_ready(30)
            subprocess.run(["scancel", "--full", "--signal=KILL", job.job_id], check=True)
            deadline = time.monotonic() + 15
            while job.alive and time.monotonic() < deadline:
                time.sleep(0.1)
            assert not job.alive
            code = job.poll()
            assert code is not None and code not in (0, GONE)
            assert job.reason and job.job_id in job.reason and ("CANCELLED" in job.reason or "FAILED" in job.reason)
        finally:
            job.stop(grace_s=1.0, release_timeout_s=20.0)
        assert queue() == [] and port_is_free(spec.host, spec.port)


def test_the_batch_script_quotes_the_argv(cluster, tmp_path):
    prompt = "a prompt with spaces, $HOME, `ls`, 'quotes' and \"more\"; echo pwned"
    argv = [sys.executable, "-c", "import sys; print('ARGV=' + repr(sys.argv[1:]))", prompt, "--x=$((1+1))"]
    spec = LaunchSpec(
        argv=argv,
        port=free_port(),
        log_path=tmp_path / "q.log",
        run_dir=tmp_path / "runs",
        name="autotune-test-quoting",
    )
    job = SlurmLauncher(watchdog_grace_s=1.0).start(spec)
    try:
        deadline = time.monotonic() + 20
        while job.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
    finally:
        job.stop(grace_s=1.0, release_timeout_s=20.0)
    assert job.exit_code == 0, job.log_text()
    assert f"ARGV={[prompt, '--x=$((1+1))']!r}" in job.log_text()
    assert job.log_text().count("\n") == 1  # one print: no word of the prompt ran as a command
    assert (tmp_path / "runs" / "autotune-test-quoting.sbatch").is_file()


HARNESS = textwrap.dedent("""
    import sys
    from pathlib import Path
    from autotune.launch import LaunchSpec
    from autotune.launch.slurm import SlurmLauncher
    port, work = int(sys.argv[1]), Path(sys.argv[2])
    spec = LaunchSpec(argv=[sys.executable, "-c", "import time; time.sleep(120)"], port=port,
                      log_path=work / "h.log", run_dir=work, name="autotune-test-harness-death")
    job = SlurmLauncher(watchdog_grace_s=1.0).start(spec)
    print(job.job_id, flush=True)
    import time; time.sleep(120)
""")


def test_a_job_does_not_outlive_its_harness(cluster, tmp_path):
    harness = subprocess.Popen(
        [sys.executable, "-c", HARNESS, str(free_port()), str(tmp_path)],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ},
    )
    try:
        assert harness.stdout is not None
        job_id = harness.stdout.readline().strip()
        assert job_id and any(line.startswith(job_id) for line in queue())
        harness.kill()  # SIGKILL: no cleanup code of the harness runs
        harness.wait(timeout=10)
        deadline = time.monotonic() + 20
        while queue() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert queue() == []
        assert "cancelled Slurm job" in Path(tmp_path / "h.log").read_text()
    finally:
        harness.kill()


def _trial(tmp_path, monkeypatch, hook=None, measure_s=2.0):
    from autotune.config import Timeouts
    from autotune.harness.engines import make_engine
    from autotune.harness.setup import TrialHooks, TrialSetup
    from autotune.harness.trial import run_trial
    from autotune.harness.workload import WorkloadSpec

    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))  # the job inherits it (--export=ALL)
    engine = make_engine(
        "sim", model_path="qwen3.6-27b", sim_gpu="b200", sim_options={"startup_s": 0.3, "release_s": 0.3}
    )
    prompts = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
    setup = TrialSetup(
        engine=engine,
        workload=WorkloadSpec(prompts=prompts, sample_size=40, warmup_s=0.5, measure_s=measure_s),
        gpu_index=1,
        run_dir=tmp_path / "runs",
        launcher=SlurmLauncher(watchdog_grace_s=1.0),
        timeouts=Timeouts(startup_s=30, teardown_s=15, grace_s=3),
    )
    return run_trial(setup, {"max_running_requests": 8}, trial_dir=tmp_path / "trial", hooks=TrialHooks(on_phase=hook))


def _gpu_released(tmp_path) -> bool:
    from autotune.sim import device

    return device.read(1, tmp_path / "devices").used_mib == 0


def test_a_trial_runs_its_server_as_a_slurm_job(cluster, tmp_path, monkeypatch):
    seen: list[list[str]] = []

    def hook(name, info):
        if name == "measuring" and not seen:
            seen.append(queue())

    result = _trial(tmp_path, monkeypatch, hook)
    assert result.status == "ok", result.reason
    assert result.metrics.output_tok_s > 0 and result.exit_code == 0
    assert seen and len(seen[0]) == 1 and seen[0][0].endswith("RUNNING")  # the server was the one Slurm job
    assert "fired up and ready to roll" in (tmp_path / "trial" / "server.log").read_text()
    assert queue() == [] and _gpu_released(tmp_path)
    # the server shuts down in well under 5 s (SIGTERM to it alone, the simulated GPU back 0.3 s later): its
    # teardown is bounded by that, not by the release timeout (15 s here); the figure goes into the docs
    print(f"slurm trial teardown: {result.durations_s['teardown']:.2f} s")
    assert result.durations_s["teardown"] < 15.0 and "teardown" not in (result.reason or "")


def test_a_trial_whose_job_is_cancelled_mid_window_is_interrupted_not_a_crash(cluster, tmp_path, monkeypatch):
    cancelled: list[str] = []

    def hook(name, info):
        if name == "measuring" and not cancelled:
            job_id = queue()[0].split()[0]
            subprocess.run(["scancel", "--full", "--signal=KILL", job_id], check=True)
            cancelled.append(job_id)

    result = _trial(tmp_path, monkeypatch, hook, measure_s=20.0)
    assert cancelled
    assert result.status == "interrupted", result.reason  # an outside scancel is not the config's fault
    assert f"Slurm job {cancelled[0]} CANCELLED" in (result.reason or "")
    assert result.exit_code not in (None, 0)
    assert f"JOB {cancelled[0]} ON" in (result.log_tail or "") + (tmp_path / "trial" / "server.log").read_text()
    assert result.durations_s["measure"] < 10  # noticed at once, not at the window's end
    assert queue() == [] and _gpu_released(tmp_path)


# -- the stop as SGLang expects it, and what a job leaves on its node -------------------------------------------
FAMILY = textwrap.dedent("""
    import os, signal, subprocess, sys, time
    marks = sys.argv[1]
    def note(text):
        with open(marks, "a") as fh:
            fh.write(text + "\\n")
    child = subprocess.Popen([sys.executable, "-c", (
        "import signal, sys, time\\n"
        "def term(*_):\\n"
        "    open(sys.argv[1], 'a').write('child: TERM\\\\n'); sys.exit(0)\\n"
        "signal.signal(signal.SIGTERM, term)\\n"
        "open(sys.argv[1], 'a').write('child: up\\\\n')\\n"
        "time.sleep(120)\\n"), marks])
    def term(*_):
        time.sleep(0.5)  # a child that got the signal too has written its line by now
        note("main: TERM")
        child.kill()
        child.wait()
        sys.exit(0)
    signal.signal(signal.SIGTERM, term)
    note("main: up")
    time.sleep(120)
""")


@pytest.mark.slow
def test_the_stop_signals_the_servers_main_process_only_then_the_whole_job(cluster, tmp_path):
    """SGLang's launcher drains and stops its own children; a SIGTERM that reached a child first would send it down
    its crash path (the real engine: "Subprocess detokenizer … crashed with exit code -15")."""
    marks = tmp_path / "marks"
    spec = LaunchSpec(
        argv=[sys.executable, "-c", FAMILY, str(marks)],
        port=free_port(),
        log_path=tmp_path / "f.log",
        run_dir=tmp_path / "runs",
        name="autotune-test-family",
    )
    job = SlurmLauncher(watchdog_grace_s=1.0).start(spec)
    try:
        deadline = time.monotonic() + 30
        while (not marks.exists() or "child: up" not in marks.read_text()) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert "main: up" in marks.read_text() and "child: up" in marks.read_text(), job.log_text()
    finally:
        job.stop(grace_s=10.0, release_timeout_s=30.0)
    lines = marks.read_text().splitlines()
    assert "main: TERM" in lines and "child: TERM" not in lines, lines
    assert job.exit_code == 0 and job.teardown_error is None, (job.reason, job.teardown_error)


class _NeverReleased:
    """A memory reading that never comes back to its level before the start (host memory on a busy host)."""

    def __init__(self) -> None:
        self.used_gib = 10.0

    def read(self) -> GpuReading:
        self.used_gib += 1.0
        return GpuReading(used_gib=self.used_gib, total_gib=1000.0)

    def close(self) -> None:
        pass


@pytest.mark.slow
def test_a_job_without_gpus_is_not_held_for_the_memory_wait_and_its_shm_files_go_while_a_neighbours_stay(
    cluster, tmp_path
):
    """A server with no GPU (SGLang's CPU backend) and a reader of host memory that never returns to its earlier
    level: the teardown does not wait for it (it once waited the whole release timeout, 60 s, per launch). The
    simulated servers create SGLang's /dev/shm files; the job's go once it is gone, a neighbour's stay."""
    from autotune.launch.local import LocalLauncher

    shm = tmp_path / "shm"
    shm.mkdir()
    earlier = shm / "sglang_loads_0123456789ab_00000000.shm"
    earlier.write_bytes(b"there before the job")
    env = {"AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}
    sim = [
        sys.executable,
        "-m",
        "autotune.sim",
        "--host",
        "127.0.0.1",
        "--model-path",
        "qwen3.6-27b",
        "--sim-gpu",
        "b200",
        "--sim-startup-s",
        "0.1",
        "--sim-release-s",
        "0.2",
        "--sim-warmup-s",
        "0",
        "--sim-shm",
        str(shm),
    ]
    runs = tmp_path / "runs"
    timings = []
    for label in ("first", "second"):  # two launches: neither leaves a file behind for the next
        port = free_port()
        job = SlurmLauncher(watchdog_grace_s=1.0).start(
            LaunchSpec(
                argv=[*sim, "--port", str(port)],
                port=port,
                env=env,
                gpus=(),
                log_path=tmp_path / f"{label}.log",
                run_dir=runs,
                shm_dir=shm,
                name=f"autotune-test-shm-{label}-{port}",
            ),
            gpu_reader=_NeverReleased(),
        )
        neighbour = None
        try:
            job.wait_ready(60)
            made = {p.name for p in shm.iterdir()} - {earlier.name}
            assert any(n.startswith("sglang_loads_") for n in made) and any(n.startswith("deepspeed") for n in made)
            nport = free_port()  # a neighbour on this host starts while the job runs: its files are new too, held
            neighbour = LocalLauncher(watchdog_grace_s=1.0).start(
                LaunchSpec(
                    argv=[*sim, "--port", str(nport)],
                    port=nport,
                    env=env,
                    gpus=(3,),
                    log_path=tmp_path / "n.log",
                    run_dir=runs,
                    shm_dir=tmp_path / "elsewhere",
                )
            )
            neighbour.wait_ready(60)
            theirs = {p.name for p in shm.iterdir()} - made - {earlier.name}
            assert theirs
            t0 = time.monotonic()
            job.stop(grace_s=5.0, release_timeout_s=60.0)
            timings.append(time.monotonic() - t0)
            left = {p.name for p in shm.iterdir()}
            assert left == {earlier.name} | theirs, (left, job.removed_shm, job.unattributed_shm)
            kept = {n for n in made if not n.startswith("sem.")}  # a clean exit unlinks its semaphores itself
            assert kept <= set(job.removed_shm) <= made and set(job.unattributed_shm) == theirs  # listed, left
            assert job.teardown_error is None and job.exit_code == 0
            assert all(name in job.log_text() for name in job.removed_shm)  # what was removed, listed in its log
        finally:
            job.stop(grace_s=1.0, release_timeout_s=10.0)
            if neighbour is not None:
                neighbour.stop(grace_s=2.0, release_timeout_s=10.0)
        for name in theirs:  # the neighbour's own stop is not this test's: clear what it leaves for the next launch
            (shm / name).unlink(missing_ok=True)
    print(f"slurm teardown of a simulated CPU server: {', '.join(f'{t:.2f} s' for t in timings)}")
    assert max(timings) < 30.0  # not the 60 s memory wait (the verdict must not depend on the host's load)
