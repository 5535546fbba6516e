"""The roofline speed model: calibration arithmetic, the hard roofline floor, and seeded noise."""

from __future__ import annotations

import pytest

from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim.perf import PerfModel, PerfParams, expected_accept_length

pytestmark = pytest.mark.timeout(30)


@pytest.fixture(scope="module")
def params() -> PerfParams:
    return PerfParams.from_profiles(load_model("qwen3.6-27b"), load_gpu("b200"))


def test_profile_numbers_match_calibration(params: PerfParams) -> None:
    assert params.mamba_slot_bytes == 153_944_064
    assert params.kv_cell_bytes == 65_536
    assert params.draft_cell_bytes == 4_096
    assert params.weight_bytes == pytest.approx(51.25e9)
    assert params.bandwidth == pytest.approx(8.0e12)


def test_plan_cell_sizes_win_and_keep_the_draft_share(params: PerfParams) -> None:
    fp8 = PerfParams.from_profiles(
        load_model("qwen3.6-27b"), load_gpu("b200"), kv_cell_bytes=34_816, mamba_slot_bytes=78_446_592
    )
    assert fp8.kv_cell_bytes + fp8.draft_cell_bytes == pytest.approx(34_816)
    assert fp8.kv_cell_bytes / fp8.draft_cell_bytes == pytest.approx(16.0)
    assert fp8.mamba_slot_bytes == 78_446_592


def test_expected_accept_length() -> None:
    assert expected_accept_length(0.825, 4) == pytest.approx(3.067, abs=0.002)
    assert expected_accept_length(0.35, 4) == pytest.approx(1.515, abs=0.002)
    assert expected_accept_length(0.9, 1) == 1.0


def test_c9_seed_point_is_in_band(params: PerfParams) -> None:
    perf = PerfModel(params, spec=True, draft_tokens=4)
    tok_s = perf.steady_tok_s(16, 1500, expected_accept_length(0.825, 4))
    assert 2000 * 0.9 <= tok_s <= 2180 * 1.1


@pytest.mark.parametrize(("batch", "ceiling"), [(16, 4800), (40, 8800)])
def test_c11_never_faster_than_the_ideal_roofline(params: PerfParams, batch: int, ceiling: float) -> None:
    perf = PerfModel(params, spec=True, draft_tokens=4)
    context = batch * 1500
    ideal = batch * 3 / perf.decode_roofline_s(batch, context)
    assert ideal <= ceiling
    assert batch * 3 / perf.decode_s(batch, context) < ideal


@pytest.mark.parametrize(
    ("alpha", "batch", "spec_wins"), [(0.8, 16, True), (0.8, 64, True), (0.35, 64, False), (0.35, 128, False)]
)
def test_c12_c13_speculation_helps_at_high_acceptance_only(
    params: PerfParams, alpha: float, batch: int, spec_wins: bool
) -> None:
    spec = PerfModel(params, spec=True, draft_tokens=4).steady_tok_s(batch, 1500, expected_accept_length(alpha, 4))
    plain = PerfModel(params, spec=False).steady_tok_s(batch, 1500)
    assert (spec > plain) is spec_wins


def test_decode_grows_with_batch_context_and_eager_mode(params: PerfParams) -> None:
    perf = PerfModel(params, spec=True, draft_tokens=4)
    assert perf.decode_s(32, 32 * 1500) > perf.decode_s(16, 16 * 1500)
    assert perf.decode_s(16, 16 * 8000) > perf.decode_s(16, 16 * 1500)
    assert perf.decode_s(16, 16 * 1500, graph=False) > perf.decode_s(16, 16 * 1500)


def test_large_prefill_is_compute_bound(params: PerfParams) -> None:
    perf = PerfModel(params, spec=False)
    t = perf.prefill_s(16384, 8)
    compute = 16384 * params.flops_per_token / (params.eta_compute * params.peak_flops)
    assert t == pytest.approx(compute + params.overhead_s, rel=1e-9)
    assert perf.prefill_s(256, 1) < t


def test_noise_is_seeded_and_never_beats_the_roofline(params: PerfParams) -> None:
    a = PerfModel(params, spec=True, draft_tokens=4, noise=0.5, seed=3)
    b = PerfModel(params, spec=True, draft_tokens=4, noise=0.5, seed=3)
    c = PerfModel(params, spec=True, draft_tokens=4, noise=0.5, seed=4)
    seq_a = [a.decode_s(16, 24_000) for _ in range(5000)]
    assert seq_a == [b.decode_s(16, 24_000) for _ in range(5000)]
    assert seq_a != [c.decode_s(16, 24_000) for _ in range(5000)]
    assert min(seq_a) >= a.decode_roofline_s(16, 24_000)
    assert len(set(seq_a)) > 100  # per-step jitter, not one constant
    quiet = PerfModel(params, spec=True, draft_tokens=4)
    assert quiet.decode_s(16, 24_000) == quiet.decode_s(16, 24_000)
