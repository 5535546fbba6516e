"""The job's own input file through the commands: a 1,000-row OpenAI Batch API file (chat and completions lines)
and a ShareGPT-style file each run ``autotune measure`` and the example sweep on the simulated engine; a bad line
stops either command with one line naming the file, its line and the field, before any server starts. (The
readers themselves: ``tests/test_prompt_formats.py``.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_fresh_clone import fresh_clone, shrink_example

from autotune.cli import main

BAD_LINE = 617  # 1-based, as the error names it
BAD = {"custom_id": "bad", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": "hi"}}


def batch_line(i: int) -> dict:
    """Odd rows chat, even rows completions, each with its own output budget; chat rows with a temperature."""
    if i % 2:
        body = {
            "model": "m",
            "messages": [
                {"role": "system", "content": "Be brief."},
                {"role": "user", "content": f"Explain topic {i} step by step. " * 3},
            ],
            "max_completion_tokens": 200 + i % 100,
            "temperature": 0.7,
        }
        return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
    body = {"model": "m", "prompt": f"Write a short story about {i}. " * 5, "max_tokens": 150}
    return {"custom_id": f"req-{i}", "method": "POST", "url": "/v1/completions", "body": body}


def write_batch(path: Path, *, bad: bool = False) -> Path:
    rows = [batch_line(i) for i in range(1000)]
    if bad:
        rows[BAD_LINE - 1] = BAD
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def write_sharegpt(path: Path) -> Path:
    """300 conversations (a human turn, then a reply whose length is the output budget) and one with no human turn."""
    records = [
        {
            "id": f"c{i}",
            "conversations": [
                {"from": "human", "value": f"Tell me about item {i}. " * 4},
                {"from": "gpt", "value": "word " * (50 + i % 200)},
            ],
        }
        for i in range(300)
    ]
    records.append({"id": "no-human", "conversations": [{"from": "gpt", "value": "hello"}]})
    path.write_text(json.dumps(records))
    return path


def _env(tmp_path: Path) -> dict[str, str]:
    return {**os.environ, "AUTOTUNE_SIM_DEVICE_DIR": str(tmp_path / "devices")}


def _one_error_line(err: str) -> str:
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("Error: "), err
    return lines[0]


def test_a_bad_batch_line_stops_measure_and_the_sweep_before_any_server(tmp_path, monkeypatch, capsys):
    clone = fresh_clone(tmp_path / "clone")
    bad = write_batch(clone / "job.jsonl", bad=True)
    shrink_example(clone, prompts="../job.jsonl")
    monkeypatch.chdir(clone)
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path / "devices"))
    for argv in (["measure", "--prompts", "job.jsonl", "--warmup", "1", "--window", "1"], ["sweep"]):
        with pytest.raises(SystemExit) as info:
            main(argv)
        line = _one_error_line(capsys.readouterr().err)
        assert info.value.code == 1, argv
        assert f"job.jsonl:{BAD_LINE}:" in line and "body.messages" in line, line
    assert bad.is_file()
    # nothing was started or written: no simulated device claimed, no trial folder, no study storage
    assert not (tmp_path / "devices").exists() and not (clone / "runs").exists()
    assert not (clone / "studies" / "example.db").exists() and not (clone / "studies" / "example").exists()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("name", "write", "fmt"), [("job.jsonl", write_batch, "batch"), ("job.json", write_sharegpt, "sharegpt")]
)
@pytest.mark.slow
def test_the_jobs_own_file_runs_measure_and_the_example_sweep(tmp_path, name, write, fmt):
    clone = fresh_clone(tmp_path / "clone")
    write(clone / name)
    env = _env(tmp_path)

    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "autotune", *argv], cwd=clone, env=env, capture_output=True, text=True, timeout=120
        )

    measured = run(
        "measure",
        "--prompts",
        name,
        "--sample",
        "16",
        "--max-tokens",
        "256",
        "--warmup",
        "0.5",
        "--warmup-max",
        "0.5",
        "--window",
        "1",
        "--window-max",
        "1",
        "--sim-opt",
        "startup_s=0.2",
        "--out",
        "m",
        "--json",
    )
    assert measured.returncode == 0, measured.stderr[-2000:]
    result = json.loads(measured.stdout)
    assert result["status"] == "ok" and result["metrics"]["output_tok_s"] > 0 and not result["metrics"]["errors"]
    served = re.findall(r'"POST (/\S+) HTTP', (clone / "m" / "server.log").read_text())
    if fmt == "batch":  # each line went to the endpoint its url names, both kinds in the sample
        assert {"/v1/chat/completions", "/v1/completions"} <= set(served) and "/generate" not in served
    else:  # ShareGPT turns are chat rows: the native endpoint, rendered with the simulator's ChatML
        assert "/generate" in served
        assert "skipped 1 record with no human turn" in measured.stderr
    # the example sweep with the job's file as its sample (the copy's [workload] prompts), as the README runs it
    shrink_example(
        clone,
        prompts=f"../{name}",
        trials="2",
        edge_starts="0",
        confirm_top_k="0",
        sample_size="16",
        warmup_s="0.5",
        measure_s="1",
        warmup_max_s="1",
        measure_max_s="1.5",
    )
    swept = run("sweep")
    assert swept.returncode == 0, swept.stderr[-2000:]
    assert "2 trials (2 ok)" in swept.stdout, swept.stdout[-2000:]
