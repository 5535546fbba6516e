"""A tiny end-to-end study on the simulated engine (0.2 s startup, sub-second warm-up), for CLI and worker tests."""

from __future__ import annotations

import json
from pathlib import Path

TEMPLATE = """
[study]
name = "{name}"
trials = {trials}
seed = 0
confirm_top_k = {top_k}
confirm_repeats = 1
confirm_windows = 1  # one window a confirmation launch: the tests read the flow, not the noise

[engine]
kind = "sim"
model = "{model}"
sim_gpu = "{sim_gpu}"
sim_options = {{ startup_s = 0.2, warmup_s = 0.1, release_s = 0.2 }}

[engine.fixed]
speculative_algorithm = "EAGLE"
speculative_eagle_topk = 1
speculative_num_steps = 3
speculative_num_draft_tokens = 4
# One SSE event per 8 tokens, not per token: the server and the replay client handle an eighth of the events (the
# measured tok/s counts tokens, not events), and a loaded test host seldom makes the client the bottleneck.
stream_interval = 8

[space]
max_mamba_cache_size = {{ type = "int", low = 80, high = 240, step = 80 }}
mem_fraction_static = {{ type = "float", low = 0.86, high = 0.90, step = 0.02 }}

[workload]
prompts = "prompts.jsonl"
sample_size = 16
max_tokens = 128
warmup_s = {warmup_s}
measure_s = {measure_s}
# A sub-second test window is no steady-state estimate: a loose settle rule lets its trials stop at their floors.
target_half_width = 0.5
settle_tolerance = 0.5

[baseline]
flags = {{ max_mamba_cache_size = 80 }}
"""


def write_prompts(tmp_path: Path) -> None:
    """The 16-row ``prompts.jsonl`` the tiny studies read."""
    (tmp_path / "prompts.jsonl").write_text(
        "".join(json.dumps({"prompt": f"Explain topic {i} in detail. " * 4}) + "\n" for i in range(16))
    )


def write_tiny_study(
    tmp_path: Path,
    *,
    name: str,
    trials: int,
    top_k: int = 0,
    measure_s: float = 1.0,
    warmup_s: float = 0.5,
    model: str = "qwen3.6-27b",
    sim_gpu: str = "b200",
) -> Path:
    """Write ``<name>.toml`` and the 16-row prompt file it reads into ``tmp_path``; return the study path."""
    write_prompts(tmp_path)
    path = tmp_path / f"{name}.toml"
    path.write_text(
        TEMPLATE.format(
            name=name, trials=trials, top_k=top_k, measure_s=measure_s, warmup_s=warmup_s, model=model, sim_gpu=sim_gpu
        )
    )
    return path
