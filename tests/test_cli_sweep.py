"""``autotune sweep`` and ``autotune trials`` end to end on the simulated engine (tiny studies, short windows)."""

from __future__ import annotations

import dataclasses
import json
import os
import queue
import signal
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
from test_study import PlannerRunner
from tinystudy import write_tiny_study

from autotune.cli import main


def tiny(tmp_path: Path, *, trials: int = 2, top_k: int = 1, measure_s: float = 1.0) -> Path:
    return write_tiny_study(tmp_path, name="tiny", trials=trials, top_k=top_k, measure_s=measure_s, warmup_s=0.5)


@pytest.fixture
def sim_env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    return {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}


def cli(*args: str, env: dict, timeout: float = 240) -> subprocess.CompletedProcess:
    """``autotune ARGS`` in a process of its own; ``timeout`` only catches a hang (a loaded host slows a sweep 3-4x)."""
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (("[study]", "[study]\ncolour = 1"), "study.colour"),
        (("trials = 2", "trials = [2]"), "study.trials"),
        (("low = 80, high = 240", "low = 240, high = 80"), "empty range"),
        (("speculative_eagle_topk = 1", "speculative_eagle_top_k = 1"), "did you mean"),
        (('prompts = "prompts.jsonl"', 'prompts = "nowhere.jsonl"'), "workload.prompts"),
    ],
)
def test_bad_study_file_is_one_line_and_exit_1_before_any_server(tmp_path, capsys, edit, words):
    path = tiny(tmp_path)
    path.write_text(path.read_text().replace(*edit))
    with pytest.raises(SystemExit) as info:
        main(["sweep", "--config", str(path)])
    err = capsys.readouterr().err
    assert info.value.code == 1
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: ") and str(path) in lines[0] and words in lines[0]
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "tiny.db").exists()  # nothing was started


@pytest.mark.slow
def test_sweep_json_then_trials(tmp_path, sim_env, capsys):
    path = tiny(tmp_path)
    done = run_cli(capsys, "sweep", "--config", str(path), "--json")  # in this process: real simulated servers
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["study"] == "tiny" and summary["n_trials"] == 2
    assert sum(summary["statuses"].values()) == 2
    assert summary["baseline"]["params"]["max_mamba_cache_size"] == 80
    assert summary["baseline"]["output_tok_s"] > 0
    best = summary["best"]
    assert best["output_tok_s"] > 0 and best["ci_low"] <= best["output_tok_s"] <= best["ci_high"]
    assert summary["gain_over_baseline"] == pytest.approx(best["output_tok_s"] / summary["baseline"]["output_tok_s"])
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    assert study.user_attrs["confirmation"]["winner_trial"] == best["trial"]
    assert (tmp_path / "tiny" / "trials" / "0" / "server.log").is_file()
    # the bill: every search launch and confirmation run timed, the modelled startups dearer than the simulator's
    bill = {p["phase"]: p for p in summary["spend"]["phases"]}
    assert bill["search"]["launches"] == summary["launched"] == 2 and bill["search"]["untimed"] == 0
    runs = study.user_attrs["confirmation"]["runs"]
    assert bill["confirmation"]["launches"] == len(runs) > 0 and bill["confirmation"]["untimed"] == 0
    for phase in ("search", "confirmation"):
        assert 0 < bill[phase]["gpu_h"] < bill[phase]["modelled_gpu_h"]
    assert summary["spend"]["simulated"] is True

    main_rc = _run_main(["trials", "--config", str(path), "--json"])
    rows = json.loads(capsys.readouterr().out)
    assert main_rc == 0 and [r["number"] for r in rows] == [0, 1]
    assert rows[0]["status"] == "ok" and rows[0]["max_running_requests"] == 16 and rows[0]["kv_tokens"] > 0
    _run_main(["trials", "--storage", f"sqlite:///{tmp_path / 'tiny.db'}", "--csv"])
    csv = capsys.readouterr().out.splitlines()
    assert csv[0].startswith("number,state,status") and len(csv) == 3
    _run_main(["trials", "--config", str(path)])
    table = capsys.readouterr().out
    assert "baseline" in table and "flags vs baseline" in table and table.count(" ok ") == 2


def _run_main(argv: list[str]) -> int:
    with pytest.raises(SystemExit) as info:
        main(argv)
    return info.value.code


def _lines(proc: subprocess.Popen) -> queue.Queue:
    out: queue.Queue = queue.Queue()

    def pump():
        for line in proc.stdout:
            out.put(line)

    threading.Thread(target=pump, daemon=True).start()
    return out


def _wait_for(lines: queue.Queue, needle: str, deadline: float) -> list[str]:
    seen = []
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=0.2)
        except queue.Empty:
            continue
        seen.append(line)
        if needle in line:
            return seen
    raise AssertionError(f"{needle!r} never appeared in {''.join(seen)}")


@pytest.mark.slow
def test_sigkill_mid_trial_then_resume_loses_nothing_and_cleans_the_orphan(tmp_path, sim_env):
    path = tiny(tmp_path, trials=2, top_k=0, measure_s=3.0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=sim_env,
    )
    try:
        lines = _lines(proc)
        deadline = time.monotonic() + 60
        _wait_for(lines, "trial 0: ok", deadline)
        _wait_for(lines, "measuring", deadline)  # trial 1 is measuring: kill the sweep, not its server
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    pid_files = list((tmp_path / "tiny" / "runs").glob("server-*.json"))
    assert len(pid_files) == 1
    orphan = json.loads(pid_files[0].read_text())["pid"]
    assert psutil.pid_exists(orphan)

    done = cli("sweep", "--config", str(path), env=sim_env)
    assert done.returncode == 0, done.stdout + done.stderr
    gone = time.monotonic() + 10
    while psutil.pid_exists(orphan) and psutil.Process(orphan).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < gone, "the orphan server survived the resume"
        time.sleep(0.1)
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    trials = study.get_trials()
    assert trials[0].state == TrialState.COMPLETE and trials[0].user_attrs["status"] == "ok"  # not lost
    assert trials[1].state == TrialState.FAIL and trials[1].user_attrs["status"] == "interrupted"
    requeued = [t for t in trials if t.user_attrs.get("requeued_from") == 1]
    assert len(requeued) == 1 and requeued[0].state == TrialState.COMPLETE  # re-run once, not twice
    assert requeued[0].user_attrs["config"] == trials[1].user_attrs["config"]
    assert sum(t.state == TrialState.COMPLETE for t in trials) == 2
    assert not [t for t in trials if t.state in (TrialState.RUNNING, TrialState.WAITING)]
    # three servers in all: trial 0 and the killed trial 1 in the first session, its re-run in the second
    assert "launched 3 servers (1 interrupted and run again)" in done.stdout


def test_defaults_run_on_the_harness_keeps_fixed_flags_in_its_own_directory(tmp_path, sim_env):
    import threading

    from autotune.config import load_config
    from autotune.search.confirm import _defaults
    from autotune.search.runner import HarnessRunner

    cfg = load_config(tiny(tmp_path, trials=1))
    harness = HarnessRunner(cfg, stop_event=threading.Event())
    measured = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"kind": "sglang"})})
    defaults = _defaults(measured, harness)().to_dict()  # what a real engine's confirmation runs and stores
    where = cfg.work_dir / "trials" / "defaults"
    assert defaults["trial_dir"] == str(where) and (where / "server.log").is_file()
    assert defaults["config"] == cfg.engine.fixed  # nothing fixed is tuned here: all kept
    stored = json.loads((where / "result.json").read_text())
    assert stored["config"] == cfg.engine.fixed
    assert defaults["status"] == stored["status"]
    if stored["status"] == "ok":
        assert defaults["output_tok_s"] == stored["metrics"]["output_tok_s"] > 0
    else:
        assert defaults["output_tok_s"] is None and defaults["reason"]
    assert not (cfg.work_dir / "trials" / "0").exists()  # not a repeat of the baseline trial


def _pid_file_pid(runs: Path, deadline: float) -> int:
    while time.monotonic() < deadline:
        files = list(runs.glob("server-*.json"))
        if files:
            return json.loads(files[0].read_text())["pid"]
        time.sleep(0.05)
    raise AssertionError("no server pid file appeared")


def test_ctrl_c_stops_the_server_and_records_the_trial_as_interrupted(tmp_path, sim_env):
    path = tiny(tmp_path, trials=1, top_k=0, measure_s=5.0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=sim_env,
    )
    try:
        lines = _lines(proc)
        deadline = time.monotonic() + 60
        _wait_for(lines, "measuring", deadline)
        server = _pid_file_pid(tmp_path / "tiny" / "runs", deadline)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    first = study.trials[0]
    assert first.state == TrialState.FAIL and first.user_attrs["status"] == "interrupted"
    assert [t.user_attrs.get("requeued_from") for t in study.get_trials(states=(TrialState.WAITING,))] == [0]


def test_live_panel_and_plain_lines_show_the_same_events():
    import io

    from rich.console import Console

    from autotune.progress import LiveProgress, PlainProgress
    from autotune.results import MeasurementVerdict, Metrics, Percentiles, TrialResult

    p = Percentiles(p50=1.0, p90=1.0, p99=1.0, mean=1.0)
    ok = TrialResult(
        status="ok", config={}, metrics=Metrics(output_tok_s=4321.0, request_s=1.0, ttft_ms=p, itl_ms=p, e2e_ms=p)
    )
    buf = io.StringIO()
    live = LiveProgress(console=Console(file=buf, force_terminal=True, width=120))
    plain_buf = io.StringIO()
    plain = PlainProgress(plain_buf)
    for sink in (live, plain):
        sink.log("not searching [x]: inert")  # brackets are text, not markup
        sink.trial_started(3, 2, 10, "search", None, {"max_mamba_cache_size": 384})
        sink.phase("measuring", {"tok_s": 4000.0})
        sink.trial_finished(3, ok, 4321.0)
        sink.close()
    assert live.state.tok_s == 4000.0 and live.state.best == 4321.0
    for text in (buf.getvalue(), plain_buf.getvalue()):
        assert "not searching [x]: inert" in text and "4,321 tok/s" in text
    assert "trial 3 [3/10] search: max_mamba_cache_size=384" in plain_buf.getvalue()
    assert "re-sent a prompt" not in plain_buf.getvalue()
    plain_buf = io.StringIO()
    resent = dataclasses.replace(ok, measurement=MeasurementVerdict(repeated_prompts=0.6))
    PlainProgress(plain_buf).trial_finished(4, resent, 4321.0)
    assert "60% of the window re-sent a prompt verbatim" in plain_buf.getvalue() and "repeats" in plain_buf.getvalue()
    assert "halves differ" not in plain_buf.getvalue()
    plain_buf = io.StringIO()
    PlainProgress(plain_buf).trial_finished(
        5, dataclasses.replace(ok, measurement=MeasurementVerdict(window_drift=1.6)), 4321.0
    )
    assert "halves differ by 160%" in plain_buf.getvalue() and "warmup_s" in plain_buf.getvalue()


def test_no_config_means_the_example_study(tmp_path, monkeypatch):
    from autotune.cli.sweep import resolve_config

    repo = Path(__file__).resolve().parents[1]
    monkeypatch.chdir(tmp_path)
    assert resolve_config(None) == repo / "studies" / "example.toml"  # beside the package
    (tmp_path / "studies").mkdir()
    (tmp_path / "studies" / "example.toml").write_text("")
    assert resolve_config(None) == tmp_path / "studies" / "example.toml"  # the working directory wins


def test_a_sweep_without_a_measured_baseline_names_no_winner_and_exits_1(tmp_path, monkeypatch, capsys):
    import autotune.cli.sweep as sweep_cli
    from autotune.search.sweep import run_sweep

    path = tiny(tmp_path, trials=1)
    # a baseline the planner is sure cannot start: skipped without a launch, so the study has no baseline figure
    path.write_text(
        path.read_text().replace("flags = { max_mamba_cache_size = 80 }", "flags = { max_mamba_cache_size = 4000 }")
    )
    # The CLI's verdict on the summary is the claim: the one search launch runs on the planner's figures, no server.
    monkeypatch.setattr(
        sweep_cli, "run_sweep", lambda cfg, progress: run_sweep(cfg, runner=PlannerRunner(), progress=progress)
    )
    assert _run_main(["sweep", "--config", str(path)]) == 1
    out, err = capsys.readouterr()
    assert "baseline (trial 0) failed: skipped_infeasible:" in out
    assert "winner: trial" not in out and "winner: none, no measured baseline" in out
    last = err.strip().splitlines()[-1]
    assert last.startswith("Error: the baseline (trial 0) failed: skipped_infeasible") and "no winner" in last


def test_an_interrupted_command_says_so_not_aborted(tmp_path, monkeypatch, capsys):
    import autotune.cli.sweep as sweep_cli

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(sweep_cli, "run_sweep", interrupted)
    assert _run_main(["sweep", "--config", str(tiny(tmp_path))]) == 130
    err = capsys.readouterr().err
    assert "Aborted" not in err and "Interrupted: run the same command again to resume" in err


@pytest.mark.slow
def test_sigint_stops_a_background_sweep_during_confirmation(tmp_path, sim_env):
    """A sweep started with ``&`` from a script has SIGINT ignored; the confirmation must still stop on it."""
    path = tiny(tmp_path, trials=2, top_k=1, measure_s=4.0)
    proc = subprocess.Popen(
        [sys.executable, "-m", "autotune", "sweep", "--config", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=sim_env,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN),
    )
    try:
        lines = _lines(proc)
        deadline = time.monotonic() + 90
        _wait_for(lines, "confirm 1/", deadline)
        _wait_for(lines, "measuring", deadline)
        server = _pid_file_pid(tmp_path / "tiny" / "runs", deadline)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=30) == 130
        rest = []
        while not lines.empty():
            rest.append(lines.get())
    finally:
        if proc.poll() is None:
            proc.kill()
    assert "run the same command again to resume" in "".join(rest)
    assert not psutil.pid_exists(server) or psutil.Process(server).status() == psutil.STATUS_ZOMBIE
    study = optuna.load_study(study_name="tiny", storage=f"sqlite:///{tmp_path / 'tiny.db'}")
    assert not study.user_attrs["confirmation"].get("complete")  # a rerun finishes it


def test_a_prompt_file_shorter_than_sample_size_is_a_warning_with_its_count(tmp_path, sim_env, capsys):
    path = tiny(tmp_path, trials=1, top_k=0, measure_s=0.5)
    rows = (tmp_path / "prompts.jsonl").read_text().splitlines()
    (tmp_path / "prompts.jsonl").write_text("\n".join(rows[:3]) + "\n")
    done = run_cli(capsys, "sweep", "--config", str(path))  # in this process: a real simulated server
    assert done.returncode == 0, done.stdout + done.stderr
    warnings = [line for line in done.stderr.splitlines() if line.startswith("Warning: ")]
    assert len(warnings) == 1 and "has 3 prompts, 13 fewer than sample_size 16" in warnings[0]
