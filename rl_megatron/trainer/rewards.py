"""A batch's rewards: the scorer's scores and accuracies (`rl_megatron.rewards.scorer.Scored`), shaped by DAPO's
overlong penalty when reward.overlong_buffer.enable is set."""
from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from rl_megatron.algorithms import overlong_penalty
from rl_megatron.batch import Sample
from rl_megatron.config.schema import RewardConfig
from rl_megatron.data.loader import PromptLoader
from rl_megatron.rewards import SCORERS
from rl_megatron.rewards.scorer import Scored


@dataclass
class Rewards:
    """Per sample: `scores`, what the advantages use (the scorer's score plus `penalty`); `acc`, the scorer's accuracy
    (its "acc" entry, else its score before shaping); `penalty`, the overlong penalty (None without shaping). `stats`:
    the scorer's failure counts over the samples scored."""
    scores: Tensor
    acc: Tensor
    penalty: Tensor | None
    stats: dict[str, float]

    @classmethod
    def of(cls, scored: Scored, samples: list[Sample], reward_cfg, max_tokens: int) -> Rewards:
        """The rewards of `samples` from their scores: the overlong penalty counts the model's own tokens (a tool's
        reply in a multi-turn response is not the model's length)."""
        buffer = reward_cfg.overlong_buffer
        if not buffer.enable:
            return cls(scored.scores, scored.acc, None, dict(scored.stats))
        lengths = torch.tensor([sample.model_tokens() for sample in samples], dtype=torch.float32)
        penalty = overlong_penalty(lengths, max_tokens, buffer.len, buffer.penalty_factor)
        return cls(scored.scores + penalty, scored.acc, penalty, dict(scored.stats))

    def select(self, indices: list[int]) -> Rewards:
        """The rewards of the samples at `indices`, in that order (the failure counts stay the batch's)."""
        index = torch.tensor(indices, dtype=torch.long)
        return Rewards(self.scores[index], self.acc[index], None if self.penalty is None else self.penalty[index],
                       self.stats)

    @classmethod
    def cat(cls, parts: list[Rewards]) -> Rewards:
        """The rewards of several batches' samples, in order, with their failure counts added up."""
        stats = {key: sum(part.stats.get(key, 0) for part in parts) for key in parts[0].stats}
        penalty = None if parts[0].penalty is None else torch.cat([part.penalty for part in parts])
        return cls(torch.cat([p.scores for p in parts]), torch.cat([p.acc for p in parts]), penalty, stats)

    def metrics(self) -> dict[str, float]:
        """DAPO's pair: reward/score (shaped, what is trained on) beside reward/acc; the penalty's mean when on."""
        metrics = {"reward/score": self.scores.mean().item(), "reward/acc": self.acc.mean().item(), **self.stats}
        if self.penalty is not None:
            metrics["reward/overlong_penalty/mean"] = self.penalty.mean().item()
        return metrics


def check_scorers(reward: RewardConfig, loaders: list[PromptLoader]) -> None:
    """Every row's data source needs a scorer (reward.custom_fn, or a registered one): found out before any worker
    starts, not at its first batch."""
    if reward.custom_fn is not None:
        return
    for source in sorted({row["data_source"] for loader in loaders for row in loader.rows}):
        SCORERS.check(source)
