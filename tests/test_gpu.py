"""GPU monitor and readers: peaks from samples, release waits, the simulated and host readers, NVML's error."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from autotune.errors import GpuError
from autotune.harness.engines.sim import SimGpuReader
from autotune.harness.gpu import GpuMonitor, GpuReading, HostMemoryReader, NvmlReader, wait_released
from autotune.inspect.probe import GpuMemory, _nvml_gpu

pytestmark = pytest.mark.timeout(30)


class Scripted:
    """A reader that plays back a list of readings, then repeats the last one."""

    def __init__(self, readings):
        self.readings, self.i = list(readings), 0

    def read(self):
        reading = self.readings[min(self.i, len(self.readings) - 1)]
        self.i += 1
        if isinstance(reading, Exception):
            raise reading
        return reading

    def close(self):
        pass


def test_monitor_keeps_peaks_and_counts_failed_readings():
    reader = Scripted(
        [
            GpuReading(used_gib=10.0, total_gib=80.0, util_pct=50.0, power_w=300.0),
            RuntimeError("driver hiccup"),
            GpuReading(used_gib=70.0, total_gib=80.0, util_pct=100.0, power_w=650.0),
            GpuReading(used_gib=40.0, total_gib=80.0, util_pct=90.0, power_w=None),
        ]
    )
    with GpuMonitor(reader, interval_s=0.01) as monitor:
        deadline = time.monotonic() + 5
        while reader.i < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
    peaks = monitor.peaks()
    assert peaks.peak_used_gib == 70.0 and peaks.total_gib == 80.0 and peaks.headroom_gib == 10.0
    assert peaks.peak_power_w == 650.0
    assert monitor.errors == 1
    assert peaks.samples == len(monitor.samples) >= 3
    assert 50.0 <= peaks.mean_util_pct <= 100.0


def test_monitor_without_readings_reports_unknowns():
    with GpuMonitor(Scripted([RuntimeError("no device")]), interval_s=0.01) as monitor:
        pass
    peaks = monitor.peaks()
    assert peaks.peak_used_gib is None and peaks.samples == 0


def test_wait_released_polls_until_back_to_baseline_or_times_out():
    releasing = Scripted([GpuReading(used_gib=60.0)] * 3 + [GpuReading(used_gib=1.0)])
    assert wait_released(releasing, 1024.0, timeout_s=5, poll_s=0.01) is True
    assert releasing.i == 4
    stuck = Scripted([GpuReading(used_gib=60.0)])
    t0 = time.monotonic()
    assert wait_released(stuck, 1024.0, timeout_s=0.2, poll_s=0.01) is False
    assert time.monotonic() - t0 < 2
    assert wait_released(stuck, None, timeout_s=0.2) is True  # no baseline: nothing to wait for


def test_sim_reader_reads_the_simulated_device(tmp_path, monkeypatch):
    import os

    from autotune.sim import device

    monkeypatch.setenv("AUTOTUNE_SIM_DEVICE_DIR", str(tmp_path))
    reader = SimGpuReader(5)
    assert reader.read().used_gib == 0.0
    device.register(5, pid=os.getpid(), gpu_name="b200", total_mib=8192.0, used_mib=3072.0, release_s=0.0)
    reading = reader.read()
    assert reading.used_gib == pytest.approx(3.0) and reading.total_gib == pytest.approx(8.0)
    device.mark_exited(5, os.getpid())
    assert wait_released(reader, 0.0, timeout_s=5, poll_s=0.02)


def test_host_reader_reports_memory():
    reading = HostMemoryReader().read()  # nothing tracked yet: the host
    assert 0 < reading.used_gib < reading.total_gib


def test_host_reader_tracks_one_process_tree_and_its_files():
    """The CPU backend's "GPU": the tracked processes' own memory plus their shared-memory files, nothing else."""
    code = "import time; x = b'\\1' * (256 << 20); print('held', flush=True); time.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "held"
        reader = HostMemoryReader()
        reader.track(lambda: [proc.pid], lambda: 64 << 20)
        used_mib = reader.read().used_gib * 1024
        assert 256 + 64 <= used_mib < 256 + 64 + 128
        reader.track(lambda: [], lambda: 0)  # the tree is gone
        assert reader.read().used_gib == 0
    finally:
        proc.kill()
        proc.wait(10)
        proc.stdout.close()


def test_nvml_without_a_driver_is_a_gpu_error_with_a_hint():
    try:
        reader = NvmlReader(0)
    except GpuError as exc:
        assert "driver" in str(exc) or "nvidia-ml-py" in str(exc)
    else:  # a machine with a GPU: the reading must be sane
        reading = reader.read()
        reader.close()
        assert reading.total_gib > 0


def test_nvml_reading_leaves_none_where_the_board_does_not_report(monkeypatch):
    """NVML's memory always; utilisation, power and SM clock each None where the board raises NVMLError."""
    import types

    class NVMLError(Exception):
        pass

    def unsupported(*_args):
        raise NVMLError("not supported")

    fake = types.SimpleNamespace(
        NVMLError=NVMLError,
        NVML_CLOCK_SM=1,
        nvmlInit=lambda: None,
        nvmlShutdown=lambda: None,
        nvmlDeviceGetHandleByIndex=lambda index: f"gpu{index}",
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=3 * 2**30, total=8 * 2**30),
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=42),
        nvmlDeviceGetPowerUsage=unsupported,
        nvmlDeviceGetClockInfo=lambda handle, clock: 1980,
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    assert NvmlReader(2).read() == GpuReading(
        used_gib=3.0, total_gib=8.0, util_pct=42.0, power_w=None, sm_clock_mhz=1980.0
    )
    assert _nvml_gpu(2) == GpuMemory(3.0, 8.0, "NVML GPU 2")  # inspect reads the same record
