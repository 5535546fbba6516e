"""The job's own input file as the sample: OpenAI Batch API JSONL, ShareGPT JSON, and the model's chat template."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
from test_workload import sse_server  # noqa: F401  (the fake SGLang stream server fixture)

from autotune.errors import WorkloadError
from autotune.harness.workload import replay
from autotune.prompts import ChatTemplate, PromptSample, read_file

LLAMA_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n\n"
    "{{ m['content'] | trim }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)


def _batch_line(i: int) -> dict:
    if i % 2:
        body = {
            "model": "m",
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"question {i}"}],
            "max_completion_tokens": 100 + i,
            "temperature": 0.7,
        }
        url = "/v1/chat/completions"
    else:
        body = {"model": "m", "prompt": f"complete {i}", "max_tokens": 50}
        url = "/v1/completions"
    return {"custom_id": f"req-{i}", "method": "POST", "url": url, "body": body}


def _write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return path


def test_a_batch_api_file_reads_chat_and_completions_lines_as_given(tmp_path):
    read = read_file(_write_jsonl(tmp_path / "batch.jsonl", [_batch_line(i) for i in range(1000)]))
    assert read.format == "batch" and len(read.rows) == 1000
    chat, completion = read.rows[1], read.rows[0]
    assert chat.endpoint == "chat" and chat.max_tokens == 101 and chat.temperature == 0.7
    assert [m["role"] for m in chat.messages] == ["system", "user"]
    assert completion.endpoint == "completions" and completion.prompt == "complete 0" and completion.max_tokens == 50
    assert completion.temperature is None


@pytest.mark.parametrize(
    ("bad", "says"),
    [
        ({"custom_id": "x", "method": "POST", "url": "/v1/embeddings", "body": {"input": "a"}}, '"url"'),
        ({"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}}, '"method"'),
        ({"custom_id": "x", "url": "/v1/completions", "body": {"prompt": ["a", "b"]}}, "body.prompt"),
        ({"custom_id": "x", "url": "/v1/chat/completions", "body": {"messages": "hi"}}, "body.messages"),
        (
            {
                "custom_id": "x",
                "url": "/v1/chat/completions",
                "body": {"messages": [{"role": "user", "content": "a"}], "max_completion_tokens": 0},
            },
            "max_completion_tokens",
        ),
        (
            {"custom_id": "x", "url": "/v1/completions", "body": {"prompt": "a", "temperature": "hot"}},
            "body.temperature",
        ),
    ],
)
def test_a_bad_batch_line_is_one_error_with_its_line_number(tmp_path, bad, says):
    rows = [_batch_line(i) for i in range(1000)]
    rows[616] = bad
    path = _write_jsonl(tmp_path / "batch.jsonl", rows)
    with pytest.raises(WorkloadError) as err:
        PromptSample.load(path, 200, seed=1)
    text = str(err.value)
    assert f"{path}:617" in text and says in text and "\n" not in text


def test_a_batch_file_with_several_bad_lines_names_each_in_one_line(tmp_path):
    rows = [_batch_line(i) for i in range(1000)]
    rows[9] = {"custom_id": "x", "method": "GET", "url": "/v1/completions", "body": {"prompt": "a"}}
    rows[616] = {"custom_id": "y", "url": "/v1/embeddings", "body": {"input": "a"}}
    path = _write_jsonl(tmp_path / "batch.jsonl", rows)
    with pytest.raises(WorkloadError) as err:
        PromptSample.load(path, 200, seed=1)
    text = str(err.value)
    assert "\n" not in text and f"{path}:10" in text and '"method"' in text  # the first, with its fix
    assert "1 more bad line: line 617:" in text and '"url"' in text  # and the second, by line and message
    for i in range(1, 21):  # many bad lines: the first few named, then a count
        rows[i * 40] = "not json"
    with pytest.raises(WorkloadError) as err:
        PromptSample.load(_write_jsonl(path, rows), 200, seed=1)
    assert "21 more bad lines" in str(err.value) and "and 17 more" in str(err.value)


def _sharegpt(tmp_path: Path, records: list) -> Path:
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(records))
    return path


def test_a_sharegpt_file_takes_the_turns_before_the_first_reply_and_its_length(tmp_path):
    records = [
        {
            "id": "a",
            "conversations": [
                {"from": "human", "value": "Tell me a story."},
                {"from": "gpt", "value": "x" * 400},
                {"from": "human", "value": "more"},
            ],
        },
        {"id": "b", "conversations": []},  # empty: skipped, as the serving benchmarks skip it
        {"id": "c", "conversations": [{"from": "system", "value": "You are terse."}, {"from": "human", "value": "Hi"}]},
    ]
    sample = PromptSample.load(_sharegpt(tmp_path, records), 10, seed=0)
    assert sample.format == "sharegpt" and len(sample) == 2 and sample.skipped == 1
    by_line = {r.line: r for r in sample.rows}
    assert by_line[0].messages == ({"role": "user", "content": "Tell me a story."},)
    assert by_line[0].max_tokens == 100  # 400 characters of reply at 4 per token
    assert [m["role"] for m in by_line[2].messages] == ["system", "user"] and by_line[2].max_tokens is None
    assert "skipped 1 record" in sample.note


def test_a_bad_sharegpt_record_names_its_index(tmp_path):
    path = _sharegpt(
        tmp_path,
        [{"conversations": [{"from": "human", "value": "a"}]}, {"conversations": [{"from": "narrator", "value": "b"}]}],
    )
    with pytest.raises(WorkloadError) as err:
        PromptSample.load(path, 10)
    assert f"{path}: record 1" in str(err.value) and "narrator" in str(err.value)


def test_a_sampled_sharegpt_prompt_over_the_context_names_its_record(tmp_path):
    path = _sharegpt(tmp_path, [{"conversations": [{"from": "human", "value": "word " * 4000}]}])
    with pytest.raises(WorkloadError) as err:
        PromptSample.load(path, 1).check_fit(1024, 64)
    assert f"{path}: record 0" in str(err.value)


def _model_dir(tmp_path: Path, config: dict, *, jinja: str | None = None) -> Path:
    model = tmp_path / "model"
    model.mkdir()
    (model / "tokenizer_config.json").write_text(json.dumps(config))
    if jinja is not None:
        (model / "chat_template.jinja").write_text(jinja)
    return model


def test_chat_rows_are_rendered_with_the_models_own_template(tmp_path):
    model = _model_dir(tmp_path, {"chat_template": LLAMA_TEMPLATE, "bos_token": "<|begin_of_text|>"})
    path = _write_jsonl(
        tmp_path / "p.jsonl", [{"messages": [{"role": "user", "content": " Hello "}]}, {"prompt": "plain text"}]
    )
    sample = PromptSample.load(path, 10).for_model(model)
    chat = next(r for r in sample.rows if r.messages)
    assert chat.as_text() == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert "<|im_start|>" not in chat.as_text(pass_no=2) and "[pass 2]" in chat.as_text(pass_no=2)
    assert next(r for r in sample.rows if r.prompt).as_text() == "plain text"
    # no template (a bundled profile name, a directory without one): Qwen's ChatML, the simulator's default
    plain = PromptSample.load(path, 10).for_model("qwen3.6-27b")
    assert next(r for r in plain.rows if r.messages).as_text().startswith("<|im_start|>user\n")


def test_template_sources_named_templates_and_a_standalone_file(tmp_path):
    named = _model_dir(
        tmp_path,
        {
            "chat_template": [
                {"name": "tool_use", "template": "T"},
                {"name": "default", "template": "D{{ messages | length }}"},
            ],
            "eos_token": {"content": "</s>"},
        },
    )
    found = ChatTemplate.find(named)
    assert found is not None and found.render([{"role": "user", "content": "a"}]) == "D1" and found.eos_token == "</s>"
    (named / "chat_template.jinja").write_text("J{{ messages[0]['content'] | tojson }}")
    assert ChatTemplate.find(named).render([{"role": "user", "content": "é"}]) == 'J"é"'
    assert ChatTemplate.find(tmp_path / "nowhere") is None


def test_a_broken_or_refusing_template_is_one_error_naming_its_file(tmp_path):
    with pytest.raises(WorkloadError) as err:
        ChatTemplate("{% for m in messages %}", tmp_path / "tokenizer_config.json")
    assert "tokenizer_config.json" in str(err.value) and "does not compile" in str(err.value)
    strict = ChatTemplate(
        "{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}", tmp_path / "t.jinja"
    )
    with pytest.raises(WorkloadError) as err:
        strict.render([{"role": "user", "content": "a"}])
    assert "system first" in str(err.value)


def test_batch_lines_go_to_the_endpoints_they_name_with_their_temperature(tmp_path, sse_server):  # noqa: F811
    fake, url = sse_server
    path = _write_jsonl(tmp_path / "batch.jsonl", [_batch_line(i) for i in range(6)])
    sample = PromptSample.load(path, 6)
    records = asyncio.run(
        replay(
            url, sample, concurrency=3, max_tokens=12, warmup_s=0.0, measure_s=0.6, endpoint="generate", ignore_eos=True
        )
    )
    assert records.requests and not any(r.error for r in records.requests if r.finish_reason)
    chat = [b for b in fake.requests if "messages" in b]
    completions = [b for b in fake.requests if "prompt" in b]
    assert chat and completions and not [b for b in fake.requests if "text" in b]  # nothing to /generate
    assert {b["temperature"] for b in chat} == {0.7} and {b["temperature"] for b in completions} == {0}
    assert all(b["max_tokens"] == 12 for b in fake.requests)  # the study's cap still bounds the job's budget
