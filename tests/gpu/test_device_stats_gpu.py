"""One CUDA GPU: the figures a worker reports for `perf/max_memory_allocated_gb` and `perf/mfu/actor` (its peak).

    pytest tests/gpu/test_device_stats_gpu.py -m gpu -v
"""
import pytest
import torch

from rl_megatron.platform.device_stats import (GIB, nominal_bf16_flops, peak_flops, read_device_stats,
                                               reset_gpu_peak_memory)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]


def test_peak_memory_counts_from_the_last_reset():
    reset_gpu_peak_memory()
    block = torch.empty(GIB, dtype=torch.uint8, device="cuda")
    del block
    assert read_device_stats(peak=None).max_memory_allocated_gb >= 1.0
    reset_gpu_peak_memory()  # a new step: the freed gigabyte is no longer its peak
    assert read_device_stats(peak=None).max_memory_allocated_gb < 1.0


def test_peak_is_the_datasheet_bf16_figure_for_bf16_models_only():
    assert peak_flops("bfloat16") == nominal_bf16_flops(torch.cuda.get_device_name())
    assert peak_flops("float32") is None
