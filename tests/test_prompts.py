"""Bad prompt files are one error naming the file and line, before any launch; a short file is a note."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from tinystudy import write_tiny_study

from autotune.cli import main
from autotune.config import load_config
from autotune.config.context import context_limit, misfit_reason, model_context_len
from autotune.errors import ConfigError, WorkloadError
from autotune.prompts import CHARS_PER_TOKEN, UNKNOWN_CONTEXT_TOKENS, PromptRow, PromptSample, estimate_tokens


def write_lines(path: Path, lines: list[bytes | str | dict]) -> Path:
    raw = [
        line if isinstance(line, bytes) else (json.dumps(line) if isinstance(line, dict) else line).encode()
        for line in lines
    ]
    path.write_bytes(b"".join(line + b"\n" for line in raw))
    return path


def test_invalid_utf8_names_its_line_and_byte(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "ok"}, b"", b'{"prompt": "caf\xe9"}'])
    with pytest.raises(WorkloadError) as info:
        PromptSample.load(path, 5)
    text = str(info.value)
    assert text.startswith(f"{path}:3: line is not valid UTF-8 (byte 0xe9 at column 16)")
    assert "re-encode" in text and info.value.file == f"{path}:3"


def test_line_breaks_inside_json_strings_bom_and_crlf_read_as_rows(tmp_path):
    path = tmp_path / "p.jsonl"
    # U+2028 / U+0085 are legal raw inside a JSON string; str.splitlines would cut the row in two.
    path.write_bytes(
        b"\xef\xbb\xbf"
        + json.dumps({"prompt": "a\u2028b\x85c"}, ensure_ascii=False).encode()
        + b"\r\n"
        + json.dumps({"prompt": "second"}).encode()
        + b"\r\n"
    )
    rows = sorted(PromptSample.load(path, 5).rows, key=lambda r: r.line)
    assert [(r.line, r.prompt) for r in rows] == [(1, "a\u2028b\x85c"), (2, "second")]


def test_short_file_carries_a_note_with_its_count(tmp_path):
    path = write_lines(tmp_path / "p.jsonl", [{"prompt": "only one"}])
    sample = PromptSample.load(path, 200)
    assert len(sample) == 1 and sample.short_of == 199
    assert sample.note is not None and "has 1 prompt," in sample.note and "sample_size 200" in sample.note
    full = PromptSample.load(write_lines(tmp_path / "q.jsonl", [{"prompt": f"p{i}"} for i in range(3)]), 3)
    assert full.short_of == 0 and full.note is None


def test_fit_refuses_the_first_prompt_over_the_limit_and_counts_the_rest(tmp_path):
    marker = estimate_tokens(PromptRow(1, prompt="")) * CHARS_PER_TOKEN  # the pass-marker allowance, in chars
    limit, new = 1000, 100
    fits = "x" * ((limit - new) * CHARS_PER_TOKEN - marker)  # exactly at the limit
    path = write_lines(
        tmp_path / "p.jsonl",
        [
            {"prompt": fits},
            {"prompt": fits + "x"},
            {"prompt": "short"},
            {"prompt": fits * 3},
            {"prompt": fits * 2, "max_tokens": 1},
        ],
    )
    sample = PromptSample.load(path, 10)
    with pytest.raises(WorkloadError) as info:
        sample.check_fit(limit, new, source="--context-length")
    text = str(info.value)
    assert text.startswith(f"{path}:2: prompt is ~901 tokens")
    assert "over --context-length (1,000 tokens); 2 more sampled prompts too" in text and "shorten" in text
    only_first = PromptSample(path=path, rows=tuple(r for r in sample.rows if r.line in (1, 3)))
    only_first.check_fit(limit, new)  # at the limit is not over it
    # A row's own smaller max_tokens is what its request asks for.
    PromptSample(path=path, rows=(PromptRow(5, prompt="x" * 1800, max_tokens=1),)).check_fit(limit, new)


def test_unknown_context_still_refuses_what_no_model_could_take(tmp_path):
    huge = PromptRow(7, prompt="x" * ((UNKNOWN_CONTEXT_TOKENS + 1) * CHARS_PER_TOKEN))
    sample = PromptSample(path=tmp_path / "p.jsonl", rows=(PromptRow(1, prompt="x" * 10**6), huge))
    with pytest.raises(WorkloadError, match=r"p.jsonl:7: .*the longest context any model has"):
        sample.check_fit(None, 16)


def test_context_length_comes_from_the_flag_then_the_model(tmp_path):
    model = tmp_path / "my-model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps({"model_type": "x", "text_config": {"max_position_embeddings": 4096}})
    )
    assert model_context_len(str(model)) == 4096
    assert model_context_len("qwen3.6-27b") == 262144
    yarn = tmp_path / "yarn.json"  # SGLang scales the length by a RoPE factor: the limit is never under its own
    yarn.write_text(
        json.dumps(
            {"max_position_embeddings": 32768, "seq_length": 8192, "rope_scaling": {"type": "yarn", "factor": 4.0}}
        )
    )
    assert model_context_len(str(yarn)) == 131072
    assert model_context_len("someone/not-on-disk") is None
    assert context_limit(str(model), {}) == (4096, "my-model's context length", False)
    assert context_limit(str(model), {"context_length": 2048}) == (2048, "--context-length", True)
    sample = PromptSample(path=tmp_path / "p.jsonl", rows=(PromptRow(3, prompt="x" * 20_000),))
    assert "p.jsonl:3: " in misfit_reason(str(model), {"context_length": 2048}, sample, 16)  # the config's outcome
    with pytest.raises(WorkloadError, match="my-model's context length"):  # bad input: no config can serve it
        misfit_reason(str(model), {}, sample, 16)
    assert misfit_reason(str(model), {"context_length": 8192}, sample, 16) is None


def test_study_load_notes_a_short_file_and_refuses_a_notes_key(tmp_path):
    path = write_tiny_study(tmp_path, name="tiny", trials=2)
    write_lines(tmp_path / "prompts.jsonl", [{"prompt": "a"}, {"prompt": "b"}])
    cfg = load_config(path)
    assert len(cfg.notes) == 1 and "has 2 prompts, 14 fewer than sample_size 16" in cfg.notes[0]
    assert "notes" not in cfg.to_dict()
    path.write_text('notes = ["x"]\n' + path.read_text())
    with pytest.raises(ConfigError, match="notes: unknown key"):
        load_config(path)


@pytest.mark.parametrize("case", ["utf8", "non-object", "too-long", "50MB"])
def test_sweep_refuses_a_bad_prompt_file_with_one_line_and_no_launch(tmp_path, monkeypatch, capsys, case):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    study = write_tiny_study(tmp_path, name="tiny", trials=2)
    rows: list[bytes | str | dict] = [{"prompt": f"row {i}"} for i in range(15)]
    bad = {
        "utf8": b'{"prompt": "\xff"}',
        "non-object": "42",
        "too-long": {"prompt": "word " * 8000},
        "50MB": {"prompt": "x" * 50_000_000},
    }[case]
    rows.insert(4, bad)
    write_lines(tmp_path / "prompts.jsonl", rows)
    if case == "too-long":  # 10k tokens over a fixed 8k context
        study.write_text(study.read_text().replace("[engine.fixed]\n", "[engine.fixed]\ncontext_length = 8192\n"))
    t0 = time.monotonic()
    with pytest.raises(SystemExit) as exit_info:
        main(["sweep", "--config", str(study)])
    elapsed = time.monotonic() - t0
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1
    assert len(err) == 1 and err[0].startswith(f"Error: {tmp_path / 'prompts.jsonl'}:5: "), err
    assert not (tmp_path / "tiny").exists() and not (tmp_path / "devices").exists()  # no trial, no server
    assert elapsed < 20, f"refusing took {elapsed:.1f} s"


@pytest.mark.parametrize("case", ["utf8", "over-context"])
def test_measure_refuses_a_bad_prompt_file_with_one_line_and_no_launch(tmp_path, monkeypatch, capsys, case):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    bad = b'{"prompt": "\xc3("}' if case == "utf8" else {"prompt": "x" * (262_144 * CHARS_PER_TOKEN)}
    prompts = write_lines(tmp_path / "p.jsonl", [{"prompt": "fine"}, bad])
    with pytest.raises(SystemExit) as exit_info:
        main(
            [
                "measure",
                "--engine",
                "sim",
                "--prompts",
                str(prompts),
                "--max-tokens",
                "64",
                "--out",
                str(tmp_path / "trial"),
            ]
        )
    err = capsys.readouterr().err.strip().splitlines()
    assert exit_info.value.code == 1
    assert len(err) == 1 and err[0].startswith(f"Error: {prompts}:2: "), err
    assert "qwen3.6-27b's context length" in err[0] or case == "utf8"
    assert not (tmp_path / "trial").exists() and not (tmp_path / "devices").exists()


def test_an_unreadable_prompt_file_names_the_study_key_and_the_file(tmp_path, monkeypatch):
    path = write_tiny_study(tmp_path, name="tiny", trials=2)
    read = Path.read_bytes

    def deny(self: Path) -> bytes:
        if self.name == "prompts.jsonl":
            raise PermissionError(13, "Permission denied", str(self))
        return read(self)

    monkeypatch.setattr(Path, "read_bytes", deny)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(info.value).startswith(
        f"{path}: workload.prompts: cannot read prompts file {tmp_path / 'prompts.jsonl'}"
    )
