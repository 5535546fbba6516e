"""Sweeps over GPU groups: workers pinned to aligned groups for a fixed-size study, workers sharing a pool through
per-device locks when the space varies ``tp_size``, the per-GPU score, and the pool checks that fail on load.

The end-to-end tests start real simulated servers (0.2 s startup, 1 s windows) on a private simulated device
registry, so ``AUTOTUNE_SIM_DEVICE_DIR`` shows which GPUs each server held and that every one was released."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import optuna
import psutil
import pytest
from inprocess import run_cli
from optuna.trial import TrialState
from tinystudy import write_prompts

from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.launch.gpulocks import GpuLocks, Stopped
from autotune.launch.groups import aligned_groups, parse_gpus, worker_groups
from autotune.results import UNTRUSTED_STATUSES, Metrics, Percentiles, TrialResult
from autotune.search.objective import objective_values, per_gpu
from autotune.search.scaleout.workers import on_gpus, plan_workers
from autotune.search.seeding import launched

STUDY = """
[study]
name = "{name}"
trials = {trials}
seed = 0
confirm_top_k = {top_k}
confirm_repeats = 1
confirm_max_repeats = 1
confirm_windows = 1

[engine]
kind = "sim"
model = "{model}"
sim_gpu = "{gpu}"
sim_options = {{ startup_s = 0.2, warmup_s = 0.1, release_s = 0.2 }}
{engine_extra}

[engine.fixed]
stream_interval = 8  # one SSE event per 8 tokens: less server and client CPU per token (tests/tinystudy.py)
{fixed}

[space]
{space}
max_mamba_cache_size = {{ type = "int", low = 80, high = 240, step = 80 }}
mem_fraction_static = {{ type = "float", low = 0.86, high = 0.90, step = 0.02 }}

[workload]
prompts = "prompts.jsonl"
sample_size = 16
max_tokens = 128
warmup_s = 0.3
measure_s = 1.0

[baseline]
flags = {{ max_mamba_cache_size = 80 }}
"""


def write_study(
    tmp_path: Path,
    name: str,
    *,
    trials: int = 4,
    top_k: int = 0,
    model: str = "qwen3.6-27b",
    gpu: str = "b200",
    fixed: str = "",
    space: str = "",
    engine_extra: str = "",
) -> Path:
    write_prompts(tmp_path)
    path = tmp_path / f"{name}.toml"
    path.write_text(
        STUDY.format(
            name=name,
            trials=trials,
            top_k=top_k,
            model=model,
            gpu=gpu,
            fixed=fixed,
            space=space,
            engine_extra=engine_extra,
        )
    )
    return path


def big_study(tmp_path: Path, **kwargs) -> Path:
    """The 80B model on H200s: 148 GiB of weights, so every server is tensor-parallel over two GPUs."""
    return write_study(tmp_path, "big", model="qwen3-next-80b-a3b", gpu="h200", fixed="tp_size = 2", **kwargs)


def mixed_study(tmp_path: Path, **kwargs) -> Path:
    """The 27B model with tp_size searched: servers of one and of two GPUs in one study."""
    return write_study(tmp_path, "mixed", space="tp_size = { choices = [1, 2] }", **kwargs)


def _sweep(path: Path, *args: str, env_dir: Path, timeout: float = 240) -> subprocess.CompletedProcess:
    env = {**__import__("os").environ, "AUTOTUNE_SIM_DEVICE_DIR": str(env_dir), "AUTOTUNE_HEARTBEAT_S": "2"}
    return subprocess.run(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(path), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )


def _registry_holders(devices: Path) -> list[Path]:
    """Process records left in the simulated registry (a server that still holds a GPU)."""
    return [p for p in devices.rglob("*.json")] if devices.exists() else []


def _trials(path: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name=name, storage=f"sqlite:///{path.parent / (name + '.db')}").trials


def _finished(path: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    return [t for t in _trials(path, name) if t.state == TrialState.COMPLETE and t.user_attrs.get("status") != "repeat"]


def _launched(path: Path, name: str) -> list[optuna.trial.FrozenTrial]:
    """The trials that started a server: what ``trials`` counts, whatever the host's load made of their windows."""
    return launched(_trials(path, name))


# --- --gpus text, groups, plans ------------------------------------------------------------------------------
def test_gpu_lists_read_ranges_and_reject_bad_text():
    assert parse_gpus("0-3") == [0, 1, 2, 3]
    assert parse_gpus("0,1,2,3") == [0, 1, 2, 3]
    assert parse_gpus("0-3,6,7") == [0, 1, 2, 3, 6, 7]
    for text, words in (
        ("0-", "ranges like 0-3"),
        ("gpu0", "0,1,2,3"),
        ("3-1", "write 1-3"),
        ("0-2,1", "repeats a GPU"),
        ("", "cannot read"),
    ):
        with pytest.raises(ConfigError, match=words) as err:
            parse_gpus(text)
        assert err.value.key == "--gpus" and "\n" not in str(err.value)


def test_groups_tile_the_pool_and_sizes_that_vary_share_it():
    assert aligned_groups([0, 1, 2, 3, 4, 5, 6, 7], 2) == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert aligned_groups([0, 1, 2, 3], 3) == [(0, 1, 2)]  # never 1,2,3: groups start on their own size
    assert worker_groups([0, 1, 2, 3], [2]) == ([(0, 1), (2, 3)], False)
    assert worker_groups([0, 1, 2, 3], [1, 2]) == ([(0, 1, 2, 3)] * 4, True)
    assert worker_groups([0, 1], [1, 4]) == ([(0,), (1,)], False)  # configs larger than the pool are skipped
    assert worker_groups([0, 1, 2, 3, 4], [2]) == ([(0, 1), (2, 3)], False)  # GPU 4 stays idle (said at start)


def test_plan_pins_a_fixed_size_study_to_pairs_and_shares_a_varying_one(tmp_path):
    big = load_config(big_study(tmp_path))
    assert [(p.key, p.name, p.gpus, p.shared) for p in plan_workers(big, [0, 1, 2, 3])] == [
        (0, "0,1", (0, 1), None),
        (2, "2,3", (2, 3), None),
    ]
    mixed = load_config(mixed_study(tmp_path))
    plans = plan_workers(mixed, [0, 1, 2, 3])
    assert [(p.name, p.gpus, p.shared) for p in plans] == [(f"worker{k}", (0, 1, 2, 3), k) for k in range(4)]


# --- pools too small: one line on load ----------------------------------------------------------------------
def test_a_pool_smaller_than_the_fixed_flags_is_one_line_on_load(tmp_path):
    path = big_study(tmp_path, engine_extra="gpus = [3]")
    with pytest.raises(ConfigError) as err:
        load_config(path)
    assert err.value.key == "engine.gpus" and "span 2 GPUs" in str(err.value) and "pool has 1 (3)" in str(err.value)
    assert "give at least 2 GPUs" in str(err.value) and "\n" not in str(err.value)
    with pytest.raises(ConfigError, match="span 2 GPUs") as cli:
        on_gpus(load_config(big_study(tmp_path)), [5], None)
    assert cli.value.key == "--gpus"


def test_a_space_whose_every_config_exceeds_the_pool_is_one_line(tmp_path):
    path = write_study(tmp_path, "wide", space="tp_size = { choices = [2, 4] }", engine_extra="gpus = [0]", fixed="")
    text = path.read_text().replace(
        "flags = { max_mamba_cache_size = 80 }", "flags = { max_mamba_cache_size = 80, tp_size = 1 }"
    )
    path.write_text(text)
    with pytest.raises(ConfigError, match="every config of \\[space\\] spans at least 2 GPUs") as err:
        load_config(path)
    assert err.value.key == "engine.gpus"


def test_gpu_and_gpus_together_are_one_line(tmp_path):
    path = write_study(tmp_path, "both", engine_extra="gpu = 1\ngpus = [0, 1]")
    with pytest.raises(ConfigError, match="both gpu and gpus"):
        load_config(path)
    path = write_study(tmp_path, "twice", engine_extra="gpus = [0, 0]")
    with pytest.raises(ConfigError, match="names a GPU twice"):
        load_config(path)
    pool = load_config(write_study(tmp_path, "pool", engine_extra="gpus = [2, 3]")).engine
    assert (pool.pool, pool.first_gpu) == ((2, 3), 2)


# --- the per-device locks ----------------------------------------------------------------------------------
def test_locks_take_a_whole_free_group_or_nothing(tmp_path):
    locks = GpuLocks(tmp_path, [0, 1, 2, 3])
    one = locks.try_take(1)
    assert one is not None and one.gpus == (0,)
    pair = locks.try_take(2)
    assert pair is not None and pair.gpus == (2, 3)  # 0,1 has GPU 0 held: the next aligned pair
    assert locks.try_take(2) is None  # no pair left; GPU 1 alone is free and stays free
    single = locks.try_take(1)
    assert single is not None and single.gpus == (1,)
    for held in (one, pair, single):
        held.release()
    again = locks.try_take(2)
    assert again is not None and again.gpus == (0, 1)
    again.release()


def test_a_wait_for_gpus_ends_when_the_sweep_stops(tmp_path):
    locks = GpuLocks(tmp_path, [0, 1])
    held = locks.try_take(2)
    assert held is not None
    stop, said = threading.Event(), []
    threading.Timer(0.3, stop.set).start()
    started = time.monotonic()
    with pytest.raises(Stopped):
        locks.take(1, stop=stop, poll_s=0.05, on_wait=said.append)
    assert time.monotonic() - started < 3 and said == ["waiting for a free group of 1 GPU (0 / 1)"]
    held.release()


def test_locks_hold_across_processes(tmp_path):
    locks = GpuLocks(tmp_path, [0, 1])
    held = locks.try_take(2)
    assert held is not None
    code = (
        "from pathlib import Path; from autotune.launch.gpulocks import GpuLocks; "
        f"print(GpuLocks(Path({str(tmp_path)!r}), [0, 1]).try_take(1))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "None"
    held.release()
    out = subprocess.run(
        [
            sys.executable,
            "-c",
            code.replace("print(", "print(getattr(").replace(".try_take(1))", ".try_take(1), 'gpus'))"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    assert out.stdout.strip() == "(0,)"


# --- the per-GPU score -------------------------------------------------------------------------------------
def _ok(tok_s: float, gpus: list[int] | None, config: dict | None = None) -> TrialResult:
    p = Percentiles(p50=1.0, p90=1.0, p99=1.0, mean=1.0)
    return TrialResult(
        status="ok",
        config=config or {},
        gpus=gpus,
        metrics=Metrics(output_tok_s=tok_s, request_s=1.0, ttft_ms=p, itl_ms=p, e2e_ms=p),
    )


def test_the_objective_is_tok_s_per_gpu(tmp_path):
    cfg = load_config(mixed_study(tmp_path))
    assert objective_values(cfg, _ok(3000.0, [0, 1]))[0] == [1500.0]
    assert objective_values(cfg, _ok(2000.0, [2]))[0] == [2000.0]  # a 1-GPU server: unchanged
    assert per_gpu(_ok(3000.0, None, {"tp_size": 2})) == 1500.0  # no recorded group: the config's span


# --- end to end on the simulator ---------------------------------------------------------------------------
@pytest.mark.slow
def test_the_80b_study_sweeps_as_two_workers_on_gpu_pairs(tmp_path):
    devices = tmp_path / "devices"
    done = _sweep(big_study(tmp_path, trials=4), "--gpus", "0-3", env_dir=devices)
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout + done.stderr
    assert "gpu0,1 | " in out and "gpu2,3 | " in out and "gpu1 | " not in out
    assert "ranked by tok/s per GPU" in out and "on 2 GPUs" in out
    trials = _launched(tmp_path / "big.toml", "big")
    assert len(trials) == 4
    groups = set()
    for t in trials:
        result = TrialResult.from_dict(t.user_attrs["result"])
        # a loaded host can leave a window untrusted (recorded, not scored): the server still ran on its pair
        assert (result.ok or result.status in UNTRUSTED_STATUSES) and result.gpus in ([0, 1], [2, 3]), result.reason
        assert result.gpu is not None and [g.index for g in result.gpu.per_gpu or []] == result.gpus
        if result.ok:
            assert t.values[0] == pytest.approx(result.output_tok_s / 2)  # ranked per GPU
        assert t.user_attrs["gpu"].endswith(":" + ",".join(map(str, result.gpus)))
        groups.add(tuple(result.gpus))
    assert groups == {(0, 1), (2, 3)}  # both workers ran trials
    baselines = [t.user_attrs["gpu"].rpartition(":")[2] for t in trials if t.user_attrs.get("role") == "baseline"]
    assert len(baselines) == 1 and baselines[0] in ("0,1", "2,3")  # the baseline runs once per study
    assert _registry_holders(devices) == []  # every server released every GPU it held
    table = subprocess.run(
        [sys.executable, "-m", "autotune", "trials", "--config", str(tmp_path / "big.toml"), "--json"],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    rows = [r for r in json.loads(table.stdout) if r["status"] != "repeat"]  # a repeat is told, never launched
    assert len(rows) == 4
    assert all(r["gpus"] == 2 for r in rows)
    assert all(r["tok_s_per_gpu"] == pytest.approx(r["output_tok_s"] / 2) for r in rows if r["status"] == "ok")


class RegistryWatch:
    """Snapshots of the simulated device registry while a sweep runs: which live server pids hold each GPU."""

    def __init__(self, devices: Path):
        self.devices, self.snapshots, self.stop = devices, [], threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self.stop.wait(0.03):
            snap: dict[int, set[int]] = {}
            for path in self.devices.glob("*/*.json") if self.devices.exists() else []:
                try:
                    record = json.loads(path.read_text())
                except (OSError, json.JSONDecodeError):
                    continue  # being written
                pid = int(record.get("pid") or path.stem)
                if record.get("exited_at") is None and psutil.pid_exists(pid):
                    snap.setdefault(int(path.parent.name), set()).add(pid)
            if snap:
                self.snapshots.append(snap)

    def __enter__(self) -> RegistryWatch:
        self.thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join(timeout=5)


@pytest.mark.slow
def test_a_varying_tp_runs_concurrently_on_free_groups_never_overlapping(tmp_path):
    devices = tmp_path / "devices"
    path = mixed_study(tmp_path, trials=8, top_k=2)
    with RegistryWatch(devices) as watch:
        done = _sweep(path, "--gpus", "0-3", "--json", env_dir=devices, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    summary = json.loads(done.stdout)
    # Never two servers on one GPU, at any snapshot; servers ran at once on different GPUs.
    assert watch.snapshots, "the watcher never saw a server"
    assert all(len(pids) == 1 for snap in watch.snapshots for pids in snap.values()), [
        snap for snap in watch.snapshots if any(len(p) > 1 for p in snap.values())
    ][:3]
    assert any(len({pid for pids in snap.values() for pid in pids}) >= 2 for snap in watch.snapshots)
    # A two-GPU server held both of its GPUs in the registry.
    assert any(
        sum(1 for pids in snap.values() if pid in pids) == 2
        for snap in watch.snapshots
        for pid in {p for pids in snap.values() for p in pids}
    )
    trials = _finished(path, "mixed")
    ok = [TrialResult.from_dict(t.user_attrs["result"]) for t in trials if t.user_attrs.get("status") == "ok"]
    assert all(len(r.gpus or []) == int(r.config.get("tp_size") or 1) for r in ok)
    assert {len(r.gpus or []) for r in ok} == {1, 2}  # both sizes ran
    # Ranked per GPU: every search value is tok/s ÷ GPUs, and the summary carries both figures.
    for t in trials:
        if t.user_attrs.get("status") == "ok":
            result = t.user_attrs["result"]
            assert t.values[0] == pytest.approx(result["metrics"]["output_tok_s"] / len(result["gpus"]))
    for entry in (summary["baseline"], summary["best"] or summary["baseline"]):  # a winner, or the baseline held
        assert entry["tok_s_per_gpu"] == pytest.approx(entry["output_tok_s"] / entry["gpus"])
    assert summary["multi_gpu"] is True and summary["confirmed"] is True
    assert _registry_holders(devices) == []


# --- searched tp_size: the planner's pre-check and the pool's size, before any launch ------------------------
class CountingRunner:
    """A runner that records what it was asked to launch and measures tok/s = 1000 × the GPUs its config spans."""

    def __init__(self):
        self.launched: list[dict] = []

    def __call__(self, config: dict, number: int) -> TrialResult:
        self.launched.append(dict(config))
        tp = int(config.get("tp_size") or 1)
        return _ok(1000.0 * tp + number, list(range(tp)), config)


def _searched(study: optuna.Study) -> list[optuna.trial.FrozenTrial]:
    return [t for t in study.trials if t.user_attrs.get("role") == "search"]


def test_a_searched_tp_that_does_not_divide_the_heads_is_skipped_with_sglangs_reason(tmp_path, monkeypatch):
    from autotune.search.study import run_study

    monkeypatch.setattr("autotune.search.study.MAX_ASKS_PER_LAUNCH", 4)  # every proposal is skipped: fewer of them
    path = write_study(tmp_path, "heads", trials=2, space="tp_size = { choices = [5] }")  # 24 heads: 5 does not
    path.write_text(path.read_text().replace("[study]\n", '[study]\nsampler = "random"\n'))
    runner = CountingRunner()
    study = run_study(load_config(path), runner=runner)
    skipped = _searched(study)
    assert skipped and all(t.user_attrs["status"] == "skipped_infeasible" for t in skipped)
    assert all("must be divisible by tensor parallel size (5)" in t.user_attrs["reason"] for t in skipped)
    assert all(int(c.get("tp_size") or 1) != 5 for c in runner.launched)  # never launched


def test_a_searched_config_larger_than_the_pool_is_skipped_not_launched(tmp_path):
    from autotune.search.study import run_study

    path = write_study(tmp_path, "pool", trials=5, space="tp_size = { choices = [1, 4] }", engine_extra="gpus = [0, 1]")
    path.write_text(path.read_text().replace("[study]\n", '[study]\nsampler = "random"\n'))
    runner = CountingRunner()
    study = run_study(load_config(path), runner=runner)
    wide = [t for t in _searched(study) if t.user_attrs["config"].get("tp_size") == 4]
    assert wide and all(t.user_attrs["status"] == "skipped_infeasible" for t in wide)
    assert all("spans 4 GPUs" in t.user_attrs["reason"] and "pool has 2 (0,1)" in t.user_attrs["reason"] for t in wide)
    assert runner.launched and all(int(c.get("tp_size") or 1) == 1 for c in runner.launched)


def test_sweeps_of_one_study_on_overlapping_gpus_refuse_and_on_disjoint_ones_share(tmp_path):
    from autotune.errors import StudyError
    from autotune.launch.gpulocks import hold_sweep_gpus

    cfg = load_config(mixed_study(tmp_path))
    first = hold_sweep_gpus(cfg, ["0", "1"])
    with pytest.raises(StudyError, match="being swept on GPU 1 by pid") as err:
        hold_sweep_gpus(cfg, ["1", "2"])
    assert "use other GPUs" in str(err.value)
    disjoint = hold_sweep_gpus(cfg, ["2", "3"])  # GPU 2 was not kept by the refused attempt
    assert len(disjoint) == 2
    for fh in first + disjoint:
        fh.close()
    again = hold_sweep_gpus(cfg, ["1", "2"])
    for fh in again:
        fh.close()


@pytest.mark.slow
def test_a_tenant_on_one_gpu_of_a_pair_stops_that_worker_and_the_message_names_the_pair(tmp_path, monkeypatch):
    from autotune.search.scaleout.workers import run_workers
    from autotune.sim import device

    devices = tmp_path / "devices"
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(devices))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        device.register(
            3,
            pid=sleeper.pid,
            gpu_name="h200",
            total_mib=143_771,
            used_mib=100 * 1024,
            release_s=0.2,
            directory=devices,
        )  # a tenant on GPU 3 only: the 2,3 pair is unusable, 0,1 is not
        cfg = load_config(big_study(tmp_path, trials=2))
        lines: list[str] = []
        codes = run_workers(cfg, [0, 1, 2, 3], echo=lines.append)
    finally:
        sleeper.kill()
        sleeper.wait(timeout=10)
    assert codes[0] == 0 and codes[2] == 1, "\n".join(lines)
    busy = [line for line in lines if line.startswith("gpu2,3 | Error: ")]
    assert len(busy) == 1 and "GPU 3 is busy" in busy[0] and "GPUs 2,3" in busy[0], busy
    groups = {tuple(t.user_attrs["result"]["gpus"]) for t in _launched(tmp_path / "big.toml", "big")}
    assert groups == {(0, 1)}


@pytest.mark.parametrize(
    ("gpus", "words"),
    [("0-", "cannot read GPU list"), ("2-1", "runs backwards"), ("0,0", "repeats a GPU"), ("1", "span 2 GPUs")],
)
def test_bad_gpus_on_the_command_line_are_one_line_before_anything_starts(tmp_path, monkeypatch, capsys, gpus, words):
    path = big_study(tmp_path)
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    done = run_cli(capsys, "sweep", "--config", str(path), "--gpus", gpus)  # in this process: nothing starts anyway
    assert done.returncode == 1 and words in done.stderr, done.stderr
    assert done.stderr.count("Error:") == 1 and "Traceback" not in done.stderr
    assert not (tmp_path / "big.db").exists() and not (tmp_path / "devices").exists()  # no study, no server


def test_a_launch_waiting_for_held_gpus_ends_interrupted_on_ctrl_c_without_a_server(tmp_path, monkeypatch):
    from autotune.launch.gpulocks import lock_dir
    from autotune.search.runner import HarnessRunner

    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    cfg = on_gpus(load_config(big_study(tmp_path)), [0, 1], None)
    held = GpuLocks(lock_dir(cfg.work_dir), [0, 1]).try_take(1)  # another server holds GPU 0 of the only pair
    assert held is not None
    stop, phases = threading.Event(), []
    runner = HarnessRunner(cfg, stop_event=stop, on_phase=lambda line, info: phases.append(line))
    threading.Timer(0.5, stop.set).start()
    result = runner(cfg.baseline_config(), 0)
    held.release()
    assert result.status == "interrupted" and result.reason == "stopped while waiting for GPUs"
    assert "waiting for a free group of 2 GPUs (0,1)" in phases
    assert _registry_holders(tmp_path / "devices") == [] and not (tmp_path / "devices").exists()
