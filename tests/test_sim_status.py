"""The sim server's status object: it builds the scheduler ``evaluate`` builds and reports what the plan decided."""

from __future__ import annotations

import math
import os

import numpy as np
import pytest

from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_gpu, load_model
from autotune.sim import args as sim_args
from autotune.sim.limits import largest_graph_bs
from autotune.sim.scheduler import Scheduler
from autotune.sim.status import ServerStatus

pytestmark = pytest.mark.timeout(60)
MODEL, GPU = "qwen3.6-27b", "b200"


@pytest.fixture(autouse=True)
def _isolated_devices(tmp_path, monkeypatch):
    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


def _status(*flags: str) -> ServerStatus:
    return ServerStatus.create(sim_args.parse(["--model-path", MODEL, "--sim-gpu", GPU, *flags]), pid=os.getpid())


@pytest.mark.parametrize("flags", [(), ("--speculative-algorithm", "NEXTN")], ids=["plain", "mtp"])
def test_paced_server_and_evaluate_share_one_scheduler_model(flags):
    st = _status(*flags)
    model, gpu = load_model(MODEL), load_gpu(GPU)
    ref = Scheduler.from_plan(plan(model, gpu, st.args.flags, free_gib=st.free_gib), model, gpu)
    assert st.scheduler.limits == ref.limits
    assert st.scheduler.perf.params == ref.perf.params
    # Without speculative decoding the whole KV cell is the target's: no share of it may go to a draft model.
    if not flags:
        assert st.scheduler.perf.params.kv_cell_bytes == pytest.approx(st.plan.extra["kv_cell_bytes"])


def test_server_info_lists_the_captured_decode_batches_up_to_the_plans_largest():
    st = _status("--speculative-algorithm", "NEXTN")
    internal = st.server_info(ready=True)["internal_states"][0]
    largest = max(st.plan.extra["decode_graph_bs"])
    assert internal["decode_cuda_graph_bs"][-1] == largest == st.scheduler.limits.decode_graph_bs
    assert internal["effective_max_running_requests_per_dp"] == st.plan.max_running_requests


@pytest.mark.parametrize(("value", "largest"), [([1, 2, 48, 16], 48), ((), 0), (None, 0), (56, 56), ([], 0)])
def test_largest_graph_bs_takes_a_list_or_a_number(value, largest):
    assert largest_graph_bs(value) == largest


def test_each_start_draws_its_own_launch_speed_only_when_asked():
    """``--sim-launch-cv``: a relaunch's own speed, drawn per start (not by the seed); every start alike without it."""
    plain = [_status().scheduler.perf.params.eta_bw for _ in range(3)]
    assert len(set(plain)) == 1
    starts = [_status("--sim-launch-cv", "0.05").scheduler.perf.params for _ in range(40)]
    spread = np.std([math.log(p.eta_bw / plain[0]) for p in starts])
    assert 0.025 < spread < 0.08  # exp(0.05 z): a log-spread of about 5 %
    assert all(p.eta_compute / p.eta_bw == pytest.approx(starts[0].eta_compute / starts[0].eta_bw) for p in starts)
