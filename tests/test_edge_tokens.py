"""Edge starts count a prompt in the tokens the server reported for the baseline's requests (issue 21, item 6),
and fall back to 4 characters per token only when it reported none."""

from __future__ import annotations

import json
from pathlib import Path

import optuna
from test_prior import _setup

from autotune.results import TrialResult
from autotune.search.edges import EdgeStarts, reported_prompt_tokens
from autotune.search.starts import CHARS_PER_TOKEN


def baseline_with_records(trial_dir: Path, rows: list[dict]) -> optuna.trial.FrozenTrial:
    """A finished baseline whose replay wrote ``rows`` to its ``records.jsonl``."""
    trial_dir.mkdir(parents=True, exist_ok=True)
    (trial_dir / "records.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = TrialResult(status="ok", config={}, trial_dir=str(trial_dir)).to_dict()
    return optuna.trial.create_trial(value=1.0, user_attrs={"result": result, "role": "baseline"})


def record(line: int, prompt_tokens: int | None = None, pass_no: int = 0) -> dict:
    row = {
        "row": line,
        "sent": 0.0,
        "pass_no": pass_no,
        "chunks": [[0.1, 4]],
        "finish_reason": "length",
        "error": None,
        "ended": 0.2,
        "accept_length": None,
    }
    if prompt_tokens is not None:
        row["prompt_tokens"] = prompt_tokens
    return row


def test_without_reported_prompt_tokens_the_character_estimate_stands(tmp_path):
    cfg, space, feasibility, chars = _setup()
    edges = EdgeStarts(cfg, space, feasibility)
    lines = [line for line, _ in edges.line_chars]
    trials = [baseline_with_records(tmp_path / "0", [record(line) for line in lines])]  # an older replay's records
    assert reported_prompt_tokens(trials) == {}
    mean, ratio, reported = edges.prompt_tokens(trials)
    assert not reported and ratio == 1 / CHARS_PER_TOKEN
    assert abs(mean - sum(chars) / len(chars) / CHARS_PER_TOKEN) < 1e-6
    assert edges.prompt_tokens([]) == (mean, ratio, False)  # no baseline yet: the same estimate


def test_reported_prompt_tokens_replace_the_estimate_and_scale_the_lines_never_sent(tmp_path):
    cfg, space, feasibility, chars = _setup()
    edges = EdgeStarts(cfg, space, feasibility)
    line_chars = dict(edges.line_chars)
    sent = sorted(line_chars)[: len(line_chars) // 2]
    # a tokenizer at 2 characters a token: twice the estimate; a line sent again (pass marker) counts a bit more
    rows = [record(line, line_chars[line] // 2) for line in sent] + [record(sent[0], line_chars[sent[0]], pass_no=1)]
    trials = [baseline_with_records(tmp_path / "0", rows)]
    assert reported_prompt_tokens(trials)[sent[0]] == line_chars[sent[0]] // 2  # its own count, not the pass's
    mean, ratio, reported = edges.prompt_tokens(trials)
    estimate = sum(chars) / len(chars) / CHARS_PER_TOKEN
    assert reported and abs(ratio - 0.5) < 0.01 and abs(mean - 2 * estimate) / (2 * estimate) < 0.01
    before, _ = edges.per_request([], 0)
    after, _ = edges.per_request(trials, 0)
    assert abs((after - before) - estimate) <= 2  # the prompt's share of the KV per request doubled


def test_a_sweep_places_its_edge_start_from_the_baselines_reported_tokens(tmp_path):
    from test_study import PlannerRunner

    from autotune.search.study import run_study

    cfg, *_ = _setup()
    study_cfg = cfg.study.model_copy(
        update={"storage": f"sqlite:///{tmp_path / 's.db'}", "edge_starts": 1, "trials": 3, "confirm_top_k": 0}
    )
    cfg = cfg.model_copy(update={"study": study_cfg, "path": tmp_path / "s.toml"})
    line_chars = dict(EdgeStarts(cfg, *_setup()[1:3]).line_chars)

    class Reports(PlannerRunner):
        """The baseline's replay recorded the server's prompt tokens: 3 characters a token."""

        def __call__(self, config: dict, number: int) -> TrialResult:
            result = super().__call__(config, number)
            if number != 0:
                return result
            where = tmp_path / "trials" / "0"
            baseline_with_records(where, [record(line, chars // 3) for line, chars in line_chars.items()])
            return TrialResult.from_dict({**result.to_dict(), "trial_dir": str(where)})

    study = run_study(cfg, runner=Reports())
    edge = next(t for t in study.get_trials() if t.user_attrs.get("role") == "prior")
    assert edge.user_attrs["edge_prompt_tokens_from"] == "server"
    expected = sum(c // 3 for c in line_chars.values()) / len(line_chars)
    assert abs(edge.user_attrs["edge_prompt_tokens"] - expected) <= 0.1
