"""The README is the newcomer's page: its quick start is what CI runs and what the CLI parses, it stays short, and
every page it and the docs link to exists (anchors included), so the reference that moved to docs/ stays findable.
"""

from __future__ import annotations

import dataclasses
import re
import shlex
from pathlib import Path

import click
import pytest

from autotune.cli import COMMANDS, cli
from autotune.config import load_config
from autotune.config.studyref import DEFAULT_STUDY, resolve_config

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted((ROOT / "docs").glob("*.md"))
README_MAX_LINES = 150

FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _section(text: str, title: str) -> str:
    """The body of the ``## title`` section, up to the next ``## `` heading."""
    match = re.search(rf"^## {re.escape(title)}\n(.*?)(?=^## |\Z)", text, re.MULTILINE | re.DOTALL)
    assert match, f"README.md has no '## {title}' section"
    return match.group(1)


def _shell_lines(block: str) -> list[str]:
    """A bash block's command lines: continuations joined, comments and blank lines dropped."""
    joined = re.sub(r"\\\n\s*", " ", block)
    lines = [line.split(" #", 1)[0].strip() for line in joined.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def _bash_blocks(text: str) -> list[str]:
    return [body for lang, body in FENCE.findall(text) if lang in ("bash", "sh", "shell")]


def _quick_start() -> list[str]:
    """The quick start's first bash block: the two commands a newcomer types first."""
    blocks = _bash_blocks(_section(README.read_text(encoding="utf-8"), "Quick start"))
    assert blocks, "the quick start has no bash block"
    return _shell_lines(blocks[0])


def _autotune_argv(lines: list[str]) -> list[list[str]]:
    """The ``autotune …`` commands of these shell lines (each side of ``&&`` on its own), as argv."""
    commands = [shlex.split(part) for line in lines for part in line.split("&&")]
    return [argv[1:] for argv in commands if argv and argv[0] == "autotune"]


def _autotune_commands(text: str) -> list[list[str]]:
    """Every ``autotune …`` command of the text's bash blocks."""
    return [argv for block in _bash_blocks(text) for argv in _autotune_argv(_shell_lines(block))]


def _parse(argv: list[str]) -> click.Context:
    """Parse a command line as the CLI would, down to its subcommand, without running anything."""
    ctx = click.Context(cli, info_name="autotune")
    command: click.Command = cli
    args = [a for a in argv if a != "--debug"]
    while isinstance(command, click.Group):
        assert args, f"autotune {shlex.join(argv)}: no subcommand"
        name, *args = args
        sub = command.get_command(ctx, name)
        assert sub is not None, f"autotune {shlex.join(argv)}: {name!r} is not a command"
        command = sub
        ctx = command.make_context(name, list(args), parent=ctx) if not isinstance(command, click.Group) else ctx
    return ctx


def test_the_quick_start_test_command_is_what_ci_runs():
    ci = [line.strip() for line in (ROOT / ".ci" / "run").read_text(encoding="utf-8").splitlines()]
    pytest_lines = [line for line in ci if re.match(r"(python3? -m )?pytest\b", line)]
    assert pytest_lines, ".ci/run runs no pytest command"
    readme_tests = [line for line in _quick_start() if "pytest" in line]
    assert len(_quick_start()) == 2 and len(readme_tests) == 1
    assert shlex.split(readme_tests[0]) == shlex.split(pytest_lines[-1])


def test_the_quick_start_sweep_parses_and_reads_the_example_study(monkeypatch):
    monkeypatch.chdir(ROOT)
    sweeps = _autotune_argv(_quick_start())
    assert sweeps == [["sweep"]], sweeps
    ctx = _parse(sweeps[0])
    assert ctx.command.name == "sweep" and ctx.params["config_path"] is None  # no study named: the default one
    assert resolve_config(None) == ROOT / DEFAULT_STUDY
    assert load_config(ROOT / DEFAULT_STUDY).name


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_autotune_command_shown_parses(page, monkeypatch):
    monkeypatch.chdir(ROOT)
    for argv in _autotune_commands(page.read_text(encoding="utf-8")):
        try:
            _parse(argv)
        except click.ClickException as exc:
            pytest.fail(f"{page.name}: autotune {shlex.join(argv)}: {exc.format_message()}")


def test_the_commands_table_has_every_subcommand():
    table = _section(README.read_text(encoding="utf-8"), "Commands")
    shown = set(re.findall(r"^\| `autotune (\w+)", table, re.MULTILINE))
    assert shown == set(COMMANDS)


def test_the_readme_fits_on_two_screens():
    lines = README.read_text(encoding="utf-8").count("\n")
    assert lines <= README_MAX_LINES, f"README.md has {lines} lines; move reference text into docs/"


def test_every_docs_page_is_linked_from_the_readme():
    linked = {(README.parent / target.split("#")[0]).resolve() for target in _links(README)}
    missing = [p.name for p in PAGES if p.resolve() not in linked]
    assert not missing, f"docs pages not linked from README.md: {missing}"


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, punctuation removed, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).replace("`", "")
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        slug = github_slug(heading)
        anchors.add(f"{slug}-{seen[slug]}" if slug in seen else slug)
        seen[slug] = seen.get(slug, 0) + 1
    return anchors


def _links(path: Path) -> list[str]:
    prose = re.sub(r"`[^`\n]*`", "", FENCE.sub("", path.read_text(encoding="utf-8")))
    return [t for t in LINK.findall(prose) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def test_github_slugs():
    assert github_slug("1. The table (SGLang 0.5.23)") == "1-the-table-sglang-0523"
    assert github_slug("Rolling the winner out: `apply`, fleet") == "rolling-the-winner-out-apply-fleet"
    assert github_slug("Servers over several GPUs (GPU groups)") == "servers-over-several-gpus-gpu-groups"


@pytest.mark.parametrize("page", [README, *PAGES], ids=lambda p: p.name)
def test_every_relative_link_resolves(page):
    broken = []
    for target in _links(page):
        file_part, _, anchor = target.partition("#")
        dest = (page.parent / file_part).resolve() if file_part else page
        if not dest.exists():
            broken.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(f"{target} (no heading #{anchor} in {dest.name})")
    assert not broken, f"{page.name}: broken links: {broken}"


def test_the_parse_check_refuses_what_the_cli_would():
    with pytest.raises(click.NoSuchOption):
        _parse(["sweep", "--no-such-option"])
    with pytest.raises(AssertionError, match="not a command"):
        _parse(["fleet", "upp"])


def test_the_study_file_page_names_every_section_and_key():
    """A key the schema gains without a line in docs/study-file.md's reference fails here, naming the key."""
    from autotune.config import Timeouts
    from autotune.config import sections as s

    page = (ROOT / "docs" / "study-file.md").read_text(encoding="utf-8")
    reference = re.search(r"^## Every section and key\n(.*?)(?=^## |\Z)", page, re.MULTILINE | re.DOTALL)
    assert reference, "docs/study-file.md has no '## Every section and key' section"
    text = reference.group(1)
    tables = {
        "[study]": s.StudySection,
        "[engine]": s.EngineSection,
        "[space]": s.ParamSpec,
        "[workload]": s.WorkloadSection,
        "[objective]": s.ObjectiveSection,
        "[baseline]": s.BaselineSection,
        "[[enqueue]]": s.Enqueued,
        "[launcher.slurm]": s.SlurmSection,
        "[launcher.container]": s.ContainerSection,
        "[launcher.ssh]": s.SshSection,
        "[job]": s.JobSection,
    }
    missing = [table for table in tables if f"`{table}`" not in text]
    keys = {
        f.alias or name for m in [*tables.values(), s.Condition, s.NumericsLimits] for name, f in m.model_fields.items()
    }
    keys |= {f.name for f in dataclasses.fields(Timeouts)}
    missing += sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"docs/study-file.md, '## Every section and key': add {missing}"
