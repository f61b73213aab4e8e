"""Megatron-core on a CPU-only torch, over gloo.

Megatron-core assumes CUDA in a handful of places that matter for us. Each patch below answers one of
them (measured on megatron-core 0.16.1, see docs/architecture.md, "CPU compatibility"):

1. `torch.cuda.current_device()` is used as the `device=` of buffers (rotary inv_freq, p2p shapes):
   it returns "cpu".
2. Megatron's RNG tracker saves and restores CUDA RNG states (even with dropout 0): it uses the CPU
   generator instead. Consequence: `model_parallel_cuda_manual_seed(s)` also seeds the CPU RNG with s.
3. The default causal mask helper builds its mask with `device="cuda"`.
4. Schedules, DDP and the optimizer contain literal `device="cuda"`, `.cuda()` and
   `param.type() == "torch.cuda.FloatTensor"` checks: a TorchFunctionMode maps them to the CPU.
   Torch function modes are thread-local, so `apply()` must run on the thread that runs Megatron
   (Ray actors run `__init__` and their methods on one thread).
5. Without apex or Transformer Engine, norms are torch's, which Megatron's wrapper refuses under sequence
   parallelism (which MoE layers need at TP > 1). The torch norm computes the same per token on a sequence
   shard; only its weight's gradient must then be summed over TP ranks, which Megatron's finalize_model_grads
   does for parameters marked `sequence_parallel` (as apex and TE norms mark theirs).

Nothing here changes numerics: the same code computes the same values, on the CPU. (The megatron-core bugs that
every device hits are fixed in `megatron_fixes`.)
"""
from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode

_device_mode: TorchFunctionMode | None = None


def _names_cuda(dev) -> bool:
    if isinstance(dev, bool):
        return False
    if isinstance(dev, int):  # a bare CUDA ordinal
        return True
    if isinstance(dev, str):
        return dev.startswith("cuda")
    return isinstance(dev, torch.device) and dev.type == "cuda"


class CudaToCpuMode(TorchFunctionMode):
    """Run code written for CUDA tensors on CPU tensors (patch 4 above)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if "device" in kwargs and _names_cuda(kwargs["device"]):
            kwargs = {**kwargs, "device": "cpu"}
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.to and len(args) > 1 and _names_cuda(args[1]) and not isinstance(args[1], int):
            args = (args[0], "cpu", *args[2:])
        out = func(*args, **kwargs)
        if (func is torch.Tensor.type and len(args) == 1 and not kwargs and isinstance(out, str)
                and out.startswith("torch.") and not out.startswith("torch.cuda.")):
            out = "torch.cuda." + out[len("torch."):]
        return out


@contextlib.contextmanager
def device_mode_off():
    """The CUDA-to-CPU mode (patch 4) off for code without CUDA literals: the vLLM engine's steps, and the model's
    forward and the losses inside Megatron's schedule. Every torch call there then skips the mode's Python hook (~10%
    of a CPU engine's generation time, a third of a tiny model's update). Left on where another mode was entered after
    it (it can only leave the top of the thread's mode stack)."""
    on_top = (_device_mode is not None and torch._C._len_torch_function_stack() > 0
              and torch._C._get_function_stack_at(torch._C._len_torch_function_stack() - 1) is _device_mode)
    if not on_top:
        yield
        return
    _device_mode.__exit__(None, None, None)
    try:
        yield
    finally:
        _device_mode.__enter__()


def _causal_mask(seq_len: int) -> torch.Tensor:
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool), diagonal=1)


def _sequence_parallel_torch_norm() -> None:
    """Patch 5 above."""
    import copy

    from megatron.core.transformer.torch_norm import WrappedTorchNorm

    build = WrappedTorchNorm.__new__

    def __new__(cls, config, hidden_size, eps=1e-5, **kwargs):
        if not config.sequence_parallel:
            return build(cls, config, hidden_size, eps, **kwargs)
        # A copy, not dataclasses.replace: that would validate the config anew, and fields set after Megatron's
        # validation (variable_seq_lengths, models/gpt.py) may not pass it for reasons that do not apply here.
        unsplit = copy.copy(config)
        unsplit.sequence_parallel = False
        norm = build(cls, unsplit, hidden_size, eps, **kwargs)
        for param in norm.parameters():
            param.sequence_parallel = True
        return norm

    WrappedTorchNorm.__new__ = __new__


def apply() -> None:
    global _device_mode
    if _device_mode is not None:
        return
    # 1. and 2.
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.get_rng_state = lambda *a, **k: torch.get_rng_state()
    torch.cuda.set_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    torch.cuda.manual_seed = lambda seed: torch.manual_seed(seed)
    torch.cuda.synchronize = lambda *a, **k: None
    import megatron.core.tensor_parallel.random as megatron_random

    megatron_random._get_cuda_rng_state = lambda *a, **k: torch.get_rng_state()
    megatron_random._set_cuda_rng_state = lambda state, *a, **k: torch.set_rng_state(state)
    # 3.
    import megatron.core.fusions.fused_softmax as fused_softmax
    import megatron.core.transformer.utils as transformer_utils

    transformer_utils.get_default_causal_mask = _causal_mask
    fused_softmax.get_default_causal_mask = _causal_mask
    # 4.
    _device_mode = CudaToCpuMode()
    _device_mode.__enter__()
    # 5.
    _sequence_parallel_torch_norm()
