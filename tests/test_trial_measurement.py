"""A trial records a tok/s only if the window measured the server: a lagging simulator or a saturated replay
client makes it ``invalid_measurement`` / ``client_bound`` (after one re-measure with batched SSE chunks)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import optuna
import pytest

from autotune.config import Timeouts
from autotune.harness.engines import make_engine
from autotune.harness.setup import TrialHooks, TrialSetup
from autotune.harness.trial import CLIENT_BUSY_LIMIT, LAG_LIMIT, measurement_verdict, run_trial
from autotune.harness.workload import ReplayRecords, SimPace, WorkloadSpec, thread_busy_s
from autotune.results import STATUSES, UNTRUSTED_STATUSES, MeasurementVerdict, TrialResult
from autotune.settle import Settling

PROMPTS = Path(__file__).resolve().parents[1] / "examples" / "prompts.jsonl"
GPU = 3  # a simulated device index only these tests use


def records(*, busy: float | None = 0.3, lag: float = 0.0, modelled: float = 10.0) -> ReplayRecords:
    rec = ReplayRecords([], (1.0, 3.0), 8, "generate", client_busy=busy)
    rec.probes = [SimPace(modelled_s=5.0, lag_s=0.1), SimPace(modelled_s=5.0 + modelled, lag_s=0.1 + lag)]
    return rec


def test_verdict_refuses_lag_over_the_limit_and_a_saturated_client():
    assert measurement_verdict(records(lag=0.5 * LAG_LIMIT * 10))[0] is None
    status, reason, figures = measurement_verdict(records(lag=2 * LAG_LIMIT * 10))
    assert status == "invalid_measurement" and "trailed" in reason and figures.sim_lag == pytest.approx(0.04)
    status, reason, _ = measurement_verdict(records(busy=CLIENT_BUSY_LIMIT + 0.01))
    assert status == "client_bound" and "client" in reason
    real = ReplayRecords([], (1.0, 3.0), 8, "generate", client_busy=0.99)
    real.probes = [None, None]  # a real SGLang has no sim_pace: only the client check applies
    assert measurement_verdict(real)[0] == "client_bound"


def test_a_window_with_no_token_is_the_clients_fault_when_the_client_was_saturated():
    """No token read in the window from a server whose log shows work: ``too_slow`` blames the config, unless the
    replay's own loop was saturated (it could not read them) — then ``client_bound``, re-measured, not too slow."""
    from types import SimpleNamespace

    from autotune.harness.engines import make_engine
    from autotune.harness.trial import _window_outcome

    server = SimpleNamespace(log_text=lambda: "", log_tail=lambda: "", base_url="http://127.0.0.1:9")
    log = "Prefill batch. #new-seq: 8, #new-token: 4096\n"
    busy = records(busy=CLIENT_BUSY_LIMIT + 0.05)
    out = _window_outcome(server, make_engine("sim", model_path="m"), busy, None, log)
    assert out["status"] == "client_bound" and out["metrics"] is None
    calm = records(busy=0.1)
    assert _window_outcome(server, make_engine("sim", model_path="m"), calm, None, log)["status"] == "too_slow"


def test_repeated_prompts_counts_window_requests_whose_prompt_was_already_sent():
    from autotune.harness.workload import RequestRecord, repeated_prompt_share

    sends = [(1, 0.2), (2, 0.5), (1, 1.2), (3, 1.5), (2, 2.0), (4, 3.5)]  # (row, sent); window [1, 3)
    rec = ReplayRecords([RequestRecord(row=r, sent=t) for r, t in sends], (1.0, 3.0), 8, "generate")
    assert repeated_prompt_share(rec) == pytest.approx(2 / 3, abs=1e-4)  # rows 1 and 2 again, row 3 new; row 4 after
    assert repeated_prompt_share(ReplayRecords([], (1.0, 3.0), 8, "generate")) == 0.0
    assert measurement_verdict(rec)[2].repeated_prompts == pytest.approx(2 / 3, abs=1e-4)
    walks = [RequestRecord(row=r, sent=t, pass_no=int(t >= 1.3)) for r, t in sends]  # row 2 again on a new walk
    assert repeated_prompt_share(ReplayRecords(walks, (1.0, 3.0), 8, "generate")) == pytest.approx(1 / 3, abs=1e-4)


def test_window_drift_compares_the_window_halves():
    from autotune.harness.workload import RequestRecord, window_drift

    steady = [RequestRecord(row=i, sent=0.0, chunks=[(1.0 + k / 10, 2) for k in range(20)]) for i in range(3)]
    assert window_drift(ReplayRecords(steady, (1.0, 3.0), 3, "generate")) == 0.0
    late = [RequestRecord(row=1, sent=0.0, chunks=[(0.5, 50), (2.5, 10), (2.9, 10), (3.5, 50)])]  # outside: ignored
    assert window_drift(ReplayRecords(late, (1.0, 3.0), 1, "generate")) == 2.0  # every window token in one half
    skew = [RequestRecord(row=1, sent=0.0, chunks=[(1.5, 10), (2.5, 30)])]
    assert window_drift(ReplayRecords(skew, (1.0, 3.0), 1, "generate")) == pytest.approx(1.0)  # 20 apart, mean 20
    assert window_drift(ReplayRecords([], (1.0, 3.0), 1, "generate")) == 0.0
    assert measurement_verdict(ReplayRecords(skew, (1.0, 3.0), 1, "generate"))[2].window_drift == pytest.approx(1.0)


def test_a_later_window_stores_every_figure_as_it_always_has():
    """A window's ``measurement`` is stored plain: client_busy first and kept when None (a window cut short), the
    settling only when it settled, sim_lag only with the simulator's pacing counters."""
    from autotune.harness.windows import window_of

    cut = ReplayRecords([], (1.0, 3.0), 8, "generate")  # stopped before its end: no client_busy, no settling
    assert window_of(cut, 2, 1).measurement == {"client_busy": None, "repeated_prompts": 0.0, "window_drift": 0.0}
    lagging = records(lag=2 * LAG_LIMIT * 10)
    stored = window_of(lagging, 2, 1).measurement
    assert list(stored) == ["client_busy", "repeated_prompts", "window_drift", "sim_lag"]
    assert stored["sim_lag"] == pytest.approx(0.04) and window_of(lagging, 2, 1).status == "invalid_measurement"


def test_untrusted_statuses_are_statuses_and_round_trip():
    assert UNTRUSTED_STATUSES <= set(STATUSES)
    r = TrialResult(
        status="client_bound", config={}, measurement=MeasurementVerdict(client_busy=0.99, stream_interval=16)
    )
    assert r.to_dict()["measurement"] == {"client_busy": 0.99, "stream_interval": 16}
    assert TrialResult.from_dict(r.to_dict()).measurement == MeasurementVerdict(client_busy=0.99, stream_interval=16)


def test_a_stored_trial_is_read_back_through_one_reader():
    """``TrialResult.of``: what a study stored on a trial (``user_attrs["result"]``), None where it stored none."""
    r = TrialResult(
        status="client_bound", config={"tp_size": 2}, gpus=[0, 1], measurement=MeasurementVerdict(client_busy=0.99)
    )
    stored = optuna.trial.create_trial(
        state=optuna.trial.TrialState.COMPLETE, values=[0.0], user_attrs={"result": r.to_dict(), "status": r.status}
    )
    assert TrialResult.of(stored) == r and TrialResult.of(stored).gpus_spanned == 2
    bare = optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL)  # never launched: nothing stored
    assert TrialResult.of(bare) is None and TrialResult.of(None) is None


def test_thread_busy_counts_the_callers_cpu_not_other_threads():
    t0, b0 = time.perf_counter(), thread_busy_s()
    while time.perf_counter() - t0 < 0.2:
        pass
    assert thread_busy_s() - b0 >= 0.15
    stop = threading.Event()

    def spin() -> None:  # another thread of the process, busy the whole time: not the event loop's load
        while not stop.is_set():
            sum(range(1000))

    other = threading.Thread(target=spin)
    b1 = thread_busy_s()
    other.start()
    try:
        time.sleep(0.5)
    finally:
        stop.set()
        other.join()
    assert thread_busy_s() - b1 < 0.25  # the sleeping caller was neither running nor runnable for most of it


@pytest.fixture
def env(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    return tmp_path


def _trial(tmp_path: Path, *, options: dict, hook=None) -> tuple[TrialResult, list[str]]:
    engine = make_engine(
        "sim",
        model_path="qwen3.6-27b",
        sim_gpu="b200",
        sim_options={"startup_s": 0.2, "release_s": 0.2, "warmup_s": 0.1, **options},
    )
    phases: list[str] = []

    def on_phase(name: str, info: dict) -> None:
        phases.append(name)
        if hook is not None:
            hook(name)

    # Lengths held at the floors (caps = floors): the burn below must cover the whole window.
    work = WorkloadSpec(
        prompts=PROMPTS, sample_size=40, warmup_s=1.0, measure_s=2.0, warmup_max_s=1.0, measure_max_s=2.0, concurrency=8
    )
    setup = TrialSetup(
        engine=engine,
        workload=work,
        gpu_index=GPU,
        run_dir=tmp_path / "runs",
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    result = run_trial(
        setup, {"speculative_algorithm": "NEXTN"}, trial_dir=tmp_path / "t", hooks=TrialHooks(on_phase=on_phase)
    )
    return result, phases


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_server_paced_faster_than_the_cpu_can_is_invalid_never_a_tok_s(env):
    # --sim-speedup 2000: the model runs 2000× real time, far above what any CPU paces.
    result, phases = _trial(env, options={"speedup": 2000})
    assert result.status == "invalid_measurement", (result.status, result.reason)
    assert result.metrics is None and result.output_tok_s is None
    assert result.measurement.stream_interval == 16 and result.measurement.sim_lag > LAG_LIMIT
    assert result.measurement.first["status"] == "invalid_measurement"
    assert "also after re-measuring with --stream-interval 16" in result.reason
    assert any(p.startswith("re-measuring with --stream-interval 16") for p in phases)
    assert (env / "t" / "server.first.log").exists() and (env / "t" / "server.log").exists()
    assert result.measurement.untrusted_tok_s > 0  # kept for diagnosis, never as the trial's figure


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_saturated_client_is_client_bound_never_a_tok_s(env):
    def burn(name: str) -> None:
        # Saturation injected on purpose: the replay's own thread spins through its whole measured window (the
        # first progress tick of the window), as a client pinned to a busy core would. Runnable-but-waiting time
        # counts as busy too, so this holds on a loaded machine.
        if name.startswith("re-measuring"):
            burnt.clear()  # and again in the re-measure
        if name == "measuring" and not burnt:
            burnt.append(True)
            t0 = time.perf_counter()
            sum(range(1_000_000))
            per_item = max((time.perf_counter() - t0) / 1_000_000, 1e-9)
            while (left := 2.5 - (time.perf_counter() - t0)) > 0:
                # One C call for (about) all that is left, holding the GIL throughout: the harness's own threads
                # cannot take it mid-burn, so the loop's thread stays running or runnable, as a saturated one is.
                sum(range(int(left / per_item) + 1000))

    burnt: list[bool] = []

    result, _ = _trial(env, options={}, hook=burn)
    assert result.status == "client_bound", (result.status, result.reason)
    assert result.metrics is None
    assert result.measurement.client_busy >= CLIENT_BUSY_LIMIT
    assert result.measurement.first["status"] == "client_bound"


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_normal_trial_measures_and_records_its_figures(env):
    result, phases = _trial(env, options={})
    assert result.status == "ok", result.reason
    assert result.metrics.output_tok_s > 0
    assert result.measurement.sim_lag <= LAG_LIMIT and result.measurement.client_busy < CLIENT_BUSY_LIMIT
    assert not any(p.startswith("re-measuring") for p in phases)
    # every trial records the share of its window's requests that re-sent a prompt (exact counts: the unit test)
    assert 0.0 <= result.measurement.repeated_prompts <= 1.0


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_a_trial_records_its_slices_and_the_lengths_the_settle_rule_ran(env):
    engine = make_engine(
        "sim",
        model_path="qwen3.6-27b",
        sim_gpu="b200",
        sim_options={"startup_s": 0.2, "release_s": 0.2, "warmup_s": 0.1},
    )
    work = WorkloadSpec(prompts=PROMPTS, sample_size=40, warmup_s=1.0, measure_s=2.0, concurrency=8)
    setup = TrialSetup(
        engine=engine,
        workload=work,
        gpu_index=GPU,
        run_dir=env / "runs",
        timeouts=Timeouts(startup_s=30, teardown_s=10, grace_s=3),
    )
    result = run_trial(setup, {"speculative_algorithm": "NEXTN"}, trial_dir=env / "t")
    assert result.status == "ok", result.reason
    settling = Settling.from_dict(result.measurement.settling)
    assert settling is not None and result.measurement.settled is settling.settled
    lo, hi = settling.window
    assert (
        settling.slice_s == pytest.approx(0.4)
        and len(settling.tok_s) == settling.warmup_slices + settling.window_slices
    )
    assert lo >= 1.0 and hi - lo >= 2.0 and hi <= 4.0 + 8.0  # the floors at least, the caps (4 × floors) at most
    assert result.durations_s["warmup"] == pytest.approx(lo, abs=1e-3)
    assert result.durations_s["measure"] >= hi - lo  # the window, plus closing the streams
    assert result.metrics.window_s == pytest.approx(hi - lo)
    window = settling.tok_s[settling.warmup_slices :]
    assert result.metrics.output_tok_s == pytest.approx(sum(window) / len(window), rel=0.01)
