"""The job's prompts: its input file read as rows (``formats``: autotune's JSONL, OpenAI Batch API, ShareGPT),
the seeded sample every trial replays (``sample``), how a row is sent (``rows``: pass markers, the model's chat
template from ``template``).

Read by the config check (a bad file is one error before any launch), the harness's replay client and the
simulator engine's prediction; it depends on nothing of autotune but ``errors``.
"""

from autotune.prompts.formats import ReadRows, read_file, read_rows
from autotune.prompts.rows import (
    CHARS_PER_TOKEN,
    ENDPOINTS,
    REPEATS,
    UNKNOWN_CONTEXT_TOKENS,
    ChatMessage,
    PromptRow,
    check_repeats,
    estimate_tokens,
    on_pass,
    pass_marker,
    walk_position,
)
from autotune.prompts.sample import PromptSample
from autotune.prompts.template import ChatTemplate

__all__ = [
    "CHARS_PER_TOKEN",
    "ENDPOINTS",
    "REPEATS",
    "UNKNOWN_CONTEXT_TOKENS",
    "ChatMessage",
    "ChatTemplate",
    "PromptRow",
    "PromptSample",
    "ReadRows",
    "check_repeats",
    "estimate_tokens",
    "on_pass",
    "pass_marker",
    "read_file",
    "read_rows",
    "walk_position",
]
