"""The one place that knows which device the process runs on.

On any device `setup()` fixes the megatron-core bugs that every device hits (`megatron_fixes`); beyond that, on a
CUDA machine, Megatron-core runs as upstream intends, over NCCL (gloo only for host tensors). Without CUDA,
`setup()` also applies the small compatibility layer in `cpu_compat` so that Megatron-core runs on CPU over gloo.
Every process that builds Megatron objects calls `setup()` once before it does (the worker actors, the processes
`workers.spawn.run_distributed` starts for tests, benchmarks and conversion: both through
`workers.distributed.init_distributed`); the rest of the code base uses `device()` / `dist_backend()` and never
tests for CUDA.
"""
from __future__ import annotations

import torch

_applied = False


def has_cuda() -> bool:
    return torch.cuda.is_available()


def on_with_cuda(setting: bool | None) -> bool:
    """A setting whose null means "on where this process has CUDA" (the fused kernels, the distributed optimizer):
    the process's own device decides, since the controller may have no GPU while its workers do."""
    return has_cuda() if setting is None else setting


def device() -> torch.device:
    """The compute device of this process."""
    return torch.device("cuda", torch.cuda.current_device()) if has_cuda() else torch.device("cpu")


def dist_backend() -> str:
    # On GPU, NCCL for CUDA tensors and gloo for the few host tensors that are reduced as well (token counts and
    # metrics of an update): an NCCL-only group refuses CPU tensors.
    return "cpu:gloo,cuda:nccl" if has_cuda() else "gloo"


def setup() -> None:
    """Make Megatron-core usable on this process's device (idempotent; call on the thread that runs Megatron)."""
    global _applied
    if _applied:
        return
    from rl_megatron.platform import cpu_compat, grad_norm, megatron_fixes, wgrad_accumulation

    megatron_fixes.apply()
    wgrad_accumulation.install()  # Megatron's gradient_accumulation_fusion without Apex
    grad_norm.apply()  # on any device where TE and Apex are absent
    if not has_cuda():
        cpu_compat.apply()
    _applied = True
