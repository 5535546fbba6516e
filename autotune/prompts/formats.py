"""Reading a job's input file as prompt rows, whatever shape it was written in (autotune JSONL, an OpenAI Batch API
file, a ShareGPT-style JSON array), detected from its content; a bad line is one ``WorkloadError`` naming the file,
the line and the field. docs/study-file.md ("The job's own input file").
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from autotune.errors import WorkloadError
from autotune.prompts.rows import CHARS_PER_TOKEN, ChatMessage, PromptRow

NAMED_BAD_LINES = 5  # bad lines one error names (the first with its fix, the others by line and message)
BATCH_URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "chatgpt": "assistant",
    "bard": "assistant",
    "bing": "assistant",
    "system": "system",
}


@dataclass(frozen=True)
class ReadRows:
    """The rows of a file, its format (``jsonl``, ``batch``, ``sharegpt``) and how many records were skipped."""

    rows: list[PromptRow]
    format: str
    skipped: int = 0


def _where(path: Path, line_no: int) -> dict[str, str]:
    """``file:line``, as compilers and editors name a line (a terminal can open it there)."""
    return {"file": f"{path}:{line_no}"}


def _decode(path: Path, line_no: int, raw: bytes) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise WorkloadError(
            f"line is not valid UTF-8 (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})",
            **_where(path, line_no),
            fix="re-encode the file as UTF-8 (e.g. iconv -f latin1 -t utf-8) or remove the line",
        ) from None


def _positive_int(value: Any, name: str, where: dict[str, str]) -> int | None:
    if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
        raise WorkloadError(
            f"{name} must be a positive integer, got {value!r}",
            **where,
            fix="remove it or give a whole number of tokens",
        )
    return value


def _messages(value: Any) -> tuple[ChatMessage, ...] | None:
    if isinstance(value, list) and value and all(isinstance(m, dict) and "content" in m for m in value):
        return tuple(value)
    return None


def _native_row(data: dict[str, Any], line_no: int, where: dict[str, str]) -> PromptRow:
    max_tokens = _positive_int(data.get("max_tokens"), "max_tokens", where)
    prompt, messages = data.get("prompt"), _messages(data.get("messages"))
    if prompt is not None and not isinstance(prompt, str):
        raise WorkloadError(
            f'"prompt" must be a string, got a JSON {type(prompt).__name__}', **where, fix='write {"prompt": "..."}'
        )
    if isinstance(prompt, str):
        return PromptRow(line_no, prompt=prompt, max_tokens=max_tokens)
    if messages is not None:
        return PromptRow(line_no, messages=messages, max_tokens=max_tokens)
    raise WorkloadError(
        'row has neither a "prompt" string nor a chat "messages" list of {"role", "content"} objects',
        **where,
        fix='use {"prompt": "..."} or {"messages": [{"role": "user", "content": "..."}]}',
    )


def _batch_row(data: dict[str, Any], line_no: int, where: dict[str, str]) -> PromptRow:
    """One OpenAI Batch API request line."""
    url, method, body = data.get("url"), data.get("method", "POST"), data.get("body")
    if str(method).upper() != "POST":
        raise WorkloadError(f'"method" is {method!r}; the Batch API sends POST', **where, fix='use "method": "POST"')
    endpoint = BATCH_URLS.get(str(url))
    if endpoint is None:
        raise WorkloadError(
            f'"url" is {url!r}: autotune replays {" or ".join(BATCH_URLS)}',
            **where,
            fix="remove the line, or point it at one of those endpoints",
        )
    if not isinstance(body, dict):
        raise WorkloadError('"body" must be a JSON object (the request)', **where, fix='give "body": {...}')
    budget = body.get("max_completion_tokens", body.get("max_tokens"))
    max_tokens = _positive_int(
        budget, "body.max_completion_tokens" if "max_completion_tokens" in body else "body.max_tokens", where
    )
    temperature = body.get("temperature")
    if temperature is not None and (
        isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0
    ):
        raise WorkloadError(
            f"body.temperature must be a number >= 0, got {temperature!r}",
            **where,
            fix="remove it or give a number such as 0.7",
        )
    temp = None if temperature is None else float(temperature)
    if endpoint == "chat":
        messages = _messages(body.get("messages"))
        if messages is None:
            raise WorkloadError(
                'body.messages must be a list of {"role", "content"} objects',
                **where,
                fix='give "messages": [{"role": "user", "content": "..."}]',
            )
        return PromptRow(line_no, messages=messages, max_tokens=max_tokens, temperature=temp, endpoint=endpoint)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        kind = "a list (several prompts in one request)" if isinstance(prompt, list) else repr(prompt)
        raise WorkloadError(f"body.prompt must be one string, got {kind}", **where, fix="write one prompt per line")
    return PromptRow(line_no, prompt=prompt, max_tokens=max_tokens, temperature=temp, endpoint=endpoint)


def _jsonl_row(path: Path, line_no: int, text: str) -> PromptRow:
    where = _where(path, line_no)
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise WorkloadError(
            f"line is not valid JSON ({exc.msg})", **where, fix="each line must be one JSON object"
        ) from None
    if not isinstance(data, dict):
        raise WorkloadError(
            f"line is a JSON {type(data).__name__}, not an object",
            **where,
            fix='use {"prompt": "..."} or {"messages": [...]}',
        )
    return _batch_row(data, line_no, where) if "body" in data else _native_row(data, line_no, where)


def _jsonl(path: Path, data: bytes) -> ReadRows:
    """Split on ``\\n`` bytes (a JSON string may hold U+2028, which ``str.splitlines`` would cut) and decoded line
    by line, so invalid UTF-8 is one error naming its line."""
    rows: list[PromptRow] = []
    bad: list[WorkloadError] = []
    more = 0
    for line_no, raw in enumerate(data.split(b"\n"), start=1):
        if raw.strip():
            try:
                rows.append(_jsonl_row(path, line_no, _decode(path, line_no, raw)))
            except WorkloadError as exc:  # read on: one line then names every bad line, not only the first
                more += len(bad) >= NAMED_BAD_LINES
                bad = bad if len(bad) >= NAMED_BAD_LINES else [*bad, exc]
    if bad:
        raise _bad_lines(bad, more)
    fmt = "batch" if rows and all(r.endpoint is not None for r in rows) else "jsonl"
    return ReadRows(rows, fmt)


def _bad_lines(bad: list[WorkloadError], more: int) -> WorkloadError:
    """The first bad line's error, its note naming the other bad lines (``line 7: …``) and how many more there are."""
    first, rest = bad[0], bad[1:]
    if not rest:
        return first
    named = "; ".join(f"line {(e.file or '').rpartition(':')[2]}: {e.message}" for e in rest)
    tail = f"; and {more} more" if more else ""
    note = f"{len(rest) + more} more bad line{'s' if len(rest) + more > 1 else ''}: {named}{tail}"
    return WorkloadError(first.message, file=first.file, key=first.key, fix=first.fix, note=note)


def _sharegpt_record(path: Path, index: int, record: Any) -> PromptRow | None:
    where = {"file": f"{path}: record {index}"}
    if not isinstance(record, dict):
        raise WorkloadError(
            f"record is a JSON {type(record).__name__}, not an object",
            **where,
            fix='each record must be {"conversations": [...]}',
        )
    turns = record.get("conversations", record.get("messages"))
    if not isinstance(turns, list):
        raise WorkloadError(
            'record has no "conversations" list',
            **where,
            fix='give "conversations": [{"from": "human", "value": "..."}, ...]',
        )
    prompt: list[ChatMessage] = []
    reply: str | None = None
    for turn in turns:
        if not isinstance(turn, dict):
            raise WorkloadError("a turn is not an object", **where, fix='write turns as {"from": ..., "value": ...}')
        role = SHAREGPT_ROLES.get(str(turn.get("from", turn.get("role", ""))).lower())
        text = turn.get("value", turn.get("content"))
        if role is None or not isinstance(text, str):
            raise WorkloadError(
                f"a turn has an unknown speaker {turn.get('from', turn.get('role'))!r} or no text",
                **where,
                fix=f'use "from" one of {sorted(SHAREGPT_ROLES)} with a "value" string',
            )
        if role == "assistant":
            reply = text
            break
        prompt.append({"role": role, "content": text})
    if not any(m["role"] == "user" for m in prompt):
        return None  # nothing a user asked: the benchmarks skip these too
    budget = max(1, -(-len(reply) // CHARS_PER_TOKEN)) if reply else None
    return PromptRow(index, messages=tuple(prompt), max_tokens=budget)


def _sharegpt(path: Path, data: bytes) -> ReadRows:
    try:
        records = json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise WorkloadError(
            f"file starts like a JSON array but does not parse ({exc})",
            file=str(path),
            fix="give a ShareGPT-style JSON array, or one JSON object per line",
        ) from None
    if not isinstance(records, list):
        raise WorkloadError(
            "the JSON file is not an array of records", file=str(path), fix='give [{"conversations": [...]}, ...]'
        )
    rows = [_sharegpt_record(path, i, r) for i, r in enumerate(records)]
    kept = [r for r in rows if r is not None]
    return ReadRows(kept, "sharegpt", skipped=len(rows) - len(kept))


def read_file(path: Path) -> ReadRows:
    """Every row of ``path`` in whichever of the three formats its content is (a leading BOM is skipped)."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise WorkloadError(
            f"cannot read prompts file {path} ({exc.strerror})", fix="point it at a readable JSONL file"
        ) from None
    data = data.removeprefix(b"\xef\xbb\xbf")
    if data.lstrip()[:1] == b"[":
        return _sharegpt(path, data)
    return _jsonl(path, data)


def read_rows(path: Path) -> list[PromptRow]:
    """The rows of ``path`` (``read_file`` without the format)."""
    return read_file(path).rows
