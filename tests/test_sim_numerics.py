"""The simulator's numerics model: deterministic greedy tokens, seeded divergence per output-changing flag, and
logprobs through SGLang's native ``/generate`` (``meta_info.output_token_logprobs`` triples)."""

from __future__ import annotations

import json
import os
import re
import signal
import statistics
import subprocess
import sys
import time

import httpx
import pytest

from autotune.sim import device
from autotune.sim.args import parse
from autotune.sim.divergence import DIVERGENCE, SimNumerics, divergence_for
from autotune.sim.requests import is_greedy, stable_hash
from autotune.sim.tokens import TokenPlan

MODEL = "qwen3.6-27b"
PROMPTS = [f"Summarise chapter {i} of the operations manual in plain words." for i in range(400)]


def numerics(*argv: str, hybrid: bool = True) -> SimNumerics:
    return SimNumerics.for_server(parse(["--model-path", MODEL, *argv]).server_args, hybrid=hybrid)


def plan(n: SimNumerics, text: str, seed: int = 0) -> TokenPlan:
    return n.plan(text, seed, base=stable_hash("tokens", seed, text))


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


# -- the model, in-process ---------------------------------------------------------------------------------------
def test_reference_flags_never_diverge_and_tokens_follow_the_prompt():
    ref = numerics("--mamba-ssm-dtype", "float32", "--kv-cache-dtype", "auto")
    assert ref.changes == () and numerics().changes == ()
    a, b = plan(ref, PROMPTS[0]), plan(numerics(), PROMPTS[0])
    assert a == b and a.diverges_at is None and a.shift == 0.0
    assert plan(ref, PROMPTS[1]).ids(0, 50) != a.ids(0, 50)  # another prompt, other tokens
    assert plan(ref, PROMPTS[0], seed=1).ids(0, 50) != a.ids(0, 50)  # another sim seed, other tokens


def test_bfloat16_ssm_state_diverges_at_a_seeded_position_and_stays_different():
    ref, bf16 = numerics(), numerics("--mamba-ssm-dtype", "bfloat16")
    for text in PROMPTS[:20]:
        p = plan(bf16, text)
        assert p == plan(numerics("--mamba-ssm-dtype", "bfloat16"), text)  # a rerun: the same position
        at = p.diverges_at
        reference, diverged = plan(ref, text).ids(0, at + 200), p.ids(0, at + 200)
        assert diverged[:at] == reference[:at]
        assert all(
            x != y for x, y in zip(diverged[at:], reference[at:], strict=True)
        )  # the continuation differs throughout
        text_ref, text_div = plan(ref, text).span(0, at + 5)[0], p.span(0, at + 5)[0]
        assert text_div.split()[:at] == text_ref.split()[:at] and text_div != text_ref


def test_divergence_distributions_are_plausible_per_flag():
    def median_at(*argv: str) -> float:
        n = numerics(*argv)
        return statistics.median(plan(n, text).diverges_at for text in PROMPTS)

    bf16 = median_at("--mamba-ssm-dtype", "bfloat16")
    fp16 = median_at("--mamba-ssm-dtype", "float16")
    fp8 = median_at("--kv-cache-dtype", "fp8_e4m3")
    fp4 = median_at("--kv-cache-dtype", "nvfp4")
    assert 30 <= bf16 <= 300  # tens to a few hundred tokens
    assert fp4 < fp8 < bf16 < fp16  # fewer mantissa bits: earlier
    spread = [plan(numerics("--mamba-ssm-dtype", "bfloat16"), t).diverges_at for t in PROMPTS]
    assert min(spread) < bf16 / 3 and max(spread) > bf16 * 3  # a distribution, not one fixed position
    # --dtype bfloat16 and --kv-cache-dtype bf16 are what a bfloat16 checkpoint already does
    assert numerics("--dtype", "bfloat16", "--kv-cache-dtype", "bf16").changes == ()


def test_two_configs_diverge_where_a_flag_they_do_not_share_does():
    base = numerics("--mamba-ssm-dtype", "bfloat16")
    both = numerics("--mamba-ssm-dtype", "bfloat16", "--kv-cache-dtype", "fp8_e4m3")
    kv_only = numerics("--kv-cache-dtype", "fp8_e4m3")
    for text in PROMPTS[:40]:
        kv_at = plan(kv_only, text).diverges_at
        a, b = plan(base, text).ids(0, kv_at + 400), plan(both, text).ids(0, kv_at + 400)
        assert first_difference(a, b) == kv_at


def test_logprobs_shift_by_the_flags_amounts():
    ref, bf16 = numerics(), numerics("--mamba-ssm-dtype", "bfloat16")
    both = numerics("--mamba-ssm-dtype", "bfloat16", "--kv-cache-dtype", "fp8_e5m2")
    ssm, kv = divergence_for("mamba_ssm_dtype", "bfloat16"), divergence_for("kv_cache_dtype", "fp8_e5m2")
    assert ssm is DIVERGENCE["mamba_ssm_dtype"]["bfloat16"] and ssm.logprob_shift > 0
    text = PROMPTS[3]
    at = plan(both, text).diverges_at
    lp_ref = plan(ref, text).logprobs(0, at)
    assert all(x <= 0 for x in lp_ref) and len(set(lp_ref)) > 1
    for n, shift in ((bf16, ssm.logprob_shift), (both, ssm.logprob_shift + kv.logprob_shift)):
        assert [r - x for r, x in zip(lp_ref, plan(n, text).logprobs(0, at), strict=True)] == pytest.approx(
            [shift] * at
        )


def test_mamba_flags_are_inert_on_a_dense_model():
    assert numerics("--mamba-ssm-dtype", "bfloat16", hybrid=False).changes == ()
    assert [k for k, _ in numerics("--kv-cache-dtype", "fp8_e4m3", hybrid=False).changes] == ["kv_cache_dtype=fp8_e4m3"]


def test_greedy_is_temperature_zero_or_top_k_one():
    assert is_greedy(0) and is_greedy(0.0) and is_greedy(0.7, 1)
    assert not is_greedy(None) and not is_greedy(0.7) and not is_greedy(1.0, -1)
    for bad in (-0.5, "cold", True):
        with pytest.raises(ValueError, match="temperature must be a non-negative number"):
            is_greedy(bad)


# -- through the simulated server ----------------------------------------------------------------------------------
class Server:
    """One ``python -m autotune.sim`` on a free loopback port."""

    def __init__(self, argv: list[str], env: dict[str, str]):
        self.argv = [
            "--model-path",
            MODEL,
            "--host",
            "127.0.0.1",
            "--port",
            "0",
            "--sim-startup-s",
            "0.1",
            "--sim-warmup-s",
            "0.1",
            *argv,
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "autotune.sim", *self.argv],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,
        )
        self.url = ""

    def wait_ready(self, timeout: float = 30.0) -> Server:
        deadline = time.monotonic() + timeout
        for line in self.proc.stdout:
            if m := re.search(r"Uvicorn running on (http://127\.0\.0\.1:\d+)", line):
                self.url = m[1]
                break
            assert time.monotonic() < deadline, "no port line"
        assert self.url, f"exited {self.proc.wait()} before opening its port"
        while time.monotonic() < deadline:
            if httpx.get(f"{self.url}/health", timeout=5).status_code == 200:
                return self
            time.sleep(0.05)
        raise AssertionError("never healthy")

    def generate(self, text: str, n: int, **extra) -> dict:
        body = {
            "text": text,
            "sampling_params": {"max_new_tokens": n, "ignore_eos": True, "temperature": 0},
            "return_logprob": True,
            **extra,
        }
        r = httpx.post(f"{self.url}/generate", json=body, timeout=60)
        assert r.status_code == 200, r.text
        return r.json()

    def stop(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)


@pytest.fixture
def servers(tmp_path):
    env = {**os.environ, device.ENV_DIR: str(tmp_path / "devices"), "PYTHONUNBUFFERED": "1"}
    started: list[Server] = []

    def start(*argv: str) -> Server:
        # each on a simulated GPU of its own: two servers sizing their pools from one GPU's free memory at once
        # would each see the other's (the later one ran out of memory when the host was slow)
        started.append(Server(list(argv), {**env, "CUDA_VISIBLE_DEVICES": str(len(started))}))
        return started[-1]

    yield start
    for s in started:
        s.stop()


@pytest.mark.slow
@pytest.mark.timeout(120)
def test_generate_returns_seeded_tokens_and_shifted_logprobs(servers):
    fp32 = servers("--mamba-ssm-dtype", "float32", "--sim-gpu-memory-mib", "100000")
    bf16 = servers("--mamba-ssm-dtype", "bfloat16", "--sim-gpu-memory-mib", "100000", "--sim-seed", "0")
    fp32.wait_ready(), bf16.wait_ready()
    model = numerics("--mamba-ssm-dtype", "bfloat16")
    text = next(t for t in PROMPTS if 5 <= plan(model, t).diverges_at <= 60)  # a divergence inside 80 tokens
    at = plan(model, text).diverges_at

    a1, a2 = fp32.generate(text, 80), fp32.generate(text, 80)
    assert a1["output_ids"] == a2["output_ids"] and a1["text"] == a2["text"]  # greedy: identical run to run
    triples = a1["meta_info"]["output_token_logprobs"]
    assert len(triples) == 80 and [t[1] for t in triples] == a1["output_ids"]
    assert all(isinstance(t[0], float) and t[0] <= 0 and t[2] is None for t in triples)
    assert a1["meta_info"]["input_token_logprobs"] == []

    b1, b2 = bf16.generate(text, 80), bf16.generate(text, 80, return_text_in_logprobs=True)
    assert first_difference(a1["output_ids"], b1["output_ids"]) == at  # at the seeded position ...
    assert b1["output_ids"] == b2["output_ids"]  # ... and the same on a rerun
    shift = divergence_for("mamba_ssm_dtype", "bfloat16").logprob_shift
    lp_a = [t[0] for t in triples[:at]]
    lp_b = [t[0] for t in b1["meta_info"]["output_token_logprobs"][:at]]
    assert [x - y for x, y in zip(lp_a, lp_b, strict=True)] == pytest.approx([shift] * at)
    assert "".join(t[2] for t in b2["meta_info"]["output_token_logprobs"]) == b2["text"]  # return_text_in_logprobs

    # The same tokens whatever the endpoint: OpenAI completions and a streamed /generate.
    r = httpx.post(
        f"{bf16.url}/v1/completions",
        timeout=60,
        json={"model": "default", "prompt": text, "max_tokens": 80, "ignore_eos": True, "temperature": 0},
    )
    assert r.json()["choices"][0]["text"] == b1["text"]
    with httpx.stream(
        "POST",
        f"{bf16.url}/generate",
        timeout=60,
        json={
            "text": text,
            "sampling_params": {"max_new_tokens": 80, "ignore_eos": True, "temperature": 0},
            "return_logprob": True,
            "stream": True,
        },
    ) as s:
        events = [json.loads(x[6:]) for x in s.iter_lines() if x.startswith("data: {")]
    assert len(events) > 1 and events[-1]["output_ids"] == b1["output_ids"]
    assert all(len(e["meta_info"]["output_token_logprobs"]) == e["meta_info"]["completion_tokens"] for e in events)
    assert events[-1]["meta_info"]["output_token_logprobs"] == b1["meta_info"]["output_token_logprobs"]

    # Sampled requests keep working (their tokens are not the prompt's greedy ones); a bad temperature is refused.
    sampled = [
        fp32.generate(text, 20, sampling_params={"max_new_tokens": 20, "ignore_eos": True, "temperature": 0.8})
        for _ in range(2)
    ]
    assert all(s["meta_info"]["completion_tokens"] == 20 for s in sampled)
    assert sampled[0]["output_ids"] != sampled[1]["output_ids"]
    bad = httpx.post(f"{fp32.url}/generate", timeout=10, json={"text": text, "sampling_params": {"temperature": -1}})
    assert bad.status_code == 400 and "temperature must be a non-negative number" in bad.json()["message"]
