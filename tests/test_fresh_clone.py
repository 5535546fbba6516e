"""A fresh clone's one path through the commands: the quick start, then trials, report, apply, fleet up, watch
--once and fleet down, each with no more arguments than the README shows, on the simulated engine; and how the
fleet commands find the fleet apply wrote (``config.studyref.locate_fleet``)."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from autotune.cli import cli, main
from autotune.config.studyref import DEFAULT_STUDY, LAST_APPLY, locate_fleet, record_apply
from autotune.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]

# The example study, smaller: the same file and sections, fewer trials, second-long windows, a 1 × 1 confirmation
# of one window per launch, short requests (the stress phase runs each to max_tokens).
SHRINK = {
    "study": {"trials": "3", "edge_starts": "1", "confirm_top_k": "1", "confirm_repeats": "1", "confirm_windows": "1"},
    "engine": {"sim_options": "{ startup_s = 0.2, noise = 0.02, release_s = 0.2 }"},
    # second-long windows are no steady-state estimate: capped, with a loose settle rule (tests/tinystudy.py)
    "workload": {
        "sample_size": "32",
        "max_tokens": "128",
        "warmup_s": "1",
        "measure_s": "2",
        "warmup_max_s": "2",
        "measure_max_s": "3",
        "target_half_width": "0.5",
        "settle_tolerance": "0.5",
    },
}


def set_key(text: str, section: str, key: str, value: str) -> str:
    """``key = value`` in ``[section]`` of a TOML text: the existing line replaced, else one added under the
    header (the example's keys are unique across its sections)."""
    text, n = re.subn(rf"(?m)^{re.escape(key)} = .*$", lambda _: f"{key} = {value}", text)
    if n == 0:
        text, n = re.subn(rf"(?m)^\[{re.escape(section)}\]\n", lambda m: f"{m[0]}{key} = {value}\n", text)
    assert n == 1, f"example.toml: no single [{section}] {key}"
    return text


def fresh_clone(dest: Path) -> Path:
    """What a clone holds that the quick start reads: the tracked study files and example prompts, nothing the
    tool generated (``.gitignore``: ``studies/*`` but the TOML files and README)."""
    (dest / "studies").mkdir(parents=True)
    for path in [*(ROOT / "studies").glob("*.toml"), ROOT / "studies" / "README.md"]:
        shutil.copy2(path, dest / "studies" / path.name)
    shutil.copytree(ROOT / "examples", dest / "examples", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(ROOT / "README.md", dest / "README.md")
    return dest


def shrink_example(clone: Path, *, prompts: str | None = None, **overrides: str) -> Path:
    """Edit the clone's ``studies/example.toml`` in place for a test's speed (the commands stay the README's);
    ``overrides``: more keys of any section, by name."""
    path = clone / DEFAULT_STUDY
    text = path.read_text()
    for section, keys in SHRINK.items():
        for key, value in keys.items():
            text = set_key(text, section, key, overrides.pop(key, value))
    for key, value in overrides.items():
        text = set_key(text, "study", key, value)
    if prompts is not None:
        text = set_key(text, "workload", "prompts", json.dumps(prompts))
    path.write_text(text)
    return path


def readme_commands(readme: Path) -> list[list[str]]:
    """The quick start's commands as the README gives them: the sweep of its bash block, then each backquoted
    ``autotune …`` of the paragraph after it ("Then `autotune trials`, … read the same study")."""
    text = readme.read_text(encoding="utf-8")
    section = re.search(r"^## Quick start\n(.*?)(?=^## )", text, re.MULTILINE | re.DOTALL)
    assert section, "README.md has no Quick start section"
    block, _, prose = section[1].partition("```bash\n")[2].partition("```")
    sweep = [
        shlex.split(part)[1:]
        for line in block.splitlines()
        for part in line.split("&&")
        if part.strip().startswith("autotune ")
    ]
    later = [shlex.split(cmd)[1:] for cmd in re.findall(r"`(autotune [^`]+)`", prose.replace("\n", " "))]
    return sweep + later


def autotune(*args: str, cwd: Path, env: dict[str, str], timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "autotune", *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout
    )


# -- where the fleet commands look ---------------------------------------------------------------------------------
def test_the_fleet_the_last_apply_wrote_then_the_working_directorys(tmp_path, monkeypatch):
    clone = fresh_clone(tmp_path / "clone")
    monkeypatch.chdir(clone)
    with pytest.raises(ConfigError) as none:
        locate_fleet(None)
    said = str(none.value)
    assert "\n" not in said and "./fleet.toml" in said and "autotune apply" in said and "--fleet" in said
    (clone / "fleet.toml").write_text("")
    assert locate_fleet(None).path == clone / "fleet.toml" and "working directory" in locate_fleet(None).said
    (clone / "deploy").mkdir()
    (clone / "deploy" / "fleet.toml").write_text("")
    note = record_apply(clone / DEFAULT_STUDY, Path("deploy") / "fleet.toml", trial=4)
    assert note == clone / "studies" / "example" / LAST_APPLY
    assert json.loads(note.read_text())["fleet"] == "../../deploy/fleet.toml"  # relative: a moved clone finds it
    found = locate_fleet(None)
    assert found.path == clone / "deploy" / "fleet.toml"
    assert found.said == "fleet: deploy/fleet.toml (the last autotune apply of studies/example.toml)"
    assert locate_fleet(Path("given.toml")).path == Path("given.toml") and locate_fleet(Path("given.toml")).said is None
    (clone / "deploy" / "fleet.toml").unlink()  # removed since: the working directory's, then nothing
    assert locate_fleet(None).path == clone / "fleet.toml"
    (clone / "fleet.toml").unlink()
    with pytest.raises(
        ConfigError,
        match=r"deploy/fleet.toml \(the last apply of studies/example.toml\) and "
        r"\./fleet.toml",
    ):
        locate_fleet(None)


def test_a_fleet_directorys_own_file_comes_before_the_packaged_studys(tmp_path, monkeypatch):
    """With no studies/ here the default study is the one beside the package: ./fleet.toml wins over its apply."""
    clone = fresh_clone(tmp_path / "clone")
    (clone / "deploy").mkdir()
    (clone / "deploy" / "fleet.toml").write_text("")
    record_apply(clone / DEFAULT_STUDY, clone / "deploy" / "fleet.toml")
    monkeypatch.setattr("autotune.config.studyref.resolve_config", lambda _: clone / DEFAULT_STUDY)
    fleet_dir = tmp_path / "srv"
    fleet_dir.mkdir()
    monkeypatch.chdir(fleet_dir)
    assert locate_fleet(None).path == clone / "deploy" / "fleet.toml"  # nothing here: the packaged study's
    (fleet_dir / "fleet.toml").write_text("")
    assert locate_fleet(None).path == fleet_dir / "fleet.toml"


def test_fleet_watch_and_rollouts_without_a_fleet_file_are_one_line(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(fresh_clone(tmp_path / "clone"))
    for args in (
        ["fleet", "status"],
        ["fleet", "up"],
        ["fleet", "down"],
        ["watch", "--once"],
        ["apply", "--rolling"],
        ["apply", "--resume"],
        ["apply", "--rollback"],
    ):
        with pytest.raises(SystemExit) as info:
            main(args)
        assert info.value.code == 1, args
        line = capsys.readouterr().err.strip()
        assert line.startswith("Error: --fleet: no fleet file") and "\n" not in line, (args, line)
    result = CliRunner().invoke(cli, ["fleet", "status"])
    assert result.exit_code == 1 and "no fleet file: looked for ./fleet.toml" in str(result.exception)


# -- the fresh clone, end to end ---------------------------------------------------------------------------------
@pytest.mark.slow
def test_a_fresh_clone_from_the_quick_start_to_a_stopped_fleet(tmp_path, monkeypatch):
    """Every command as the README gives it exits 0; the fleet commands find the fleet apply wrote. The sweep runs
    as the user runs it (its own process); the commands after it in this one (each a CLI invocation as typed)."""
    clone = fresh_clone(tmp_path / "clone")
    shrink_example(clone, trials="2", edge_starts="0")  # the baseline and the hand-tuned config, confirmed
    monkeypatch.chdir(clone)
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    commands = readme_commands(clone / "README.md")
    assert commands == [["sweep"], ["trials"], ["report"], ["apply", "--out", "deploy", "--gpus", "0-1"]]
    # The commands table shows the fleet file as optional for fleet and watch: they run with none.
    table = (clone / "README.md").read_text()
    assert "`autotune fleet up\\|status\\|down [--fleet fleet.toml]`" in table
    assert "`autotune watch [--fleet fleet.toml] [--once]`" in table
    swept = autotune(*commands[0], cwd=clone, env=dict(os.environ))
    assert swept.returncode == 0, (swept.stdout[-2000:], swept.stderr[-2000:])
    invoke = CliRunner().invoke
    out = {}
    for argv in commands[1:]:
        out[argv[0]] = done = invoke(cli, argv)
        assert done.exit_code == 0, (argv, done.output[-2000:], done.exception)
    listed = out["trials"].stdout
    assert "★ winner" in listed and "confirmed (" in listed
    assert "outputs vs baseline" in listed  # the last column whole though no terminal is this wide
    # whole flag names, one per line: every flag the hand-tuned config changes, as the study file spells it
    for flag in (
        "mamba_full_memory_ratio=0.6",
        "max_mamba_cache_size=200",
        "max_running_requests=64",
        "mem_fraction_static=0.93",
    ):
        assert flag in listed
    assert (clone / "reports" / "example.html").is_file()
    assert (clone / "deploy" / "fleet.toml").is_file()
    assert "enable-metrics: true" in (clone / "deploy" / "sglang.yaml").read_text()
    said = "fleet: deploy/fleet.toml (the last autotune apply of studies/example.toml)"
    stopped = None
    try:
        up = invoke(cli, ["fleet", "up"])
        assert up.exit_code == 0, (up.output, up.exception)
        assert said in up.stderr and "started: gpu0, gpu1" in up.stdout
        watched = invoke(cli, ["watch", "--once"])
        assert watched.exit_code == 0, (watched.output, watched.exception)
        assert said in watched.stderr and watched.stdout.count("no drift") == 2
        stopped = invoke(cli, ["fleet", "down"])
    finally:
        if stopped is None or stopped.exit_code != 0:  # no server outlives the test
            invoke(cli, ["fleet", "down", "--fleet", str(clone / "deploy" / "fleet.toml")])
    assert stopped.exit_code == 0 and said in stopped.stderr and "stopped: gpu0, gpu1" in stopped.stdout
