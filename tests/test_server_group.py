"""A server's GPU group: how many GPUs a config spans, which ones a trial hands over, how a group is read."""

from __future__ import annotations

import pytest

from autotune.errors import GpuBusyError
from autotune.harness.engines.base import group_reader, launch_gpus
from autotune.harness.gpu import GpuMonitor, GpuReading
from autotune.harness.setup import TrialSetup, server_group
from autotune.harness.tenancy import check_engine_gpus
from autotune.harness.workload import WorkloadSpec
from autotune.launch.memory import GroupReader
from autotune.results import GpuPeaks, TrialResult
from autotune.sglang.parallel import group_line, server_gpus


@pytest.mark.parametrize(
    ("config", "gpus"),
    [
        ({}, 1),
        ({"tp_size": 2}, 2),
        ({"tp_size": 2, "pp_size": 2}, 4),
        ({"tp_size": 2, "dp_size": 2}, 4),  # two replicas, each a TP group
        ({"tp_size": 4, "dp_size": 4, "enable_dp_attention": True}, 4),  # attention DP inside the TP group
        ({"tp_size": 4, "attn_dp_size": 2, "dp_size": 2}, 4),
        ({"tp_size": 8, "nnodes": 2}, 4),  # per node
        ({"tp_size": None, "pp_size": "2"}, 2),
    ],
)
def test_server_gpus_counts_as_sglang(config, gpus):
    assert server_gpus(config) == gpus


def _setup(**kw) -> TrialSetup:
    return TrialSetup(engine=object(), workload=WorkloadSpec(prompts="p.jsonl"), **kw)  # type: ignore[arg-type]


def test_a_group_is_the_first_gpus_of_the_pool_or_counted_up_from_the_first_gpu():
    assert server_group(_setup(gpus=(4, 5, 6, 7)), {"tp_size": 2}) == (4, 5)
    assert server_group(_setup(gpu_index=2), {"tp_size": 2}) == (2, 3)
    assert server_group(_setup(gpu_index=2), {}) == (2,)
    assert server_group(_setup(gpu_index=None), {"tp_size": 2}) == ()
    # too few GPUs are handed over as they are: the server fails at startup as SGLang would
    assert server_group(_setup(gpus=(0,)), {"tp_size": 2}) == (0,)


def test_cpu_servers_get_no_gpus():
    class Engine:
        def __init__(self, device: str):
            self.device = device

    assert launch_gpus(Engine("cpu"), (0, 1)) == ()
    assert launch_gpus(Engine("cuda"), 3) == (3,)
    assert launch_gpus(Engine("cuda"), (2, 3)) == (2, 3)


class Device:
    def __init__(self, used: float, total: float = 80.0, util: float | None = 50.0, procs=None):
        self.used, self.total, self.util, self.procs, self.closed = used, total, util, procs, False

    def read(self):
        return GpuReading(used_gib=self.used, total_gib=self.total, util_pct=self.util, power_w=300.0)

    def processes(self):
        return list(self.procs or [])

    def close(self):
        self.closed = True


def test_a_group_reads_as_its_fullest_gpu_and_lists_every_one():
    a, b = Device(30.0), Device(70.0, util=100.0)
    reader = GroupReader({2: a, 3: b})
    got = reader.read()
    assert got.used_gib == 70.0 and got.total_gib == 80.0 and got.index is None
    assert [d.index for d in got.devices] == [2, 3] and [d.used_gib for d in got.devices] == [30.0, 70.0]
    assert got.util_pct == 75.0 and got.power_w == 600.0
    reader.close()
    assert a.closed and b.closed
    assert GroupReader({0: Device(1.0)}).read() == Device(1.0).read()  # one GPU reads as itself


def test_peaks_per_gpu_and_headroom_from_the_fullest():
    a, b = Device(30.0), Device(40.0, total=40.5)
    monitor = GpuMonitor(GroupReader({0: a, 1: b}), interval_s=0.01)
    with monitor:
        a.used = 79.0  # GPU 0 peaks higher, but GPU 1 is nearer its own total
    peaks = monitor.peaks()
    assert [d.index for d in peaks.per_gpu] == [0, 1]
    assert peaks.per_gpu[0].peak_used_gib == 79.0
    assert peaks.headroom_gib == pytest.approx(0.5)
    assert peaks.peak_used_gib == 40.0 and peaks.total_gib == 40.5
    assert GpuPeaks.from_dict(peaks.to_dict()) == peaks


def test_score_per_gpu():
    from autotune.results import Metrics

    metrics = Metrics.from_dict({"output_tok_s": 1000.0, "request_s": 2.0})
    two = TrialResult(status="ok", config={}, metrics=metrics, gpus=[0, 1])
    none = TrialResult(status="ok", config={}, metrics=metrics)
    assert two.gpus_spanned == 2 and two.tok_s_per_gpu == 500.0
    assert none.gpus_spanned == 1 and none.tok_s_per_gpu == 1000.0
    assert TrialResult.from_dict(two.to_dict()).gpus == [0, 1]


def test_a_tenant_on_any_gpu_of_the_group_stops_the_launch():
    busy = {3: Device(20.0, procs=[{"pid": 999_999_999, "used_gib": 20.0, "exited": False}])}

    class Engine:
        device = "cuda"

        def gpu_reader(self, index):
            return busy.get(index) or Device(0.0)

    assert check_engine_gpus(Engine(), (0, 1)) is not None
    with pytest.raises(GpuBusyError) as err:
        check_engine_gpus(Engine(), (2, 3))
    assert "GPU 3" in str(err.value)
    assert group_line((2, 3)) == "GPUs 2,3" and group_line((5,)) == "GPU 5"


def test_group_reader_of_an_engine():
    class Engine:
        def gpu_reader(self, index):
            return Device(float(index or 0))

    assert isinstance(group_reader(Engine(), (0, 1)), GroupReader)
    assert group_reader(Engine(), (4,)).read().used_gib == 4.0
    assert group_reader(Engine(), ()).read().used_gib == 0.0


def test_the_tenancy_check_reads_where_the_launcher_runs_its_servers():
    class Engine:
        device = "cuda"

        def gpu_reader(self, index):
            return Device(0.0)  # this host: idle

    class Remote:
        asked: list = []

        def memory_reader(self, gpus, local):
            self.asked.append(gpus)
            return Device(30.0, procs=[{"pid": 999_999_998, "used_gib": 30.0, "exited": False}])

    assert check_engine_gpus(Engine(), (0, 1)) is not None
    with pytest.raises(GpuBusyError):
        check_engine_gpus(Engine(), (0, 1), launcher=Remote())
    assert Remote.asked == [(0,)]


def test_the_progress_line_names_the_score_per_gpu_once_a_server_spans_several():
    import io

    from autotune.progress import PlainProgress
    from autotune.results import Metrics

    out = io.StringIO()
    progress = PlainProgress(out)
    metrics = Metrics.from_dict({"output_tok_s": 1000.0, "request_s": 2.0})
    progress.trial_finished(0, TrialResult(status="ok", config={}, metrics=metrics, gpus=[0]), 1000.0)
    progress.trial_finished(1, TrialResult(status="ok", config={}, metrics=metrics, gpus=[0, 1]), 1000.0)
    progress.trial_finished(2, TrialResult(status="ok", config={}, metrics=metrics, gpus=[2]), 1000.0)
    lines = out.getvalue().splitlines()
    assert lines[0].endswith("(best 1,000 tok/s)")
    assert lines[1].endswith("(best 1,000 tok/s per GPU)") and lines[2].endswith("(best 1,000 tok/s per GPU)")
