"""The report page end to end: CLI, file formats, errors, and a headless-Chromium render of a 200-trial study."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
from pathlib import Path

import optuna
import pytest
import studyfactory as sf
from click.testing import CliRunner
from inprocess import run_cli
from plotly.offline import get_plotlyjs

from autotune.cli import cli
from autotune.errors import StorageError, StudyError
from autotune.report.page import build, figures_for, open_study, render, report

pytestmark = pytest.mark.timeout(180)
ARTIFACTS = Path(__file__).resolve().parents[1] / "test-artifacts"
FIGURE_SECTIONS = ("history", "capacity", "slices", "importance", "parallel", "memory", "latency", "compare")
# Injected into a copy of the page (never into the report itself): records script errors and console.error
# calls into the DOM, so --dump-dom shows them.
CAPTURE = """<script>window.__errs=[];(function(){var keep=function(m){window.__errs.push(String(m));
var e=document.getElementById('__errs');if(e)e.textContent=window.__errs.join('\\n');};
window.addEventListener('error',function(ev){keep('error: '+ev.message);});
window.addEventListener('unhandledrejection',function(ev){keep('rejection: '+ev.reason);});
var orig=console.error;console.error=function(){keep('console.error: '+Array.from(arguments).join(' '));
return orig.apply(console,arguments);};
document.addEventListener('DOMContentLoaded',function(){var p=document.createElement('pre');p.id='__errs';
p.textContent=window.__errs.join('\\n');document.body.appendChild(p);});})();</script>"""


@pytest.fixture(scope="module")
def page(tmp_path_factory) -> Path:
    """The page of a 200-trial B200 study (with trial logs and records) compared with a 60-trial H200 one.

    Built from in-memory studies: SQLite would spend most of the test writing trials; the CLI tests below
    cover loading from storage."""
    root = tmp_path_factory.mktemp("page")
    b200 = sf.make_study(n_trials=200, seed=7, name="qwen-b200", trials_dir=root / "qwen-b200")
    h200 = sf.make_study(n_trials=60, seed=8, name="qwen-h200", gpu="h200")
    out = root / "reports" / "qwen-b200.html"
    built = build(b200, base_dir=out.parent, compare=[h200])
    out.parent.mkdir()
    out.write_text(render(built, figures_for(built)), encoding="utf-8")
    return out


@pytest.fixture(scope="module")
def big(tmp_path_factory) -> tuple[Path, str]:
    """Two small studies in one SQLite storage, for the CLI."""
    root = tmp_path_factory.mktemp("studies")
    url = f"sqlite:///{root / 'studies.db'}"
    sf.make_study(n_trials=30, seed=7, name="qwen-b200", storage=url, trials_dir=root / "qwen-b200")
    sf.make_study(n_trials=12, seed=8, name="qwen-h200", gpu="h200", storage=url)
    return root, url


@pytest.mark.slow
def test_page_is_self_contained_and_small(page):
    text = page.read_text(encoding="utf-8")
    assert page.stat().st_size < 10 * 2**20
    assert text.count(get_plotlyjs()[:200]) == 1  # plotly.js inlined exactly once
    assert not re.search(r"<script[^>]+src=", text) and "cdn.plot.ly" not in text.replace(get_plotlyjs(), "")
    for key in FIGURE_SECTIONS:
        assert f'id="{key}"' in text and f'id="fig-{key}"' in text
    assert "pareto" not in re.findall(r'<section class="card figure-section" id="(\w+)"', text)  # one objective
    assert "python -m sglang.launch_server --model-path Qwen/Qwen3.6-27B" in text
    assert "../qwen-b200/trials/" in text  # failure rows link to their logs relative to the page


def _chromium() -> str | None:
    found = next((shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome") if shutil.which(n)), None)
    if found is None:
        if os.environ.get("AUTOTUNE_REQUIRE_ALL") == "1":
            pytest.fail("headless Chromium is required (apt-get install chromium)")
        pytest.skip("chromium is not installed")
    return found


def _run_chromium(binary: str, profile: Path, *args: str) -> subprocess.CompletedProcess:
    flags = [
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-quic",
        "--no-first-run",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        # Parallel coordinates draw with WebGL; without a GPU only SwiftShader provides it.
        "--enable-unsafe-swiftshader",
        f"--user-data-dir={profile}",
        "--enable-logging=stderr",
        "--v=0",
        "--hide-scrollbars",
        "--virtual-time-budget=5000",
    ]
    return subprocess.run([binary, *flags, *args], capture_output=True, text=True, timeout=120, check=False)


@pytest.mark.slow
def test_every_figure_renders_in_headless_chromium(page, tmp_path):
    binary = _chromium()
    probe = tmp_path / "probe.html"
    probe.write_text(page.read_text(encoding="utf-8").replace("<head>", "<head>" + CAPTURE, 1), encoding="utf-8")
    ARTIFACTS.mkdir(exist_ok=True)
    shot = ARTIFACTS / "report-200-trials.png"
    shot.unlink(missing_ok=True)
    # One browser run: the DOM after the scripts ran on stdout, and a full-page screenshot as a test artifact.
    run = _run_chromium(
        binary, tmp_path / "profile", "--window-size=1280,9000", "--dump-dom", f"--screenshot={shot}", probe.as_uri()
    )
    dom = run.stdout
    assert run.returncode == 0 and "</html>" in dom, run.stderr[-2000:]
    errors = re.search(r'<pre id="__errs">(.*?)</pre>', dom, re.S)
    assert errors is not None and errors.group(1).strip() == "", errors.group(1) if errors else dom[-500:]
    assert not re.search(r"Uncaught|TypeError|ReferenceError", run.stderr)
    sections = dict(re.findall(r'<section class="card figure-section" id="(\w+)"(.*?)</section>', dom, re.S))
    assert set(sections) == set(FIGURE_SECTIONS)
    for key, body in sections.items():
        assert body.count("main-svg") >= 1, key  # plotly ran and drew its SVG layers
        drawn = len(re.findall(r'class="trace|class="parcoords"|class="point"', body))
        assert drawn >= 1, f"{key}: no traces drawn"
    assert sections["history"].count('class="point"') == 200  # every trial drawn, failures included
    assert "<canvas" in sections["parallel"]  # parcoords lines live on WebGL canvases
    assert shot.is_file() and shot.stat().st_size > 50_000  # a blank page compresses to a few KB


def test_cli_formats_json_and_csv(big, tmp_path):
    _, url = big
    runner = CliRunner()
    result = runner.invoke(cli, ["report", "--study", "qwen-b200", "--storage", url, "--format", "json"])
    assert result.exit_code == 0, result.output
    tables = json.loads(result.output)
    assert {"trials", "memory", "latency", "importance", "failures", "headline", "flag_diff"} <= set(tables)
    assert len(tables["trials"]) == 30 and any(r["status"] == "crash" for r in tables["trials"])
    out = tmp_path / "tables"
    result = runner.invoke(
        cli, ["report", "--study", "qwen-b200", "--storage", url, "--format", "csv", "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    trials_csv = (out / "trials.csv").read_text().splitlines()
    assert trials_csv[0].startswith("study,trial,state,status") and len(trials_csv) == 31
    assert (out / "memory.csv").is_file()


def test_cli_html_default_path_and_compare(big, tmp_path, monkeypatch):
    _, url = big
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(cli, ["report", "--study", "qwen-h200", "--storage", url, "--compare", "qwen-b200"])
    assert result.exit_code == 0, result.output
    page = tmp_path / "reports" / "qwen-h200.html"
    assert result.output.strip() == f"Wrote {Path('reports') / 'qwen-h200.html'}" and page.is_file()
    text = page.read_text(encoding="utf-8")
    assert 'id="compare-table"' in text and "qwen-b200" in text


def test_unknown_study_and_storage_are_one_line_errors(big, tmp_path, monkeypatch, capsys):
    _, url = big
    monkeypatch.chdir(tmp_path)
    run = run_cli(capsys, "report", "--study", "nope", "--storage", url)  # the entry point, in this process
    assert run.returncode == 1 and run.stderr.count("\n") == 1
    assert run.stderr.startswith("Error: no study named 'nope'") and "qwen-b200" in run.stderr
    run = run_cli(capsys, "report", "--study", "ghost")  # default storage studies/ghost.db does not exist
    assert run.returncode == 1 and run.stderr.startswith("Error: no study storage at studies/ghost.db")
    assert not (tmp_path / "studies").exists()  # a typo must not create an empty database


def test_library_errors_name_the_problem(tmp_path):
    with pytest.raises(StorageError, match=r"postgresql://u:\*\*\*@127.0.0.1:1/x") as info:
        open_study("s", "postgresql://u:secret@127.0.0.1:1/x")  # no driver here, or no server there: one line
    assert "secret" not in str(info.value)
    url = f"sqlite:///{tmp_path / 'empty.db'}"
    study = optuna.create_study(study_name="empty", storage=url)
    study.add_trial(optuna.trial.create_trial(state=optuna.trial.TrialState.FAIL))
    with pytest.raises(StudyError, match="has no completed trials"):
        report(study="empty", storage=url, out=tmp_path / "r.html")
    assert not (tmp_path / "r.html").exists()
    with pytest.raises(StudyError, match="holds 2 studies"):
        optuna.create_study(study_name="other", storage=url)
        open_study(None, url)


def test_launch_command_uses_sglang_spelling():
    from autotune.report.page import launch_command

    config = {**sf.FIXED, "max_mamba_cache_size": 200, "disable_radix_cache": True, "enable_metrics": False}
    argv = shlex.split(launch_command(config, "ignored-when-model_path-is-set"))
    assert argv[:5] == ["python", "-m", "sglang.launch_server", "--model-path", "Qwen/Qwen3.6-27B"]
    assert argv[argv.index("--max-mamba-cache-size") + 1] == "200"
    assert "--disable-radix-cache" in argv and "--enable-metrics" not in argv
    assert argv[argv.index("--mamba-radix-cache-strategy") + 1] == "extra_buffer"


def test_config_file_gives_study_and_storage(big, tmp_path):
    root, _ = big
    toml = tmp_path / "qwen-b200.toml"
    (tmp_path / "prompts.jsonl").write_text('{"prompt": "hello"}\n', encoding="utf-8")  # the config checks it
    toml.write_text(
        f'[study]\nname = "qwen-b200"\nstorage = "sqlite:///{root / "studies.db"}"\n'
        '[workload]\nprompts = "prompts.jsonl"\n',
        encoding="utf-8",
    )
    other = tmp_path / "qwen-h200.toml"
    other.write_text(toml.read_text(encoding="utf-8").replace('"qwen-b200"', '"qwen-h200"'), encoding="utf-8")
    out = tmp_path / "page.json"
    result = CliRunner().invoke(
        cli, ["report", "--config", str(toml), "--out", str(out), "--format", "json", "--compare", str(other)]
    )
    assert result.exit_code == 0, result.output
    tables = json.loads(out.read_text())
    assert len(tables["trials"]) == 30 and [r["gpu"] for r in tables["compare"]] == ["b200", "h200"]


def test_two_objective_study_gets_a_pareto_section(tmp_path):
    study = sf.make_study(n_trials=20, seed=3, multi_objective=True, name="mo")
    built = build(study, base_dir=tmp_path)
    figs = figures_for(built)
    assert "pareto" in figs and "compare" not in figs
    front = built.tables["pareto"]["on_front"].sum()
    assert len(figs["pareto"].data[1].x) == front  # the red trace is exactly the front
    page = render(built, figs)
    assert 'id="pareto"' in page and "p99_itl_ms" in page


def test_study_where_nothing_measured_still_explains_itself(tmp_path):
    from autotune.results import TrialResult

    study = optuna.create_study(study_name="walls")
    oom = TrialResult(
        status="startup_oom",
        config={"mem_fraction_static": 0.5},
        reason="Not enough memory. Please try to increase --mem-fraction-static.",
    )
    study.add_trial(optuna.trial.create_trial(value=0.0, user_attrs={"result": oom.to_dict(), "constraint": [1.0]}))
    study.add_trial(
        optuna.trial.create_trial(
            state=optuna.trial.TrialState.FAIL, user_attrs={"result": TrialResult(status="crash", config={}).to_dict()}
        )
    )
    built = build(study, base_dir=tmp_path)
    figs = figures_for(built)
    assert list(figs) == ["history", "capacity"]  # nothing measured: no latency, importance or slices
    page = render(built, figs)
    assert "No trial ran successfully" in page and "Not enough memory. Please try" in page


def test_study_swept_on_several_gpus_shows_the_per_gpu_spread(tmp_path):
    source = sf.make_study(n_trials=20, seed=5, name="fleet")
    study = optuna.create_study(study_name="fleet", directions=source.directions)
    for key, value in source.user_attrs.items():
        study.set_user_attr(key, value)
    second_baseline = None
    for t in source.trials:  # as two workers record them: even trials on GPU 0, odd ones on GPU 1
        attrs = {**t.user_attrs, "gpu": f"node:{t.number % 2}"}
        if second_baseline is None and t.number % 2 == 1 and attrs["result"]["status"] == "ok":
            second_baseline, attrs["role"] = t.number, "baseline"  # each GPU calibrates with its own baseline
        study.add_trial(
            optuna.trial.create_trial(
                state=t.state, values=t.values, params=t.params, distributions=t.distributions, user_attrs=attrs
            )
        )
    assert second_baseline is not None
    built = build(study, base_dir=tmp_path)
    per_gpu = built.tables["per_gpu"]
    assert list(per_gpu["gpu"]) == ["node:0", "node:1"]
    assert per_gpu["vs_median"].notna().all() and per_gpu["baseline_tok_s"].gt(0).all()
    page = render(built, figures_for(built))
    assert 'id="per-gpu"' in page and "Per-GPU calibration" in page
    single = build(source, base_dir=tmp_path)  # one GPU: no such section
    assert "per_gpu" not in single.tables


def test_cpu_study_is_labelled_by_its_engine_and_device_and_hides_secrets(tmp_path):
    token = "hf_" + "Zq8rT2vLm9Kx4Wn7Pb3Yc6Hd1"
    study = sf.make_study(n_trials=8, seed=3, name="tiny-cpu", crash_every=0)
    settings = dict(study.user_attrs["autotune"])
    settings["engine"] = {
        **settings["engine"],
        "kind": "sglang",
        "device": "cpu",
        "python": "/opt/sgl/bin/python",
        "env": {"HF_TOKEN": token, "OMP_NUM_THREADS": "2"},
    }  # sim_gpu stays the default b200
    study.set_user_attr("autotune", settings)
    built = build(study, base_dir=tmp_path)
    assert built.facts.gpu == "CPU" and built.facts.engine == "sglang"
    launch = built.facts.launch
    assert launch.startswith('HF_TOKEN="$HF_TOKEN" OMP_NUM_THREADS=2 /opt/sgl/bin/python -m sglang.launch_server ')
    argv = shlex.split(launch.split(" ", 2)[2])
    assert argv[argv.index("--device") + 1] == "cpu"
    page = render(built, figures_for(built))
    assert "on CPU · engine sglang" in page and "on b200" not in page
    assert token not in page
