"""What the simulator knows about a request: its token counts, natural output length and draft acceptance.

Everything random about a request is drawn from an RNG seeded by a hash of (seed, prompt text), never by
Python's salted ``hash()``, so a fixed prompt sample replays identically in every process and on every run.
"""

from __future__ import annotations

import hashlib
import math
import random
from dataclasses import dataclass

from autotune.errors import ConfigError
from autotune.sim.radix import token_key

OUTPUT_DISTS: tuple[str, ...] = ("lognormal", "fixed", "uniform")
LOGNORMAL_SIGMA = 0.6  # spread of natural answer lengths: most near the mean, a long tail of long answers
ACCEPT_CONCENTRATION = 40.0  # Beta(a, b) with a + b = this: per-prompt α within about ±0.06 of the mean
ALPHA_MIN, ALPHA_MAX = 0.01, 0.99  # keeps log(α) finite for the per-cycle acceptance draw
CHARS_PER_TOKEN = 4


def count_tokens(text: str) -> int:
    """A deterministic stand-in for a tokenizer: about four characters per token, at least one."""
    return max(1, (len(text) + CHARS_PER_TOKEN - 1) // CHARS_PER_TOKEN)


@dataclass(slots=True)
class SimRequest:
    """One request as the scheduler sees it. ``target_len`` is how many tokens it will actually produce."""

    rid: str
    prompt_tokens: int
    max_new_tokens: int
    ignore_eos: bool
    natural_len: int  # where the model would stop on its own (EOS)
    alpha: float  # per-token draft acceptance probability for this prompt
    key: str = ""  # the prompt as whole simulated tokens: what the radix cache matches (``radix.token_key``)

    @property
    def target_len(self) -> int:
        if self.ignore_eos:
            return self.max_new_tokens
        return min(self.natural_len, self.max_new_tokens)

    @property
    def finish_reason(self) -> str:
        """``length`` when max_new_tokens cuts the answer, ``stop`` when the model ends it (EOS)."""
        return "length" if self.target_len >= self.max_new_tokens else "stop"


def request_rng(text: str, seed: int) -> random.Random:
    """An RNG that depends only on the prompt text and the seed (stable across processes)."""
    digest = hashlib.blake2b(f"{seed}\x00{text}".encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def stable_hash(*parts: object) -> int:
    """A 64-bit hash of ``parts`` that is the same in every process (unlike the salted built-in ``hash``)."""
    text = "\x00".join(map(str, parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8, person=b"autotune-sim").digest(), "little")


GREEDY_TEMPERATURE = 1e-6  # SGLang samples greedily (top_k = 1) below this temperature


def is_greedy(temperature: object = None, top_k: object = None) -> bool:
    """Whether SGLang decodes greedily; an unset temperature is SGLang's default 1.0 (sampled).

    Raises ``ValueError`` for a temperature that is not a non-negative number, as SGLang rejects it.
    """
    if temperature is None:
        temperature = 1.0
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)) or temperature < 0:
        raise ValueError(f"temperature must be a non-negative number, got {temperature!r}")
    return temperature < GREEDY_TEMPERATURE or top_k == 1


def _natural_len(rng: random.Random, output_mean: float, output_dist: str) -> int:
    if output_dist == "fixed":
        return max(1, round(output_mean))
    if output_dist == "uniform":
        return rng.randint(1, max(1, round(2 * output_mean) - 1))
    mu = math.log(output_mean) - LOGNORMAL_SIGMA**2 / 2  # so that the mean is output_mean
    return max(1, round(rng.lognormvariate(mu, LOGNORMAL_SIGMA)))


def _alpha(rng: random.Random, acceptance_mean: float) -> float:
    a = acceptance_mean * ACCEPT_CONCENTRATION
    b = (1.0 - acceptance_mean) * ACCEPT_CONCENTRATION
    return min(ALPHA_MAX, max(ALPHA_MIN, rng.betavariate(a, b)))


def check_request_params(*, acceptance_mean: float, output_mean: float, output_dist: str) -> None:
    """Raise ``ConfigError`` for parameters no request could be drawn from."""
    if output_dist not in OUTPUT_DISTS:
        raise ConfigError(
            f"unknown output distribution {output_dist!r}",
            key="output_dist",
            fix=f"use one of {', '.join(OUTPUT_DISTS)}",
        )
    if not 0.0 < acceptance_mean < 1.0:
        raise ConfigError(
            f"acceptance must be strictly between 0 and 1, got {acceptance_mean}",
            key="acceptance",
            fix="use the per-token draft acceptance rate, e.g. 0.825",
        )
    if not output_mean >= 1:
        raise ConfigError(f"output_mean must be at least 1 token, got {output_mean}", key="output_mean")


def make_request(
    rid: str,
    text: str,
    max_new_tokens: int,
    *,
    ignore_eos: bool = False,
    seed: int = 0,
    acceptance_mean: float = 0.825,
    output_mean: float = 2500,
    output_dist: str = "lognormal",
    prompt_tokens: int | None = None,
) -> SimRequest:
    """Build a request whose natural length and α follow from (text, seed); ``prompt_tokens`` overrides the count."""
    check_request_params(acceptance_mean=acceptance_mean, output_mean=output_mean, output_dist=output_dist)
    rng = request_rng(text, seed)
    # Draw α first and the length second so that changing only the length distribution keeps every α.
    alpha = _alpha(rng, acceptance_mean)
    natural = _natural_len(rng, output_mean, output_dist)
    return SimRequest(
        rid=rid,
        prompt_tokens=count_tokens(text) if prompt_tokens is None else max(1, int(prompt_tokens)),
        max_new_tokens=max(1, int(max_new_tokens)),
        ignore_eos=ignore_eos,
        natural_len=natural,
        alpha=alpha,
        key=token_key(text),
    )
