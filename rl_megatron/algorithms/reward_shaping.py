"""Reward shaping on a sample's length, added to the scorer's reward before the advantages."""
from __future__ import annotations

import torch


def overlong_penalty(model_tokens: torch.Tensor, max_tokens: int, buffer_len: int,
                     penalty_factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment (Yu et al. 2025, "Overlong Reward Shaping"): the [B] penalty, added to the
    reward, of samples of `model_tokens` generated tokens each, with L_max = `max_tokens` and L_cache = `buffer_len`:

        0                                                        if L <= L_max - L_cache
        -(L - (L_max - L_cache)) / L_cache * penalty_factor      if L_max - L_cache < L <= L_max
        -penalty_factor                                          if L > L_max

    The penalty grows with the length rather than falling on truncated samples alone, so the policy learns to end
    its answers before the limit. A multi-turn trajectory counts its model tokens over all turns, which can pass `max_tokens` (a per-turn limit):
    the penalty stays at -penalty_factor there.
    """
    over = model_tokens.float() - (max_tokens - buffer_len)
    return (-over / buffer_len * penalty_factor).clamp(min=-penalty_factor, max=0.0)
