"""Megatron-core's gradient norm and gradient scaling without Transformer Engine or Apex, with no host sync.

Megatron takes its multi-tensor kernels from TE, else Apex, else its own fallbacks in `megatron.core.utils`. The
fallback norm builds a host tensor from every parameter's norm (`torch.tensor([torch.norm(g) for g in grads])`): one
read-back from the GPU per parameter, ~170 per optimizer step for a 24-layer model. These replacements do what TE's
and Apex's kernels do, on the device: torch's foreach norms, stacked and reduced there, and a foreach scale. On CPU
the foreach ops run the same per-tensor norms as the fallback, so the figures are the same bits.
"""
from __future__ import annotations

import torch
from megatron.core import utils as megatron_utils
from megatron.core.optimizer import clip_grads, optimizer


def foreach_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """A drop-in for `multi_tensor_l2norm`: (the L2 norm of all the tensors, as a one-element float tensor on their
    device; None: per-tensor norms are not asked for)."""
    tensors = [tensor for tensors in tensor_lists for tensor in tensors]
    norms = torch._foreach_norm(tensors)
    return torch.linalg.vector_norm(torch.stack(norms)).float().reshape(1), None


def foreach_scale(chunk_size, noop_flag, tensor_lists, scale):
    """A drop-in for `multi_tensor_scale`: tensor_lists[1][i] = tensor_lists[0][i] * scale."""
    sources, targets = tensor_lists
    torch._foreach_copy_(targets, torch._foreach_mul(sources, scale))


def apply() -> None:
    """Use these where Megatron fell back to its own (neither TE nor Apex imported)."""
    if clip_grads.l2_norm_impl is megatron_utils.local_multi_tensor_l2_norm:
        clip_grads.l2_norm_impl = foreach_l2_norm
    for module in (clip_grads, optimizer):
        if module.multi_tensor_scale_impl is megatron_utils.local_multi_tensor_scale:
            module.multi_tensor_scale_impl = foreach_scale
