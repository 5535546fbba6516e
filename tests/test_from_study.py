"""``autotune sweep --from STUDY``: translation to the installed SGLang, fitting to the new space, the planner's
scaled start, provenance, and bad input refused before any launch (the in-process fake runner; no servers)."""

from __future__ import annotations

import optuna
import pytest
from test_study import STUDY, PlannerRunner, ok, write_study, write_toml

from autotune.cli import main
from autotune.cli.fromstudy import start_from
from autotune.cli.sweep import render
from autotune.cli.trials import rows as trial_rows
from autotune.config import load_config
from autotune.errors import ConfigError
from autotune.results import Capacity, TrialResult
from autotune.search.correction import CorrectedFeasibility
from autotune.search.space import Space
from autotune.search.study import Sweep
from autotune.search.sweep import run_sweep
from autotune.search.views.origin import fit_space
from autotune.search.warm import WARM_KEY, learnt, scaled, warm_planner
from autotune.sglang.flags import FlagTable
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sglang.translate import translate


# --- translation to the installed SGLang -------------------------------------------------------------------
def test_a_renamed_flag_is_translated_and_a_vanished_one_dropped_with_one_line():
    old = {
        "mamba_scheduler_strategy": "extra_buffer",
        "enable_old_overlap": True,
        "max_running_requests": 64,
        "cuda_graph_max_bs": 64,
    }
    config, lines = translate(old, FlagTable.bundled())
    # RENAMED names exactly one successor that 0.5.23 has: renamed, value kept
    assert config == {"mamba_radix_cache_strategy": "extra_buffer", "max_running_requests": 64}
    assert lines.count("renamed --mamba-scheduler-strategy to --mamba-radix-cache-strategy (sglang 0.5.23)") == 1
    vanished = [line for line in lines if "--enable-old-overlap" in line]
    assert vanished == ["dropped --enable-old-overlap: not a flag of sglang 0.5.23"]
    # two successors (decode or prefill): which one is not ours to guess; dropped with SGLang's own advice
    split = [line for line in lines if "--cuda-graph-max-bs" in line]
    assert len(split) == 1 and split[0].startswith("dropped --cuda-graph-max-bs: ") and "decode" in split[0]


def test_a_vanished_flag_is_never_taken_for_the_flag_it_prefixes():
    # argparse would read --max-mamba-cache as --max-mamba-cache-size (a unique prefix): a different flag
    config, lines = translate({"max_mamba_cache": 96}, FlagTable.bundled())
    assert config == {} and lines == ["dropped --max-mamba-cache: not a flag of sglang 0.5.23"]


def test_a_flag_another_version_drops_is_dropped_there():
    rows = [
        {
            "flags": list(s.option_strings),
            "dest": s.dest,
            "default": s.default,
            "type": s.type,
            "choices": s.choices,
            "nargs": s.nargs,
            "is_store_true": s.store_true,
        }
        for s in FlagTable.bundled().specs
        if s.dest != "mamba_ssm_dtype"
    ]
    newer = FlagTable.from_json(rows, version="0.6.0")
    config, lines = translate({"mamba_ssm_dtype": "bfloat16", "max_running_requests": 32}, newer)
    assert config == {"max_running_requests": 32}
    assert lines == ["dropped --mamba-ssm-dtype: not a flag of sglang 0.6.0"]


def test_environment_levers_are_carried_and_an_unknown_one_dropped():
    config, lines = translate(
        {"env:SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": "1", "env:SGLANG_GONE_SWITCH": "1"}, FlagTable.bundled()
    )
    assert config == {"env:SGLANG_OPT_MAMBA_SKIP_DECODE_LOCK": True}
    assert lines == ["dropped SGLANG_GONE_SWITCH: not an environment variable of sglang 0.5.23"]


# --- fitting to the new study's space ----------------------------------------------------------------------
def test_values_outside_the_space_are_clamped_or_replaced_with_a_line(tmp_path):
    extra = 'mamba_ssm_dtype = { choices = ["float32", "bfloat16"] }\n'
    text = STUDY.format(trials=4, sampler="tpe", extra="").replace("[space.derived]", extra + "\n[space.derived]")
    cfg = load_config(
        write_toml(
            tmp_path,
            text.replace("max_mamba_cache_size = 80 }", 'max_mamba_cache_size = 80, mamba_ssm_dtype = "bfloat16" }'),
        )
    )
    source = {
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 2,
        "max_mamba_cache_size": 900,
        "mem_fraction_static": 0.93,
        "speculative_num_steps": 2,
        "speculative_num_draft_tokens": 9,
        "mamba_ssm_dtype": "float16",
    }
    fitted, lines = fit_space(source, cfg, Space.from_config(cfg))
    assert fitted["speculative_eagle_topk"] == 1  # the study's fixed flag wins
    assert fitted["max_mamba_cache_size"] == 512  # above the range: its top
    assert fitted["mem_fraction_static"] == 0.93  # inside the range, off its step: as given
    assert fitted["speculative_num_draft_tokens"] == 3  # derived again from the carried steps
    assert fitted["mamba_ssm_dtype"] == "bfloat16"  # not among the choices: the baseline's value
    assert len(lines) == 3
    assert "max_mamba_cache_size: 900 clamped to 512 (this study's range 64–512)" in lines
    assert any(line.startswith("mamba_ssm_dtype: float16 is not among") for line in lines)
    # nothing to change: the config stays as that study measured it (its draft tokens are not derived again)
    measured = {**source, "speculative_eagle_topk": 1, "max_mamba_cache_size": 200, "mamba_ssm_dtype": "bfloat16"}
    assert fit_space(measured, cfg, Space.from_config(cfg)) == (measured, [])


# --- the planner starts from the earlier study's corrections, scaled ---------------------------------------
class ShortRunner(PlannerRunner):
    """The fake engine on a device with ``short_gib`` less free after loading than the planner models."""

    def __init__(self, short_gib: float, tok_scale: float = 1.0):
        super().__init__()
        self.short_gib, self.tok_scale = short_gib, tok_scale

    def __call__(self, config: dict, number: int) -> TrialResult:
        self.calls.append((number, dict(config)))
        pre = plan(self.model, self.gpu, config).extra["pre_gib"]
        mp = plan(self.model, self.gpu, config, free_gib=pre - self.short_gib)
        if not mp.fits:
            return TrialResult(status=mp.failure, config=config, reason=mp.message)
        cap = Capacity(
            max_running_requests=mp.max_running_requests, kv_tokens=mp.kv_tokens, mamba_slots=mp.max_mamba_cache_size
        )
        return ok(config, 100.0 * self.tok_scale * mp.max_running_requests, capacity=cap)


def test_scaled_corrections_start_the_planner_until_it_measures_its_own():
    model = load_model("qwen3.6-27b")
    earlier = CorrectedFeasibility(model, load_gpu("b200"))
    earlier.offsets, earlier.room = [2.0, 2.4, 2.2], [(1.0, -0.5), (3.0, -1.5)]
    ratio = load_gpu("h200").memory_gib / load_gpu("b200").memory_gib
    record = {"corrections": scaled(learnt(earlier), ratio)}
    here = CorrectedFeasibility(model, load_gpu("h200"))
    warm_planner(here, record)
    assert here.offset_gib == pytest.approx(2.2 * ratio, abs=1e-4)  # the median offset, scaled by the memory ratio
    by_hand = CorrectedFeasibility(model, load_gpu("h200"))
    by_hand.room = [(1.0, -0.5 * ratio), (3.0, -1.5 * ratio)]  # activations kept, GiB scaled
    assert here.room_model() == pytest.approx(by_hand.room_model(), abs=1e-3)
    config = {"max_mamba_cache_size": 128, "mem_fraction_static": 0.9}
    cold = CorrectedFeasibility(model, load_gpu("h200"))
    assert (
        here.predict(config).kv_tokens == here._plan(config, here.offset_gib).kv_tokens < cold.predict(config).kv_tokens
    )
    here.offsets.append(0.5)  # this study's own measurement replaces the prior
    assert here.offset_gib == 0.5


def _h200(tmp_path, name: str = "h", model: str = "qwen3.6-27b"):
    text = (
        STUDY.format(trials=5, sampler="tpe", extra="")
        .replace('name = "t"', f'name = "{name}"')
        .replace('sim_gpu = "b200"', 'sim_gpu = "h200"')
        .replace('model = "qwen3.6-27b"', f'model = "{model}"')
    )
    return load_config(write_toml(tmp_path, text, name=name))


def test_a_retune_enqueues_the_winner_scales_the_planner_and_says_where_it_started(tmp_path):
    source = load_config(write_study(tmp_path, trials=6))
    earlier = run_sweep(source, runner=ShortRunner(2.0))
    assert earlier.best is not None
    cfg, said = _h200(tmp_path), []
    start_from(cfg, str(tmp_path / "t.toml"), said.append)
    assert said[0].startswith(f"started from study t (sqlite:///{tmp_path}/t.db; sglang 0.5.23 (simulated) on b200)")
    stored = optuna.load_study(study_name="h", storage=cfg.storage_url).user_attrs[WARM_KEY]
    assert stored["configs"][0]["label"] == f"from t: winner (was trial {earlier.best.trial})"
    assert len(stored["configs"]) <= 4 and stored["to"]["gpu"] == "h200"
    # the planner of the new study starts from the earlier offsets, scaled to the H200's memory
    sweep = Sweep(cfg, runner=ShortRunner(1.0, tok_scale=0.5))
    try:
        sweep.prepare()
        ratio = stored["corrections"]["scale"]
        assert ratio == pytest.approx(load_gpu("h200").memory_gib / load_gpu("b200").memory_gib, abs=1e-4)
        assert sweep.feasibility.offset_gib == pytest.approx(2.0 * ratio, abs=0.05)
        queued = [t.user_attrs["label"] for t in sweep.study.get_trials() if t.user_attrs.get("role") == "enqueued"]
        assert queued[1:] == [c["label"] for c in stored["configs"]]  # after the file's own [[enqueue]]
    finally:
        sweep.close()
    summary = run_sweep(cfg, runner=ShortRunner(1.0, tok_scale=0.5))
    text = render(summary)
    assert text.splitlines()[1] == f"  {said[0]}"
    # each carried config was measured here (half the speed): none of the earlier study's figures is shown
    before = {t.number: t.values[0] for t in optuna.load_study(study_name="t", storage=source.storage_url).trials}
    carried = {e.label: e.output_tok_s for e in summary.enqueued if (e.label or "").startswith("from t:")}
    assert len(carried) == len(stored["configs"]) >= 2
    for c in stored["configs"]:
        assert carried[c["label"]] == pytest.approx(0.5 * before[c["trial"]], rel=0.3)
        assert f"{before[c['trial']]:,.0f} tok/s" not in text


def test_trials_say_where_the_study_started(tmp_path, capsys):
    run_sweep(load_config(write_study(tmp_path, trials=4)), runner=PlannerRunner())
    cfg = _h200(tmp_path)
    start_from(cfg, str(tmp_path / "t.toml"), lambda line: None)
    run_sweep(cfg, runner=PlannerRunner())
    study = optuna.load_study(study_name="h", storage=cfg.storage_url)
    assert any(r.role.startswith("enqueued:from t: winner") for r in trial_rows(study))
    capsys.readouterr()
    with pytest.raises(SystemExit) as code:
        main(["trials", "--config", str(tmp_path / "h.toml")])
    assert code.value.code == 0
    out = capsys.readouterr().out
    assert f"started from study t (sqlite:///{tmp_path}/t.db; sglang 0.5.23 (simulated) on b200)" in out


# --- bad input: one error naming --from, before anything launches ------------------------------------------
def test_no_such_study_names_the_option(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = _h200(tmp_path)
    with pytest.raises(ConfigError) as err:
        start_from(cfg, "nosuch", lambda line: None)
    assert err.value.key == "--from" and "no study storage" in err.value.message
    assert not (tmp_path / "h.db").exists()  # nothing created, nothing launched


def test_a_study_with_nothing_measured_is_refused(tmp_path):
    source = load_config(write_study(tmp_path, trials=3))
    run_sweep(source, runner=PlannerRunner(status="crashed"))
    with pytest.raises(ConfigError) as err:
        start_from(_h200(tmp_path), str(tmp_path / "t.toml"), lambda line: None)
    assert err.value.key == "--from" and "no finished trial that measured" in err.value.message
    assert "autotune sweep --study t" in str(err.value.fix)


def test_another_model_is_refused(tmp_path):
    run_sweep(load_config(write_study(tmp_path, trials=3)), runner=PlannerRunner())
    with pytest.raises(ConfigError) as err:
        start_from(_h200(tmp_path, model="qwen3-next-80b-a3b"), str(tmp_path / "t.toml"), lambda line: None)
    assert err.value.key == "--from" and "tuned model qwen3.6-27b" in err.value.message


def test_the_cli_fails_before_any_launch(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    _h200(tmp_path)
    with pytest.raises(SystemExit) as code:
        main(["sweep", "--config", str(tmp_path / "h.toml"), "--from", "missing.toml"])
    assert code.value.code != 0
    err = capsys.readouterr().err
    assert "--from: no study file missing.toml" in err and not (tmp_path / "h").exists()
