"""The CUDA caching allocator's settings while vLLM allocates: its sleep-mode allocator (CuMem) asserts that
PYTORCH_CUDA_ALLOC_CONF has no `expandable_segments:True`, and its memory pool cannot share PyTorch's expandable
segments, while Megatron's phases keep the user's setting (it limits fragmentation there)."""
from __future__ import annotations

import contextlib
import os

import torch

from rl_megatron import platform


def without_expandable_segments(alloc_conf: str) -> str:
    """PYTORCH_CUDA_ALLOC_CONF without `expandable_segments:True` (the other settings kept, in order)."""
    items = [item for item in alloc_conf.split(",") if item.strip()]
    return ",".join(item for item in items if item.replace(" ", "") != "expandable_segments:True")


@contextlib.contextmanager
def vllm_allocator_settings():
    """While vLLM allocates (engine start, sleep, wake-up): its sleep-mode allocator (CuMem) asserts that
    PYTORCH_CUDA_ALLOC_CONF has no `expandable_segments:True`, and its memory pool cannot share PyTorch's expandable
    segments. Megatron phases keep the user's setting (it limits fragmentation there). verl toggles the allocator
    the same way around its rollout's wake-up and sleep."""
    conf = os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "")
    stripped = without_expandable_segments(conf)
    if stripped == conf:
        yield
        return
    os.environ["PYTORCH_CUDA_ALLOC_CONF"] = stripped
    live = platform.has_cuda() and torch.cuda.is_initialized()
    if live:
        torch.cuda.memory._set_allocator_settings("expandable_segments:False")
    try:
        yield
    finally:
        os.environ["PYTORCH_CUDA_ALLOC_CONF"] = conf
        if live:
            torch.cuda.memory._set_allocator_settings("expandable_segments:True")
