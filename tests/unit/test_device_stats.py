"""A worker's device figures on the CPU: the matrix-multiply peak it measures, the datasheet peaks GPUs are looked up
in, and the memory it reports (tests/gpu/test_device_stats_gpu.py: the GPU's)."""
import time

import psutil
import pytest
import torch

from rl_megatron.platform.device_stats import (GIB, measured_matmul_flops, nominal_bf16_flops, peak_flops,
                                               read_device_stats, reset_gpu_peak_memory)


@pytest.mark.parametrize("name, flops", [
    ("NVIDIA H100 80GB HBM3", 989e12),  # SXM5
    ("NVIDIA H100 PCIe", 756e12),
    ("NVIDIA H100 NVL", 835e12),
    ("NVIDIA H200", 989e12),
    ("NVIDIA H200 NVL", 835e12),
    ("NVIDIA A100-SXM4-80GB", 312e12),
    ("NVIDIA A100-PCIE-40GB", 312e12),
    ("NVIDIA A10", None),  # not an A100
    ("NVIDIA GeForce RTX 4090", None),
])
def test_gpu_peaks_by_device_name(name, flops):
    assert nominal_bf16_flops(name) == flops


def test_cpu_peak_is_the_fastest_product_measured_with_this_process_threads():
    """The same product timed here gives the same rate to within a few times (the machine is shared: timings move,
    but not tenfold between two runs a second apart): the figure is FLOP/s of one thread, not seconds or a count."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        peak = measured_matmul_flops(size=512, repeats=5)
        a, b = torch.randn(512, 512), torch.randn(512, 512)
        torch.mm(a, b)
        times = []
        for _ in range(5):
            start = time.perf_counter()
            torch.mm(a, b)
            times.append(time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    flops = 2 * 512**3
    assert flops / max(times) / 3 < peak < 3 * flops / min(times)
    assert peak_flops("float32") > 0  # on a CPU: measured, never unknown


def test_cpu_memory_is_the_node_figure_and_there_is_no_gpu_figure():
    reset_gpu_peak_memory()  # nothing to reset on a CPU; must not fail
    stats = read_device_stats(peak=1e10)
    assert stats.peak_flops == 1e10 and stats.max_memory_allocated_gb is None
    used = psutil.virtual_memory().used / GIB
    assert abs(stats.cpu_memory_used_gb - used) < 0.5 and 0 < used < psutil.virtual_memory().total / GIB
