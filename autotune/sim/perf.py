"""How long one scheduler step takes on the modelled GPU: a roofline per decode cycle and per prefill chunk.

A decode cycle streams the weights once and every running request's state (Mamba slots and KV context), so it
is bandwidth-bound at small batches and compute-bound only at large ones. Under speculative decoding a cycle
runs ``D-1`` draft passes and one verify pass over ``D`` tokens per request. Efficiencies (η) and the fixed
per-cycle overhead were fitted to the seed deployment; the ideal roofline (η = 1, no overhead) is a hard
floor that no step, noise included, ever goes below.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

ETA_BW = 0.46  # achieved share of HBM bandwidth, fitted on the seed point (R=16, MTP D=4, b200)
ETA_COMPUTE = 0.6  # achieved share of dense bf16 peak (assumption)
OVERHEAD_SPEC_S = 2.5e-3  # launch + sampling + draft bookkeeping per speculative cycle (fitted)
OVERHEAD_S = 1.0e-3  # per plain decode cycle or prefill step (assumption)
EAGER_EXTRA_S = 4.0e-3  # a decode batch larger than the captured CUDA graphs launches every kernel from Python
JITTER_SHARE = 0.25  # per-step jitter is this share of the run-to-run noise
_JITTER_BLOCK = 4096  # draws per RNG call, so the hot loop never calls the RNG for a scalar


@dataclass(frozen=True, kw_only=True)
class PerfParams:
    """The numbers the roofline needs, in bytes, FLOPs and seconds."""

    weight_bytes: float  # target weights streamed per forward pass
    draft_weight_bytes: float = 0.0  # per draft (MTP) pass
    flops_per_token: float  # target forward FLOPs per token
    draft_flops_per_token: float = 0.0
    mamba_slot_bytes: float = 0.0  # P: one request's recurrent state (0 for pure attention models)
    kv_cell_bytes: float  # target KV bytes per token of context
    draft_cell_bytes: float = 0.0  # draft KV bytes per token of context
    bandwidth: float  # HBM bytes/s
    peak_flops: float  # dense bf16 FLOP/s
    eta_bw: float = ETA_BW
    eta_compute: float = ETA_COMPUTE
    overhead_s: float = OVERHEAD_S
    overhead_spec_s: float = OVERHEAD_SPEC_S
    eager_extra_s: float = EAGER_EXTRA_S

    @classmethod
    def from_profiles(
        cls,
        model: Any,
        gpu: Any,
        *,
        kv_cell_bytes: float | None = None,
        mamba_slot_bytes: float | None = None,
        with_draft: bool = True,
        tp: int = 1,
    ) -> PerfParams:
        """From a ``ModelProfile`` and ``GpuProfile``. The plan's KV cell (target, plus the draft's when
        ``with_draft``) and slot size win when given: ``--kv-cache-dtype`` and ``--mamba-ssm-dtype`` change them."""
        target_cell = float(model.kv_cell_bytes(tp))
        draft_cell = float(model.kv_cell_bytes(tp, with_draft=True)) - target_cell
        if kv_cell_bytes is not None and target_cell > 0:
            scale = float(kv_cell_bytes) / (target_cell + (draft_cell if with_draft else 0.0))
            target_cell, draft_cell = target_cell * scale, draft_cell * scale
        slot = float(mamba_slot_bytes) if mamba_slot_bytes is not None else float(model.mamba_slot_bytes(tp))
        return cls(
            weight_bytes=float(model.streamed_weight_bytes) / tp,
            draft_weight_bytes=float(model.streamed_draft_bytes) / tp,
            flops_per_token=float(model.flops_per_token) / tp,
            draft_flops_per_token=float(model.draft_flops_per_token) / tp,
            mamba_slot_bytes=slot,
            kv_cell_bytes=target_cell,
            draft_cell_bytes=draft_cell,
            bandwidth=float(gpu.bandwidth),
            peak_flops=float(gpu.peak_flops),
        )


def expected_accept_length(alpha: float, draft_tokens: int) -> float:
    """E[τ] = (1 − α^D)/(1 − α): accepted drafts plus the bonus token of one verify pass."""
    if draft_tokens <= 1:
        return 1.0
    return (1.0 - alpha**draft_tokens) / (1.0 - alpha)


class PerfModel:
    """Step durations for one server run. ``noise`` > 0 adds a per-run factor and a small per-step jitter."""

    def __init__(self, params: PerfParams, *, spec: bool, draft_tokens: int = 1, noise: float = 0.0, seed: int = 0):
        self.params = params
        self.spec = bool(spec) and draft_tokens > 1
        self.draft_tokens = draft_tokens if self.spec else 1
        self.draft_passes = self.draft_tokens - 1 if self.spec else 0
        p = params
        bw = p.eta_bw * p.bandwidth
        # Decode cycle = const + per_req·B + per_ctx·Σcontext bytes, and flops_per_req·B FLOPs.
        self._coefs: dict[int, tuple[float, float, float, float, float]] = {}
        (self._bytes_const, self._bytes_per_req, self._bytes_per_ctx, self._flops_per_req, self._overhead) = (
            self._cycle(self.draft_tokens)
        )
        self._inv_bw = 1.0 / bw
        self._inv_flops = 1.0 / (p.eta_compute * p.peak_flops)
        self._inv_bw_ideal = 1.0 / p.bandwidth
        self._inv_flops_ideal = 1.0 / p.peak_flops
        self.noise = max(0.0, float(noise))
        self._rng = np.random.default_rng([seed, 0x5EED])
        self.run_factor = math.exp(self.noise * float(self._rng.standard_normal())) if self.noise else 1.0
        self._jitter = np.empty(0)
        self._jitter_pos = 0

    # -- decode -------------------------------------------------------------------------------------------
    def _cycle(self, d: int) -> tuple[float, float, float, float, float]:
        """(bytes per cycle, per request, per context token, FLOPs per request, overhead) of a cycle verifying
        ``d`` tokens per request after ``d − 1`` draft passes (a plain decode without speculative decoding).
        ``--speculative-adaptive`` moves ``d`` per batch size; its ``d = 1`` is a verify of one token."""
        if d in self._coefs:
            return self._coefs[d]
        p = self.params
        if self.spec:
            n_d = d - 1
            coefs = (
                p.weight_bytes + n_d * p.draft_weight_bytes,
                (3 + d) * p.mamba_slot_bytes + d * p.kv_cell_bytes,
                p.kv_cell_bytes + n_d * p.draft_cell_bytes,
                d * p.flops_per_token + n_d * p.draft_flops_per_token,
                p.overhead_spec_s,
            )
        else:
            coefs = (p.weight_bytes, 2 * p.mamba_slot_bytes, p.kv_cell_bytes, p.flops_per_token, p.overhead_s)
        self._coefs[d] = coefs
        return coefs

    def decode_bytes_flops(self, batch: int, context_tokens: float, d: int | None = None) -> tuple[float, float]:
        """Bytes moved and FLOPs of one decode (or verify) cycle for ``batch`` requests (``d``: its tokens per
        request when not the configured D)."""
        const, per_req, per_ctx, flops, _ = self._cycle(d) if d else self._cycle(self.draft_tokens)
        return const + batch * per_req + context_tokens * per_ctx, batch * flops

    def decode_roofline_s(self, batch: int, context_tokens: float, d: int | None = None) -> float:
        """The ideal time (η = 1, no overhead): no real GPU is faster."""
        nbytes, flops = self.decode_bytes_flops(batch, context_tokens, d)
        return max(nbytes * self._inv_bw_ideal, flops * self._inv_flops_ideal)

    def decode_s(self, batch: int, context_tokens: float, *, graph: bool = True, d: int | None = None) -> float:
        """Modelled time of one decode cycle; ``context_tokens`` is Σ over the batch of tokens held in KV."""
        nbytes, flops = self.decode_bytes_flops(batch, context_tokens, d)
        t = self._cycle(d or self.draft_tokens)[4] + max(nbytes * self._inv_bw, flops * self._inv_flops)
        if not graph:
            t += self.params.eager_extra_s
        if self.noise:
            t = max(t * self._factor(), self.decode_roofline_s(batch, context_tokens, d))
        return t

    def decode_s_many(
        self, batch: int, contexts: np.ndarray, *, graph: bool = True, d: int | None = None
    ) -> np.ndarray:
        """``decode_s`` for consecutive cycles of one batch, bit for bit (same arithmetic, same noise draws)."""
        const, per_req, per_ctx, flops_req, overhead = self._cycle(d or self.draft_tokens)
        nbytes = (const + batch * per_req) + contexts * per_ctx
        flops = batch * flops_req
        t = np.maximum(nbytes * self._inv_bw, flops * self._inv_flops) + overhead
        if not graph:
            t += self.params.eager_extra_s
        if self.noise:
            t = np.maximum(
                t * self._factors(len(t)), np.maximum(nbytes * self._inv_bw_ideal, flops * self._inv_flops_ideal)
            )
        return t

    # -- prefill ------------------------------------------------------------------------------------------
    def prefill_bytes_flops(self, new_tokens: int, num_seqs: int) -> tuple[float, float]:
        p = self.params
        nbytes = p.weight_bytes + new_tokens * p.kv_cell_bytes + num_seqs * p.mamba_slot_bytes
        flops = new_tokens * p.flops_per_token
        if self.spec:  # the draft model extends over the same tokens to seed its own KV
            nbytes += p.draft_weight_bytes + new_tokens * p.draft_cell_bytes
            flops += new_tokens * p.draft_flops_per_token
        return nbytes, flops

    def prefill_roofline_s(self, new_tokens: int, num_seqs: int) -> float:
        nbytes, flops = self.prefill_bytes_flops(new_tokens, num_seqs)
        return max(nbytes * self._inv_bw_ideal, flops * self._inv_flops_ideal)

    def prefill_s(self, new_tokens: int, num_seqs: int) -> float:
        """Modelled time of one prefill step (one chunk of at most chunked_prefill_size new tokens)."""
        nbytes, flops = self.prefill_bytes_flops(new_tokens, num_seqs)
        t = self.params.overhead_s + max(nbytes * self._inv_bw, flops * self._inv_flops)
        if self.noise:
            t = max(t * self._factor(), self.prefill_roofline_s(new_tokens, num_seqs))
        return t

    def state_copy_s(self, copies: int) -> float:
        """Saving ``copies`` Mamba states into the radix cache: each reads and writes one slot (P bytes)."""
        return 2.0 * copies * self.params.mamba_slot_bytes * self._inv_bw

    def _factors(self, count: int) -> np.ndarray:
        """The next ``count`` factors, exactly the values ``count`` calls of ``_factor`` would return."""
        parts = []
        while count:
            if self._jitter_pos >= len(self._jitter):
                self._factor()
                self._jitter_pos -= 1  # refilled: hand the first value out below
            take = min(count, len(self._jitter) - self._jitter_pos)
            parts.append(self._jitter[self._jitter_pos : self._jitter_pos + take])
            self._jitter_pos += take
            count -= take
        return np.concatenate(parts) if parts else np.empty(0)

    def _factor(self) -> float:
        if self._jitter_pos >= len(self._jitter):
            sigma = self.noise * JITTER_SHARE
            self._jitter = np.exp(sigma * self._rng.standard_normal(_JITTER_BLOCK)) * self.run_factor
            self._jitter_pos = 0
        value = float(self._jitter[self._jitter_pos])
        self._jitter_pos += 1
        return value

    # -- summaries ----------------------------------------------------------------------------------------
    def steady_tok_s(self, batch: int, mean_context: float, accept_length: float = 1.0) -> float:
        """Noise-free decode throughput of a full batch: B·τ per cycle (no prefill interruptions)."""
        return batch * accept_length / self.decode_s_noiseless(batch, batch * mean_context)

    def decode_s_noiseless(self, batch: int, context_tokens: float) -> float:
        nbytes, flops = self.decode_bytes_flops(batch, context_tokens)
        return self._overhead + max(nbytes * self._inv_bw, flops * self._inv_flops)
