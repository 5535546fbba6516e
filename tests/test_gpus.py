"""GPU profiles: the device a real server runs on (a fake NVML here), and the backends SGLang picks by architecture."""

from __future__ import annotations

import sys
import types

import pytest

from autotune.errors import ConfigError, GpuError
from autotune.harness.engines import planner_gpu
from autotune.sglang.gpus import GPUS, load_gpu, profile_for_device
from autotune.sglang.memory import plan
from autotune.sglang.profiles import load_model


@pytest.mark.parametrize(
    "reported, mib, cap, profile",
    [
        ("NVIDIA B200", 183_359, (10, 0), "b200"),
        ("NVIDIA GB200", 189_471, (10, 0), "gb200"),  # not a B200: the longer name wins
        ("NVIDIA B300 SXM6 AC", 275_040, (10, 3), "b300"),
        ("NVIDIA H100 80GB HBM3", 81_559, (9, 0), "h100"),
        ("NVIDIA H200", 143_771, (9, 0), "h200"),
        ("NVIDIA H20", 97_871, (9, 0), "h20"),
        ("NVIDIA A100-SXM4-80GB", 81_920, (8, 0), "a100-80g"),
        ("NVIDIA L40S", 46_068, (8, 9), "l40s"),
        ("NVIDIA RTX PRO 6000 Blackwell Server Edition", 97_887, (12, 0), "rtx-pro-6000"),
    ],
)
def test_a_device_name_finds_its_profile_with_the_devices_memory(reported, mib, cap, profile):
    gpu = profile_for_device(reported, mib, cap)
    assert gpu.name == profile and gpu.memory_mib == mib and gpu.capability == cap
    assert gpu.memory_mib == GPUS[profile].memory_mib  # the shipped figure is what the device reports


def test_an_unknown_device_takes_its_architectures_figures():
    gpu = profile_for_device("NVIDIA A40", 46_068, (8, 6))
    assert gpu.name == "nvidia-a40" and gpu.arch == "sm80" and gpu.memory_mib == 46_068
    assert gpu.default_attention_backend == "flashinfer"


def test_backend_defaults_follow_the_architecture():
    model = load_model("qwen3.6-27b")
    backends = {
        name: plan(model, load_gpu(name), {"max_mamba_cache_size": 40}).extra["attention_backend"]
        for name in ("b200", "b300", "gb200", "h100", "h20", "a100-80g", "l40s", "mi300x")
    }
    assert backends == {
        "b200": "trtllm_mha",
        "b300": "trtllm_mha",
        "gb200": "trtllm_mha",
        "h100": "fa3",
        "h20": "fa3",
        "a100-80g": "flashinfer",
        "l40s": "flashinfer",
        "mi300x": "aiter",
    }


class FakeNvml(types.ModuleType):
    """pynvml's calls the planner's device read makes, answering for one device."""

    class NVMLError(Exception):
        pass

    def __init__(self, name: str, total_mib: int, cap: tuple[int, int]):
        super().__init__("pynvml")
        self.device, self.calls = (name, total_mib, cap), 0

    def nvmlInit(self):
        self.calls += 1

    def nvmlShutdown(self):
        pass

    def nvmlDeviceGetHandleByIndex(self, index):
        return index

    def nvmlDeviceGetName(self, handle):
        return self.device[0]

    def nvmlDeviceGetMemoryInfo(self, handle):
        return types.SimpleNamespace(total=self.device[1] * 2**20, used=0, free=self.device[1] * 2**20)

    def nvmlDeviceGetCudaComputeCapability(self, handle):
        return self.device[2]


@pytest.fixture
def fake_nvml(monkeypatch):
    def install(name: str, total_mib: int, cap: tuple[int, int]) -> FakeNvml:
        fake = FakeNvml(name, total_mib, cap)
        monkeypatch.setitem(sys.modules, "pynvml", fake)
        planner_gpu.cache_clear()
        return fake

    yield install
    planner_gpu.cache_clear()


def test_the_real_engine_plans_for_the_device_it_runs_on(fake_nvml):
    fake = fake_nvml("NVIDIA A100-SXM4-80GB", 81_920, (8, 0))
    gpu = planner_gpu("sglang", sim_gpu=None, gpu_index=3)
    assert (gpu.name, gpu.arch, gpu.memory_mib) == ("a100-80g", "sm80", 81_920)
    planner_gpu("sglang", sim_gpu=None, gpu_index=3)
    assert fake.calls == 1  # read once per process
    assert planner_gpu("sim", sim_gpu=None).name == "b200"  # the simulator's device is its profile


def test_a_sim_gpu_that_names_another_gpu_is_one_error_saying_both(fake_nvml):
    fake_nvml("NVIDIA B300 SXM6 AC", 275_040, (10, 3))
    with pytest.raises(ConfigError) as err:
        planner_gpu("sglang", sim_gpu="b200", gpu_index=0)
    text = str(err.value)
    assert "'b200'" in text and "NVIDIA B300 SXM6 AC (b300)" in text and "engine.sim_gpu" in text
    assert planner_gpu("sglang", sim_gpu="b300", gpu_index=0).name == "b300"


def test_the_cpu_backend_keeps_a_stand_in_profile():
    assert planner_gpu("sglang", sim_gpu=None, device="cpu").name == "b200"


def test_without_a_driver_a_named_profile_stands_and_none_is_the_drivers_error(monkeypatch):
    broken = types.ModuleType("pynvml")

    class NVMLError(Exception):
        pass

    def no_driver():
        raise NVMLError("NVML Shared Library Not Found")

    broken.NVMLError, broken.nvmlInit = NVMLError, no_driver
    monkeypatch.setitem(sys.modules, "pynvml", broken)
    planner_gpu.cache_clear()
    assert planner_gpu("sglang", sim_gpu="h200", gpu_index=0).name == "h200"
    with pytest.raises(GpuError, match="NVML"):
        planner_gpu("sglang", sim_gpu=None, gpu_index=1)
    planner_gpu.cache_clear()
