"""A study's files are its own (issue 21, item 4): trial folders keyed by the study's identity, confirmation repeats
told by the caller, a re-created study probing again; end to end on the simulated engine (tiny numerics study)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import optuna
import pytest
from inprocess import run_cli
from test_study import PlannerRunner, write_study
from tinystudy import write_prompts

from autotune.config import load_config
from autotune.harness.fidelity import Reference
from autotune.results import TOO_SLOW, UNTRUSTED_STATUSES, TrialResult
from autotune.search import folders
from autotune.search import runner as runner_mod
from autotune.search.objective import open_study
from autotune.search.runner import HarnessRunner
from autotune.search.study import run_study

# A window this host could not measure (``too_slow``, ``client_bound``, ``invalid_measurement``): the host's verdict
# under load, not the study's, and no probe follows it.
HOST_VERDICTS = UNTRUSTED_STATUSES | {TOO_SLOW}

NUMERICS = """
[study]
name = "num"
trials = 2
seed = 0
sampler = "random"
confirm_top_k = 1
confirm_repeats = 1
confirm_windows = 1

[engine]
kind = "sim"
model = "qwen3.6-27b"
sim_gpu = "b200"
sim_options = { startup_s = 0.2, warmup_s = 0.1, release_s = 0.2 }

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1
speculative_num_steps = 3
speculative_num_draft_tokens = 4
stream_interval = 8

[space]
mamba_ssm_dtype = { choices = ["unset", "bfloat16"] }

[workload]
prompts = "prompts.jsonl"
sample_size = 16
max_tokens = 96
warmup_s = 0.5
measure_s = 1.0
warmup_max_s = 1.0
measure_max_s = 1.5

[objective]
numerics = { prompts = 4, tokens = 64 }

[baseline]
flags = { max_mamba_cache_size = 80 }

[[enqueue]]
label = "bf16"
flags = { max_mamba_cache_size = 160, mamba_ssm_dtype = "bfloat16" }
"""


def snapshot(folder: Path) -> dict[str, tuple[int, int]]:
    """Every file under ``folder``: (size, mtime) — what overwriting or appending would change."""
    return {
        str(p.relative_to(folder)): (p.stat().st_size, p.stat().st_mtime_ns)
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def sweep(capsys: pytest.CaptureFixture[str], path: Path, *extra: str) -> None:
    """``autotune sweep`` in this process (tests/inprocess.py): real simulated servers, no fresh interpreter."""
    run = run_cli(capsys, "sweep", "--config", str(path), *extra)
    assert run.returncode == 0, run.stdout + run.stderr


def trials_of(url: str) -> list[optuna.trial.FrozenTrial]:
    return optuna.load_study(study_name="num", storage=url).get_trials()


def check_own_study(url: str, folder: Path) -> None:
    """Every launch of the study at ``url`` lies in ``folder``, marked with its identity; bf16 trials probed."""
    study = optuna.load_study(study_name="num", storage=url)
    assert folders.read_marker(folder)["id"] == study.user_attrs["files"]["id"]
    assert study.user_attrs["numerics_reference"]["path"] == str(folder / "numerics-reference.json")
    launched = [t for t in study.get_trials() if (t.user_attrs.get("result") or {}).get("trial_dir")]
    assert launched
    for t in launched:
        where = Path(t.user_attrs["result"]["trial_dir"])
        assert where == folder / str(t.number) and (where / "result.json").is_file()
    bf16 = [t for t in launched if t.user_attrs["result"]["config"].get("mamba_ssm_dtype") == "bfloat16"]
    assert bf16
    for t in bf16:
        result = t.user_attrs["result"]
        if result["status"] in HOST_VERDICTS:  # a loaded host measured nothing: the probe runs after a window only
            continue
        fidelity = result["fidelity"]
        assert fidelity["role"] == "probe" and fidelity["prefix_match_mean"] is not None
    for run in study.user_attrs["confirmation"]["runs"]:
        assert Path(run["result"]["trial_dir"]).parent == folder / str(run["trial"])  # <n>/repeat-<k>


@pytest.mark.slow
def test_a_recreated_study_and_a_namesake_elsewhere_get_their_own_folders_and_probe_again(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.chdir(tmp_path)
    write_prompts(tmp_path)
    path = tmp_path / "num.toml"
    path.write_text(NUMERICS)
    url = load_config(path).storage_url
    work = tmp_path / "num"

    sweep(capsys, path)
    first = snapshot(work / "trials")
    check_own_study(url, work / "trials")

    # Start over the way users do: delete the database and sweep again.
    (tmp_path / "num.db").unlink()
    sweep(capsys, path)
    aside = [p for p in work.iterdir() if p.name.startswith("trials.old-")]
    assert len(aside) == 1 and snapshot(aside[0]) == first  # moved whole: nothing overwritten or appended
    check_own_study(url, work / "trials")
    second = snapshot(work / "trials")

    # The same name in another storage: a live study may still read trials/, so it is left alone.
    other = f"sqlite:///{tmp_path / 'other.db'}"
    sweep(capsys, path, "--storage", other)
    ident = optuna.load_study(study_name="num", storage=other).user_attrs["files"]["id"]
    check_own_study(other, work / f"trials-{ident}")
    assert snapshot(work / "trials") == second and snapshot(aside[0]) == first


# --- the runner: the caller says what a launch is -------------------------------------------------------------
class Recorder:
    """``run_trial`` stand-in: records where each launch is filed and whether it carries a probe."""

    def __init__(self):
        self.calls: list[tuple[Path, object]] = []

    def __call__(self, setup, config, *, trial_dir, probe=None, hooks=None, after=()):
        self.calls.append((Path(trial_dir), probe))
        Path(trial_dir).mkdir(parents=True, exist_ok=True)
        return TrialResult(status="ok", config=dict(config), trial_dir=str(trial_dir))


@pytest.fixture
def recorder(monkeypatch):
    rec = Recorder()
    monkeypatch.setattr(runner_mod, "run_trial", rec)
    return rec


def numerics_cfg(tmp_path: Path):
    write_prompts(tmp_path)
    path = tmp_path / "num.toml"
    path.write_text(NUMERICS)
    return load_config(path)


def test_repeats_are_told_by_the_caller_not_read_off_the_disk(tmp_path, recorder, monkeypatch):
    cfg = numerics_cfg(tmp_path)
    runner = HarnessRunner(cfg, stop_event=threading.Event(), study=open_study(cfg))
    ref = Reference(prompts=runner.numerics.prompts, tokens=64, outputs=())
    monkeypatch.setattr(runner.numerics, "reference", lambda: ref)  # as if the baseline had recorded it
    bf16 = {**cfg.engine.fixed, "mamba_ssm_dtype": "bfloat16"}
    (runner.folder / "5").mkdir()  # a folder of that number already there: still trial 5's search launch
    runner(bf16, 5)
    where, probe = recorder.calls[-1]
    assert where == runner.folder / "5.2" and probe is not None and probe.reference is ref  # probed
    runner.repeat(bf16, 5, 0)  # the first confirmation launch: probed again, as every contender's is
    where, probe = recorder.calls[-1]
    assert where == runner.folder / "5" / "repeat-1" and probe is not None and probe.reference is ref
    runner.repeat(bf16, 5, 0)  # an interrupted attempt's folder stays: the rerun goes beside it
    assert recorder.calls[-1][0] == runner.folder / "5" / "repeat-1.2"
    runner.repeat(bf16, 5, 1)
    assert recorder.calls[-1] == (runner.folder / "5" / "repeat-2", None)  # later confirmation launches: speed only
    runner(dict(cfg.baseline_config()), 0)
    assert recorder.calls[-1] == (runner.folder / "0", None)  # the reference's own numerics: nothing to compare


class Legacy(PlannerRunner):
    """A runner of the layout before identities: every launch in ``<work_dir>/trials/<n>``, no marker."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder

    def __call__(self, config: dict, number: int) -> TrialResult:
        (self.folder / str(number)).mkdir(parents=True, exist_ok=True)
        (self.folder / str(number) / "server.log").write_text("old\n")
        result = super().__call__(config, number)
        return TrialResult.from_dict({**result.to_dict(), "trial_dir": str(self.folder / str(number))})


def test_a_study_from_before_identities_keeps_its_folder_and_a_stranger_does_not_take_it(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=2))
    legacy = cfg.work_dir / "trials"
    study = run_study(cfg, runner=Legacy(legacy))
    assert not (legacy / "study.json").exists()
    # resumed: its stored results point into trials/, so the folder is this study's (and now marked so)
    assert folders.study_folder(cfg, study) == legacy and folders.read_marker(legacy)["id"]

    other = cfg.model_copy(update={"study": cfg.study.model_copy(update={"storage": f"sqlite:///{tmp_path}/b.db"})})
    lines: list[str] = []
    stranger = folders.study_folder(other, open_study(other), log=lines.append)
    assert stranger.name.startswith("trials-") and stranger != legacy
    assert (legacy / "0" / "server.log").read_text() == "old\n" and lines and "belongs to" in lines[0]


def test_an_unmarked_folder_of_a_deleted_study_is_never_adopted(tmp_path):
    cfg = load_config(write_study(tmp_path, trials=1))
    (cfg.work_dir / "trials" / "0").mkdir(parents=True)  # an older layout's folder, no study of ours points in
    study = open_study(cfg)
    chosen = folders.study_folder(cfg, study)
    assert (
        chosen != cfg.work_dir / "trials"
        and json.loads((chosen / "study.json").read_text())["id"] == study.user_attrs["files"]["id"]
    )
    assert folders.study_folder(cfg, study) == chosen  # stable across calls and processes
