"""What a worker says about its device: the peak FLOP/s its model FLOPs are measured against (MFU), and the memory
in use (verl's `perf/max_memory_allocated_gb`, `perf/cpu_memory_used_gb`).

The peak on a GPU is the datasheet's dense bf16 figure for the device's name; on a CPU no datasheet figure means
anything (cores, threads per worker, AVX-512 or not), so the worker measures the matrix-multiply rate it gets with
its own thread count, once, when it starts.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import psutil
import torch

from rl_megatron import platform

GIB = 1024**3  # verl's perf/*_gb figures are GiB

# Dense (no sparsity) bf16 tensor-core peaks from NVIDIA's datasheets (fp16's are the same). Matched as substrings of
# torch.cuda.get_device_name(), first match wins, so each variant with a lower clock or power limit ("NVIDIA H100
# PCIe", "NVIDIA H100 NVL") comes before its family's SXM figure ("NVIDIA H100 80GB HBM3"). Any other device has
# no peak, and so no MFU, rather than a guess.
NOMINAL_BF16_FLOPS = (
    ("H100 PCIe", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM5
    ("H200 NVL", 835e12),
    ("H200", 989e12),  # SXM
    ("A100", 312e12),  # SXM4 and PCIe alike
)


def nominal_bf16_flops(device_name: str) -> float | None:
    """The dense bf16 peak FLOP/s of a GPU named `device_name`; None for a device not in the table."""
    return next((flops for name, flops in NOMINAL_BF16_FLOPS if name in device_name), None)


def measured_matmul_flops(size: int = 1024, repeats: int = 5, dtype: torch.dtype = torch.float32) -> float:
    """The FLOP/s of the fastest of `repeats` [size, size] x [size, size] products on the CPU, with this process's
    torch threads. The fastest, not the mean: other processes starting at the same time only ever slow a run down."""
    a = torch.randn(size, size, dtype=dtype)
    b = torch.randn(size, size, dtype=dtype)
    torch.mm(a, b)  # the first product pays for the BLAS library's start-up
    fastest = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        fastest = min(fastest, time.perf_counter() - start)
    return 2 * size**3 / fastest  # a multiply-add is 2 FLOPs


def peak_flops(dtype: str) -> float | None:
    """The peak FLOP/s of this process's device for a model of `dtype` (model.dtype): on a GPU the datasheet's bf16
    figure (None for a float32 model, whose matrix multiplies run at another, lower peak, or an unknown device); on
    a CPU the measured matrix-multiply rate in that dtype."""
    if platform.has_cuda():
        return nominal_bf16_flops(torch.cuda.get_device_name()) if dtype == "bfloat16" else None
    return measured_matmul_flops(dtype=getattr(torch, dtype))


@dataclass(frozen=True)
class DeviceStats:
    """One worker's report for a step."""
    peak_flops: float | None  # see `peak_flops`
    max_memory_allocated_gb: float | None  # torch's GPU allocator peak since `reset_gpu_peak_memory`; None on CPU
    cpu_memory_used_gb: float  # the node's host memory in use (psutil's `used`), as verl reports it


def reset_gpu_peak_memory() -> None:
    """Start the GPU's peak-memory count afresh (at each step's start)."""
    if platform.has_cuda():
        torch.cuda.reset_peak_memory_stats()


def read_device_stats(peak: float | None) -> DeviceStats:
    allocated = torch.cuda.max_memory_allocated() / GIB if platform.has_cuda() else None
    return DeviceStats(peak, allocated, psutil.virtual_memory().used / GIB)
