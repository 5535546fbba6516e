"""The fidelity probe (issue 14): figures, errors, the constraint, and a study on the simulated engine end to end.

The end-to-end tests run real sim servers (0.2 s startups, 1 s windows of 128-token answers, 8 prompts × 128 probe
tokens).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import optuna
import pytest
from inprocess import run_cli
from tinystudy import write_prompts

from autotune.config import load_config
from autotune.config.sections import NumericsLimits
from autotune.errors import ConfigError
from autotune.harness import steps as trial_mod
from autotune.harness.fidelity import (
    FidelityProbe,
    FlagChange,
    ProbeError,
    ProbeOutput,
    Reference,
    choose_prompts,
    compare,
    run_probe,
)
from autotune.report import data as rd
from autotune.report import importance as ri
from autotune.search import numerics as sn

TEMPLATE = """
[study]
name = "{name}"
trials = {trials}
seed = 0
sampler = "random"
confirm_top_k = 1
confirm_repeats = 1
confirm_windows = 1

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"
sim_options = {{ startup_s = 0.2, warmup_s = 0.1, release_s = 0.2 }}

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1
speculative_num_steps = 3
speculative_num_draft_tokens = 4
stream_interval = 8

[space]
mamba_ssm_dtype = {{ choices = {choices} }}

[workload]
prompts = "prompts.jsonl"
sample_size = 16
max_tokens = 128
# 24 streams, not 2 × the running cap: the replay runs in the test's own process, and a loaded host's CPU once left
# it busy 97 % of both of a window's tries (client_bound: the enqueued trial unmeasured)
concurrency = 24  # still above every cap the tests compare (the baseline 16, f32-mid 19)
warmup_s = 0.5
measure_s = 1.0
{caps}

[objective]
numerics = {{ prompts = 8, tokens = 128{limit} }}

[baseline]
flags = {{ max_mamba_cache_size = 80 }}
{enqueue}
"""
FAST_BF16 = """
[[enqueue]]
label = "bf16-fast"
flags = { max_mamba_cache_size = 240, mamba_ssm_dtype = "bfloat16" }

[[enqueue]]
label = "f32-mid"
flags = { max_mamba_cache_size = 96 }
"""


SHORT_CAPS = "warmup_max_s = 1.0\nmeasure_max_s = 2.0"  # quick; trials stay unsettled, which these tests allow


def write_study(
    tmp_path: Path, *, name: str, trials: int, choices: str, limit: str = "", enqueue: str = "", caps: str = SHORT_CAPS
) -> Path:
    write_prompts(tmp_path)
    path = tmp_path / f"{name}.toml"
    path.write_text(TEMPLATE.format(name=name, trials=trials, choices=choices, limit=limit, enqueue=enqueue, caps=caps))
    return path


@pytest.fixture
def cli(tmp_path, monkeypatch, capsys):
    """``autotune ARGS`` run from ``tmp_path`` on its own simulated GPUs, in this process (tests/inprocess.py); the
    sweeps still launch real simulated servers."""
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    return lambda *args: run_cli(capsys, *args)


def trials_of(path: Path) -> list[optuna.trial.FrozenTrial]:
    cfg = load_config(path)
    return optuna.load_study(study_name=cfg.name, storage=cfg.storage_url).get_trials()


# --- figures ---------------------------------------------------------------------------------------------------
def out(ids, lps=None) -> ProbeOutput:
    return ProbeOutput(tuple(ids), tuple(lps if lps is not None else [-0.1] * len(ids)))


def test_compare_counts_the_matching_prefix_exact_prompts_and_logprob_deltas_on_the_prefix_only():
    ref = [out([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4]), out([5, 6, 7, 8], [-1.0, -1.0, -1.0, -1.0])]
    got = [out([1, 2, 9, 9], [-0.15, -0.2, -5.0, -5.0]), out([5, 6, 7, 8], [-1.0, -1.1, None, -1.0])]
    figures = compare(ref, got, 4)
    assert figures.prefix_match_mean == 3.0 and figures.prefix_match_min == 2
    assert figures.exact_share == 0.5 and figures.first_difference == (2, None)
    # scored on both sides within the prefix: 0.05, 0.0 (prompt 1); 0.0, 0.1, 0.0 (prompt 2; one None skipped)
    assert figures.scored_tokens == 5 and figures.mean_abs_logprob_delta == pytest.approx(0.03)


def test_prompts_are_spread_evenly_through_the_sample_and_fixed():
    rows = list(range(100))
    assert choose_prompts(rows, 4) == [0, 25, 50, 75] and choose_prompts(rows[:3], 16) == [0, 1, 2]


def test_limits_are_constraint_entries_and_an_unmeasured_probe_violates_them():
    limits = NumericsLimits(min_prefix_match=64, max_mean_abs_logprob_delta=0.05)
    assert limits.violations(None) == [64 - 256, -0.05]  # no probe needed: outputs equal by construction
    assert limits.violations({"role": "reference"}) == [64 - 256, -0.05]
    probed = {"role": "probe", "prefix_match_mean": 30.0, "mean_abs_logprob_delta": 0.02}
    assert limits.violations(probed) == pytest.approx([34.0, -0.03])
    assert limits.violations({"role": "probe", "error": "boom"}) == [1.0, 1.0]
    assert NumericsLimits().limits() == []  # off by default
    with pytest.raises(ValueError, match="cannot exceed"):
        NumericsLimits(min_prefix_match=300, tokens=256)


def test_a_bad_limit_is_one_line_naming_the_key(tmp_path):
    path = write_study(tmp_path, name="bad", trials=1, choices='["unset"]', limit=", min_prefix_match = -1")
    with pytest.raises(ConfigError, match="objective.numerics.min_prefix_match"):
        load_config(path)


# --- errors are trial errors ------------------------------------------------------------------------------------
class _Handler(BaseHTTPRequestHandler):
    mode = "no-logprobs"

    def do_POST(self):  # noqa: N802
        self.rfile.read(int(self.headers.get("content-length") or 0))
        if self.mode == "500":
            self.send_response(500)
            self.end_headers()
            self.wfile.write(b'{"error": {"message": "boom"}}')
            return
        body = json.dumps({"text": " a b", "output_ids": [1, 2], "meta_info": {"id": "x", "completion_tokens": 2}})
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.end_headers()
        self.wfile.write(body.encode())

    def log_message(self, *args):
        pass


@pytest.mark.parametrize(("mode", "words"), [("no-logprobs", "does not support return_logprob"), ("500", "HTTP 500")])
def test_a_server_without_logprobs_or_with_an_error_fails_the_trial_loudly(tmp_path, mode, words):
    handler = type("H", (_Handler,), {"mode": mode})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    ref = Reference(prompts=("p",), tokens=2, outputs=(out([1, 2]),))
    probe = FidelityProbe(prompts=("p",), tokens=2, reference=ref, changes=(FlagChange(flag="kv_cache_dtype"),))
    try:
        with pytest.raises(ProbeError, match=words):
            run_probe(url, probe)

        class Alive:
            base_url, alive = url, True

        fields = trial_mod._probe(Alive(), probe, tmp_path, {}, lambda *a: None)
        assert fields.status == "probe_error" and fields.reason is not None and words in fields.reason
        assert fields.reason.startswith("fidelity probe:") and fields.fidelity is not None and fields.fidelity.error
        assert fields.fidelity.changes == ({"flag": "kv_cache_dtype", "value": None, "reference": None},)
    finally:
        server.shutdown()


# --- which studies probe --------------------------------------------------------------------------------------
def test_only_a_space_that_can_change_numerics_probes(tmp_path):
    f32 = load_config(
        write_study(tmp_path, name="f32", trials=1, choices='["unset", "float32"]', limit=", min_prefix_match = 64")
    )
    assert not sn.aware(f32) and not sn.constrained(f32)
    bf16 = load_config(write_study(tmp_path, name="bf16", trials=1, choices='["unset", "bfloat16"]'))
    assert sn.aware(bf16) and not sn.constrained(bf16)  # measured and shown, no limit set
    assert [c.flag for c in sn.changes(bf16, {"mamba_ssm_dtype": "bfloat16"})] == ["mamba_ssm_dtype"]
    assert sn.changes(bf16, {"mamba_ssm_dtype": "float32", "max_mamba_cache_size": 80}) == []  # float32 = reference


# --- on the simulator, end to end ------------------------------------------------------------------------------
@pytest.mark.slow
def test_float32_only_space_runs_no_probe_and_has_no_constraint(tmp_path, cli):
    path = write_study(
        tmp_path, name="f32", trials=2, choices='["unset", "float32"]', limit=", min_prefix_match = 64", caps=""
    )  # default caps: a settled contender is confirmed
    run = cli("sweep", "--config", str(path), "--json")
    assert run.returncode == 0, run.stderr
    done = [t for t in trials_of(path) if t.state == optuna.trial.TrialState.COMPLETE]
    assert len(done) == 2
    # No search trial is probed; the baseline's launch records the reference, for the confirmation's contender probe.
    for t in done:
        fidelity = t.user_attrs["result"]["fidelity"]
        assert len(t.user_attrs["constraint"]) == 1
        if t.user_attrs["role"] == "baseline":
            assert fidelity["role"] == "reference"
        else:
            assert fidelity is None and "probe" not in t.user_attrs["result"]["durations_s"]
    study = optuna.load_study(study_name="f32", storage=load_config(path).storage_url)
    assert Path(study.user_attrs[sn.REFERENCE_ATTR]["path"]).is_file()
    # The confirmed contender (a float32 config: equal outputs) is compared, with no alarm.
    conf = study.user_attrs["confirmation"]
    probed = [r["result"]["fidelity"] for r in conf["runs"] if r["trial"] != conf["baseline_trial"]]
    assert probed and all(f["role"] == "probe" and f["exact_share"] == 1.0 and not f["unexpected"] for f in probed)


@pytest.mark.slow
def test_bfloat16_trials_are_probed_the_limit_crowns_float32_and_apply_refuses_bfloat16(tmp_path, cli):
    path = write_study(
        tmp_path,
        name="num",
        trials=3,
        choices='["unset", "bfloat16"]',
        limit=", min_prefix_match = 120",
        enqueue=FAST_BF16,
    )
    run = cli("sweep", "--config", str(path), "--json")
    assert run.returncode == 0, run.stderr
    trials = {t.number: t for t in trials_of(path) if t.state == optuna.trial.TrialState.COMPLETE}
    by_label = {t.user_attrs.get("label"): t for t in trials.values()}
    base, fast, mid = by_label["baseline"], by_label["bf16-fast"], by_label["f32-mid"]
    # The probe runs on the bfloat16 trial only; the baseline's launch recorded the reference.
    assert base.user_attrs["result"]["fidelity"]["role"] == "reference"
    assert mid.user_attrs["result"]["fidelity"] is None
    fid = fast.user_attrs["result"]["fidelity"]
    assert fid["role"] == "probe" and fid["prompts"] == 8 and fid["tokens"] == 128
    assert [c["flag"] for c in fid["changes"]] == ["mamba_ssm_dtype"]
    assert 1 <= fid["prefix_match_mean"] < 120 and fid["exact_share"] < 1
    assert fid["mean_abs_logprob_delta"] == pytest.approx(0.02, abs=1e-6)  # the sim's bfloat16 SSM shift
    assert (Path(fast.user_attrs["result"]["trial_dir"]) / "fidelity.json").is_file()
    ref_attr = optuna.load_study(study_name="num", storage=load_config(path).storage_url).user_attrs[
        "numerics_reference"
    ]
    assert Path(ref_attr["path"]).is_file() and ref_attr["trial"] == base.number and len(ref_attr["sha256"]) == 64
    # The limit is one more constraint entry: violated by the faster bfloat16 trial, so float32 wins.
    assert fast.user_attrs["constraint"][0] < 0 < fast.user_attrs["constraint"][-1]
    assert len(mid.user_attrs["constraint"]) == 2 and mid.user_attrs["constraint"][-1] <= 0
    assert fast.values[0] > mid.values[0]  # 48 running requests against 19
    study = optuna.load_study(study_name="num", storage=load_config(path).storage_url)
    assert study.user_attrs["confirmation"]["winner_trial"] == mid.number

    # The report: a numerics section that says why, and a mark on the trial whose outputs differ.
    from autotune.report.page import build, figures_for, render

    report = build(study, base_dir=tmp_path)
    frame = report.tables["trials"]
    assert frame.set_index("trial").loc[fast.number, "outputs_differ"]
    assert frame.set_index("trial").loc[fast.number, "outcome"] == "outputs differ beyond the numerics limit"
    assert list(report.tables["numerics"]["trial"]) == [fast.number]
    page = render(report, figures_for(report))
    assert 'id="numerics"' in page and "Why this winner" in page and "outputs differ from the baseline" in page

    # trials: a column
    run = cli("trials", "--config", str(path), "--json")
    rows = {r["number"]: r for r in json.loads(run.stdout)}
    assert rows[fast.number]["numerics"].endswith("|Δlp| 0.020") and rows[base.number]["numerics"] == "reference"

    # apply: the bfloat16 trial only with --accept-numerics; its figures land in provenance.json
    refused = cli(
        "apply", "--config", str(path), "--trial", str(fast.number), "--out", str(tmp_path / "d1"), "--gpus", "0"
    )
    assert refused.returncode == 1 and "--accept-numerics" in refused.stderr and "limit" in refused.stderr
    assert not (tmp_path / "d1").exists()
    ok = cli(
        "apply",
        "--config",
        str(path),
        "--trial",
        str(fast.number),
        "--out",
        str(tmp_path / "d2"),
        "--gpus",
        "0",
        "--accept-numerics",
        "--allow-unstressed",
    )  # not the winner
    assert ok.returncode == 0, ok.stderr
    prov = json.loads((tmp_path / "d2" / "provenance.json").read_text())
    assert prov["numerics"]["fidelity"]["prefix_match_mean"] == fid["prefix_match_mean"]
    assert prov["numerics"]["limits"] == {"min_prefix_match": 120} and prov["numerics"]["problem"]
    winner = cli("apply", "--config", str(path), "--out", str(tmp_path / "d3"), "--gpus", "0")
    assert winner.returncode == 0, winner.stderr
    assert json.loads((tmp_path / "d3" / "provenance.json").read_text())["numerics"]["changes"] == []

    # A resumed study whose reference file is gone records it again before probing.
    import threading as th

    from autotune.search.runner import HarnessRunner

    Path(ref_attr["path"]).unlink()
    runner = HarnessRunner(load_config(path), stop_event=th.Event())
    again = runner(dict(fast.user_attrs["result"]["config"]), 99)
    assert again.status == "ok" and again.fidelity.role == "probe"
    assert again.fidelity.prefix_match_mean == fid["prefix_match_mean"]  # seeded: the same divergence
    assert (tmp_path / "num" / "trials" / "reference" / "fidelity.json").is_file()


def test_apply_refuses_a_numerics_change_without_a_measured_probe():
    from autotune.deploy.apply import Winner
    from autotune.deploy.numerics import NumericsRefused, check_numerics
    from autotune.results import TrialResult
    from autotune.search.views.settings import StudySettings

    config = {"mamba_ssm_dtype": "bfloat16"}
    winner = Winner(
        study="s",
        trial=3,
        config=config,
        result=TrialResult(status="ok", config=config),
        tok_s=1.0,
        baseline_config={},
        settings=StudySettings.of({"engine": {"model": "qwen3.6-27b"}}),
    )
    with pytest.raises(NumericsRefused, match="no fidelity probe measured"):
        check_numerics(winner)
    assert check_numerics(winner, accept=True).accepted is True


# --- parameter importance ---------------------------------------------------------------------------------------
def _conditional_study(n: int, *, flat: bool = False) -> optuna.Study:
    """Like the seed: a conditional flag (the strategy only with the cache on) leaves most trials without it."""
    from optuna.distributions import CategoricalDistribution, IntDistribution

    rng = __import__("random").Random(0)
    study = optuna.create_study(direction="maximize")
    dists = {
        "running": IntDistribution(16, 256, step=16),
        "cache_off": CategoricalDistribution([False, True]),
        "strategy": CategoricalDistribution(["auto", "lazy"]),
        "chunk": CategoricalDistribution([4096, 8192]),
    }
    for _ in range(n):
        params = {
            "running": rng.choice(range(16, 257, 16)),
            "cache_off": rng.random() < 0.8,
            "chunk": rng.choice([4096, 8192]),
        }
        if not params["cache_off"]:
            params["strategy"] = rng.choice(["auto", "lazy"])
        value = 1000.0 if flat else params["running"] * 10 + (500 if params["cache_off"] else 0) + rng.random()
        study.add_trial(
            optuna.trial.create_trial(
                params=params,
                distributions={k: dists[k] for k in params},
                values=[value],
                user_attrs={"role": "search"},
            )
        )
    return study


def test_importance_ranks_conditional_flags_over_the_trials_that_have_them():
    importance = ri.importance_frame(_conditional_study(40))
    assert len(importance) >= 2 and importance["importance"].nunique() >= 2  # never a uniform split
    assert importance.iloc[0]["param"] == "running"
    assert importance["importance"].sum() == pytest.approx(1.0)


def test_importance_says_it_cannot_rank_rather_than_drawing_a_uniform_split():
    assert ri.importance_frame(_conditional_study(40, flat=True)).empty
    assert ri.importance_frame(_conditional_study(3)).empty


def test_the_seed_study_ranks_its_flags_or_says_it_cannot(tmp_path):
    """The seed study (its space, workload and planner) on the simulator's virtual clock."""
    from autotune.search.runner import predict
    from autotune.search.study import run_study

    text = (Path(__file__).parents[1] / "studies" / "qwen3.6-27b-b200.toml").read_text()
    prompts = Path(__file__).parents[1] / "examples" / "prompts.jsonl"
    path = tmp_path / "seed.toml"
    path.write_text(text.replace("../examples/prompts.jsonl", str(prompts)).replace("trials = 30", "trials = 20"))
    cfg = load_config(path)

    class Quiet:
        def __getattr__(self, name):
            return lambda *a, **k: None

    study = run_study(cfg, runner=lambda c, n: predict(cfg, c, seed=n), progress=Quiet())
    importance = ri.importance_frame(study)
    if importance.empty:
        from autotune.report.page import _importance_note, build

        assert ri.NOT_ENOUGH_TO_RANK in _importance_note(build(study, base_dir=tmp_path)).lower()
    else:
        assert importance["importance"].nunique() >= 2 and "mamba_ssm_dtype" in set(importance["param"])


def test_the_failures_table_explains_a_self_contradictory_planner_message():
    from autotune.sglang.memory import plan
    from autotune.sglang.profiles import load_gpu, load_model

    flags = {
        "speculative_algorithm": "EAGLE",
        "speculative_eagle_topk": 1,
        "speculative_num_steps": 3,
        "speculative_num_draft_tokens": 4,
        "max_mamba_cache_size": 1200,
        "mem_fraction_static": 0.88,
    }
    memory = plan(load_model("qwen3.6-27b"), load_gpu("b200"), flags)
    assert "under --mem-fraction-static=0.88. Raise --mem-fraction-static above 0.3" in memory.message
    note = rd.planner_note(memory.to_dict())
    assert "the Mamba state pool (1200 slots" in note and "The Mamba pool took the memory" in note
    assert "56.6 GiB" in note and "for the KV cache" in note
    frame = rd.pd.DataFrame(
        [
            {
                "trial": 5,
                "outcome": "infeasible (planner)",
                "status": "skipped_infeasible",
                "reason": memory.message,
                "log_path": "",
                "planner_note": note,
            }
        ]
    )
    reason = rd.failures_frame(frame)["reason"][0]
    assert reason.splitlines() == [memory.message, note]
