"""A confirmation launch end to end on the simulated server: one warm-up, then three windows of one closed loop."""

from __future__ import annotations

import threading

import pytest
from test_trial import GPU, assert_clean, env, sim, spec  # noqa: F401  (the fixture is used by name)

from autotune.config import Timeouts
from autotune.harness.setup import TrialHooks, TrialSetup
from autotune.harness.trial import run_trial
from autotune.harness.windows import WindowsStep
from autotune.harness.workload import ReplayRecords
from autotune.results import TrialResult

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]
WORKLOAD = spec(sample_size=20, warmup_s=1.0, measure_s=1.0, measure_max_s=1.0)


def launch(tmp_path, *, hook=None, stop_event=None) -> tuple[TrialResult, list]:
    """A confirmation launch of three windows (``runner.repeat(after=[WindowsStep(2)])``), left clean."""
    phases: list = []

    def on_phase(name: str, info: dict) -> None:
        phases.append((name, info))
        if hook is not None:
            hook(name, info)

    setup = TrialSetup(
        engine=sim(tmp_path),
        workload=WORKLOAD,
        gpu_index=GPU,
        run_dir=tmp_path / "runs",
        shm_dir=tmp_path / "shm",
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    result = run_trial(
        setup,
        {"max_running_requests": 8},
        trial_dir=tmp_path / "t",
        after=[WindowsStep(2)],
        hooks=TrialHooks(on_phase=on_phase, stop_event=stop_event),
    )
    assert_clean(tmp_path, result, phases)
    return result, phases


def test_a_launch_warms_up_once_before_its_windows(env):  # noqa: F811
    result, phases = launch(env)
    assert result.status == "ok", result.reason
    assert [w.index for w in result.windows] == [2, 3] and all(w.ok for w in result.windows)
    names = [name for name, _ in phases]  # one warm-up; each later window shown once, as the loop reached it
    assert names.count("warmup") == 1 and names.count("window 2 of 3") == names.count("window 3 of 3") == 1
    assert names.index("measuring") < names.index("window 2 of 3") < names.index("window 3 of 3")
    # the records' own clock: each later window opens at the slice where the one before closed, no warm-up between
    first = result.measurement.settling
    edges = [(first["warmup_slices"], first["warmup_slices"] + first["window_slices"])]
    for window in result.windows:
        settling = window.measurement["settling"]
        edges.append((settling["warmup_slices"], settling["warmup_slices"] + settling["window_slices"]))
    assert all(after[0] == before[1] for before, after in zip(edges, edges[1:], strict=False))
    dirs = env / "t"
    records = [
        ReplayRecords.read_jsonl(dirs / name)
        for name in ("records.jsonl", "records-window-2.jsonl", "records-window-3.jsonl")
    ]
    slice_s = first["slice_s"]
    for (start, _), window in zip(edges[1:], records[1:], strict=False):  # streams carried over each boundary
        assert any(r.sent < start * slice_s <= max(t for t, _ in r.chunks) for r in window if r.chunks)
    keys = [(r.row, r.pass_no, r.sent) for window in records for r in window]
    assert len({k[:2] for k in keys}) == len(set(keys))  # one request per prompt and pass: no pass repeats
    assert result.durations_s["windows"] > 0 and result.durations_s["measure"] > 0


def test_an_interruption_in_window_two_is_the_launchs_outcome(env):  # noqa: F811
    stop = threading.Event()
    result, phases = launch(
        env, stop_event=stop, hook=lambda name, info: stop.set() if name == "window 2 of 3" else None
    )
    assert result.status == "interrupted" and not result.windows
    assert "window 2 of 3" in [name for name, _ in phases] and (env / "t" / "records-window-2.jsonl").exists()
