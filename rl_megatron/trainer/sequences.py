"""Rollouts -> the right-padded tensors the Megatron workers consume.

Position t of every per-token tensor refers to the token at t + 1, i.e. the label predicted at position t:
a response of R tokens after a prompt of P tokens occupies label positions P-1 .. P+R-2.
"""
from __future__ import annotations

import torch

from rl_megatron.rollout.vllm_engine import Generation


def pack_generations(generations: list[Generation], pad_id: int) -> dict[str, torch.Tensor]:
    length = max(len(g.prompt_ids) + len(g.response_ids) for g in generations)
    count = len(generations)
    input_ids = torch.full((count, length), pad_id, dtype=torch.long)
    response_mask = torch.zeros(count, length)
    rollout_log_probs = torch.zeros(count, length)
    for row, g in enumerate(generations):
        prompt, response = len(g.prompt_ids), len(g.response_ids)
        input_ids[row, : prompt + response] = torch.tensor(g.prompt_ids + g.response_ids)
        response_mask[row, prompt - 1 : prompt - 1 + response] = 1.0
        rollout_log_probs[row, prompt - 1 : prompt - 1 + response] = torch.tensor(g.response_log_probs)
    return {"input_ids": input_ids, "response_mask": response_mask, "rollout_log_probs": rollout_log_probs}
