"""The planner learns its error online: a hidden truth the simulator runs on and the study cannot see."""

from __future__ import annotations

import optuna
import pytest

from autotune.config import load_config
from autotune.results import GpuPeaks, TrialResult
from autotune.search.correction import CorrectedFeasibility, free_in_message
from autotune.search.runner import prompt_texts
from autotune.search.seeding import NOT_LAUNCHED
from autotune.search.study import SearchParts, Sweep
from autotune.sim import SimWorkload, evaluate
from autotune.sim.truth import Deviation


def _study(tmp_path, *, trials: int, space_update: dict | None = None, enqueue: list | None = None):
    cfg = load_config("studies/qwen3.6-27b-b200.toml")
    study = cfg.study.model_copy(
        update={"trials": trials, "storage": "sqlite:///:memory:", "confirm_top_k": 0, "seed": 0}
    )
    update = {"study": study, "path": tmp_path / "s.toml"}
    if space_update:
        update["space"] = {**cfg.space, **{k: cfg.space[k].model_copy(update=v) for k, v in space_update.items()}}
    if enqueue is not None:
        update["enqueue"] = enqueue
    return cfg.model_copy(update=update)


class TruthRunner:
    """Trials on the simulator's virtual clock, on a machine that departs from the planner by ``deviation``.
    ``nvml``: whether the GPU monitor reports a peak (without it, only capacity and OOMs tell the planner)."""

    def __init__(self, cfg, deviation: Deviation, *, nvml: bool):
        wl = cfg.workload
        self.work = SimWorkload(
            prompts=list(prompt_texts(wl.prompts, 40, wl.seed)), max_tokens=wl.max_tokens, warmup_s=5, measure_s=10
        )
        self.deviation, self.nvml = deviation, nvml
        self.calls: list[tuple[int, dict, str]] = []

    def __call__(self, config: dict, number: int) -> TrialResult:
        ev = evaluate(config, self.work, model="qwen3.6-27b", gpu="b200", deviation=self.deviation)
        gpu = None
        if ev.status == "ok" and self.nvml:
            x = ev.plan["extra"]
            gpu = GpuPeaks(
                peak_used_gib=x["peak_gib"], total_gib=x["total_gib"], headroom_gib=x["total_gib"] - x["peak_gib"]
            )
        self.calls.append((number, dict(config), ev.status))
        return TrialResult(
            status=ev.status,
            config=config,
            engine="sim",
            capacity=ev.capacity,
            metrics=ev.metrics,
            gpu=gpu,
            reason=ev.reason,
        )


def _run(cfg, runner) -> optuna.Study:
    sweep = Sweep(cfg, runner=runner, parts=SearchParts.of(cfg, study=optuna.create_study(directions=["maximize"])))
    try:
        return sweep.run()
    finally:
        sweep.close()


def test_a_hidden_deficit_moves_the_edge_starts_below_the_wall(tmp_path):
    """3 GiB less room than planned, no NVML peaks: the first edge start (placed on the planner's wall) runs out
    of memory; the planner learns the deficit from that OOM, the next edge starts sit below the wall, and no
    later launch runs out of memory again."""
    # high memory fractions and the largest prefill chunk: the wall is where the room for activations ends
    cfg = _study(
        tmp_path,
        trials=8,
        enqueue=[],
        space_update={"mem_fraction_static": {"low": 0.9}, "chunked_prefill_size": {"choices": [16384]}},
    )
    runner = TruthRunner(cfg, Deviation(free_gib=-3.0), nvml=False)
    study = _run(cfg, runner)
    trials = study.get_trials()
    edges = [t for t in trials if t.user_attrs.get("role") == "prior"]
    assert len(edges) >= 3
    assert edges[0].user_attrs["status"] in ("startup_oom", "runtime_oom")
    assert edges[0].user_attrs["planner_room_gib"] == pytest.approx(-3.0, abs=0.05)  # read from torch's message
    for edge in edges[1:]:
        assert edge.user_attrs["status"] == "ok"
    first_oom = edges[0].number
    later = [t for t in trials if t.number > first_oom and t.user_attrs.get("status") not in NOT_LAUNCHED]
    assert later and all(t.user_attrs["status"] not in ("startup_oom", "runtime_oom") for t in later)
    # the corrected planner predicts the truth's room at the first edge start
    feas = CorrectedFeasibility.from_config(cfg)
    raw = feas.raw(edges[0].user_attrs["config"])
    assert raw.fits and raw.gib.headroom >= feas.margin_gib


def test_a_config_the_planner_skipped_is_launched_once_it_learns_there_is_more_room(tmp_path):
    """3 GiB more room than planned: a config the uncorrected planner is sure runs out of memory is skipped before
    anything is measured, and launched (and runs) once the baseline's measured peak shows the room."""
    cfg = load_config("studies/qwen3.6-27b-b200.toml")
    feas = CorrectedFeasibility.from_config(cfg)
    tight = {
        **cfg.engine.fixed,
        **cfg.enqueue[0].flags,
        "max_running_requests": 208,
        "max_mamba_cache_size": 208,
        "disable_radix_cache": True,
        "mamba_ssm_dtype": "bfloat16",
        "mem_fraction_static": 0.94,
        "chunked_prefill_size": 16384,
    }
    raw = feas.predict(tight)
    assert not raw.fits and -3.0 + feas.margin_gib < raw.gib.headroom < -feas.margin_gib
    assert feas.sure_failure(raw)  # the uncorrected planner skips it
    label = {"label": "tight", "flags": {k: v for k, v in tight.items() if k not in cfg.engine.fixed}}
    cfg = _study(tmp_path, trials=3, enqueue=[cfg.enqueue[0].model_copy(update=label)])
    cfg = cfg.model_copy(update={"study": cfg.study.model_copy(update={"edge_starts": 0})})
    runner = TruthRunner(cfg, Deviation(free_gib=3.0), nvml=True)
    study = _run(cfg, runner)
    trial = next(t for t in study.get_trials() if t.user_attrs.get("label") == "tight")
    assert trial.user_attrs["status"] == "ok"
    assert "uncorrected planner would have skipped" in trial.user_attrs["reason"]
    assert [c[2] for c in runner.calls if c[0] == trial.number] == ["ok"]


def test_an_earlier_skip_is_judged_again_and_the_reason_says_it_was_wrong(tmp_path):
    """The same config proposed again after the planner learned: launched, and its reason names the wrong skip."""
    from autotune.search.correction import skip_was_wrong

    cfg = load_config("studies/qwen3.6-27b-b200.toml")
    feas = CorrectedFeasibility.from_config(cfg)
    tight = {
        **cfg.engine.fixed,
        **cfg.enqueue[0].flags,
        "max_running_requests": 208,
        "max_mamba_cache_size": 208,
        "disable_radix_cache": True,
        "mamba_ssm_dtype": "bfloat16",
        "mem_fraction_static": 0.94,
        "chunked_prefill_size": 16384,
    }
    assert feas.sure_failure(feas.predict(tight))
    base = {**cfg.engine.fixed, **cfg.baseline.flags}
    planned = feas.predict(base, inert=False)
    seen = TrialResult(status="ok", config=base, gpu=GpuPeaks(headroom_gib=planned.gib.headroom + 3.0))
    assert feas.learn_trial(base, seen)["planner_room_gib"] == pytest.approx(3.0)
    assert not feas.sure_failure(feas.predict(tight)) and feas.predict(tight).fits
    from autotune.search.space import key_of

    skipped = optuna.trial.create_trial(
        value=0.0,
        user_attrs={
            "launch_key": key_of(tight),
            "status": "skipped_infeasible",
            "reason": "Capture cuda graph failed: ...",
        },
    )
    note = skip_was_wrong(feas, [skipped], key_of(tight), tight, TrialResult(status="ok", config=tight))
    assert note is not None and "wrong to skip" in note and f"trial {skipped.number} " in note


def test_learning_from_an_oom_message_and_an_oom_bound():
    cfg = load_config("studies/qwen3.6-27b-b200.toml")
    assert (
        free_in_message("CUDA out of memory. GPU 0 has a total capacity of 179.06 GiB of which 1.25 GiB is free.")
        == 1.25
    )
    assert free_in_message("boom") is None
    feas = CorrectedFeasibility.from_config(cfg)
    config = {**cfg.engine.fixed, **cfg.enqueue[0].flags}
    planned = feas.predict(config, inert=False)
    feas.learn_trial(config, TrialResult(status="runtime_oom", config=config, reason="CUDA out of memory"))
    # no message figure: the OOM is a bound, the corrected room there is below zero
    assert feas.room_offset(planned.gib.activations) == pytest.approx(-planned.gib.headroom - 0.25)
    assert not feas.predict(config).fits


def test_the_truth_changes_only_what_the_simulator_runs():
    cfg = load_config("studies/qwen3.6-27b-b200.toml")
    wl = cfg.workload
    work = SimWorkload(
        prompts=list(prompt_texts(wl.prompts, 30, wl.seed)), max_tokens=wl.max_tokens, warmup_s=5, measure_s=10
    )
    config = {**cfg.engine.fixed, **cfg.enqueue[0].flags}
    exact = evaluate(config, work, model="qwen3.6-27b", gpu="b200")
    slower = evaluate(config, work, model="qwen3.6-27b", gpu="b200", deviation=Deviation(decode_efficiency=0.85))
    assert exact.status == slower.status == "ok" and exact.kv_tokens == slower.kv_tokens
    assert slower.output_tok_s < 0.95 * exact.output_tok_s
    short = evaluate(config, work, model="qwen3.6-27b", gpu="b200", deviation=Deviation(free_gib=-40.0))
    assert short.status in ("startup_oom", "runtime_oom") and short.kv_tokens == exact.kv_tokens
