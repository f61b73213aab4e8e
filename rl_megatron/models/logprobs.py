"""Token log-probs and entropy from vocabulary-parallel logits, without gathering the full logits.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. Megatron's
`vocab_parallel_cross_entropy` reduces over the TP group; entropy needs the same two reductions (max and
sum of exponentials) plus one for the expected logit.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel


def prepare_logits(logits: torch.Tensor, temperature: float, vocab_size: int) -> torch.Tensor:
    """Scale by the sampling temperature and remove Megatron's vocabulary padding from the distribution."""
    logits = logits.float() / temperature
    shard = logits.shape[-1]
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    if start + shard > vocab_size:
        padding = torch.arange(start, start + shard, device=logits.device) >= vocab_size
        logits = logits.masked_fill(padding, torch.finfo(logits.dtype).min)
    return logits


def token_log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """log p(labels) under softmax(logits); logits [..., V/TP] from `prepare_logits`, differentiable."""
    return -tensor_parallel.vocab_parallel_cross_entropy(logits, labels)


@torch.no_grad()
def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of softmax(logits) per position; logits [..., V/TP] from `prepare_logits`."""
    group = parallel_state.get_tensor_model_parallel_group()
    top = logits.max(dim=-1).values
    dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
    exp = torch.exp(logits - top.unsqueeze(-1))
    total = exp.sum(dim=-1)
    dist.all_reduce(total, group=group)
    expected_logit = (exp * logits).sum(dim=-1) / total
    dist.all_reduce(expected_logit, group=group)
    return top + torch.log(total) - expected_logit
