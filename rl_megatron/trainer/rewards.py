"""A batch's rewards: the scorer's scores and accuracies (`rl_megatron.rewards.scorer.Scored`), shaped by DAPO's
overlong penalty when reward.overlong_buffer.enable is set, and with the scores of models (a reward model, a judge)
added to them or in their place."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch
from torch import Tensor

from rl_megatron.algorithms import overlong_penalty
from rl_megatron.batch import Sample
from rl_megatron.config.schema import JudgeConfig, RewardConfig, RewardModelConfig
from rl_megatron.data.loader import PromptLoader
from rl_megatron.rewards import SCORERS
from rl_megatron.rewards.scorer import Scored


@dataclass
class Rewards:
    """Per sample: `scores`, what the advantages use (the scorer's score plus `penalty`, and the models' scores);
    `acc`, the scorer's accuracy (its "acc" entry, else its score before shaping); `penalty`, the overlong penalty
    (None without shaping); `sources`, the scores of each model that scored the samples, by its config section
    (reward_model, judge). `stats`: the scorer's failure counts over the samples scored, and the models'."""
    scores: Tensor
    acc: Tensor
    penalty: Tensor | None
    stats: dict[str, float]
    sources: dict[str, Tensor] = field(default_factory=dict)

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

    def with_sources(self, sources: list[ModelScores]) -> Rewards:
        """These rewards with the models' scores: coef x each added to the rule's score, or, where a model's mode is
        alone, in place of it (the overlong penalty still added)."""
        if not sources:
            return self
        alone = any(source.settings.mode == "alone" for source in sources)
        base = self.scores if not alone else torch.zeros_like(self.scores) if self.penalty is None else self.penalty
        scores = base + sum(source.settings.coef * source.scores for source in sources)
        stats = self.stats | {key: value for source in sources for key, value in source.stats.items()}
        return dataclasses.replace(self, scores=scores, stats=stats,
                                   sources=self.sources | {source.name: source.scores for source in sources})

    def select(self, indices: list[int]) -> Rewards:
        """The rewards of the samples at `indices`, in that order (the failure counts stay the batch's)."""
        index = torch.tensor(indices, dtype=torch.long)
        return Rewards(self.scores[index], self.acc[index], None if self.penalty is None else self.penalty[index],
                       self.stats, {name: scores[index] for name, scores in self.sources.items()})

    @classmethod
    def cat(cls, parts: list[Rewards]) -> Rewards:
        """The rewards of several batches' samples, in order, with their failure counts added up."""
        stats = {key: sum(part.stats.get(key, 0) for part in parts) for key in parts[0].stats}
        penalty = None if parts[0].penalty is None else torch.cat([part.penalty for part in parts])
        sources = {name: torch.cat([part.sources[name] for part in parts]) for name in parts[0].sources}
        return cls(torch.cat([p.scores for p in parts]), torch.cat([p.acc for p in parts]), penalty, stats, sources)

    def metrics(self) -> dict[str, float]:
        """DAPO's pair: reward/score (shaped, what is trained on) beside reward/acc; the penalty's mean when on; each
        model's scores (<source>/score/mean, std, max, min)."""
        metrics = {"reward/score": self.scores.mean().item(), "reward/acc": self.acc.mean().item(), **self.stats}
        if self.penalty is not None:
            metrics["reward/overlong_penalty/mean"] = self.penalty.mean().item()
        for name, scores in self.sources.items():
            metrics |= {f"{name}/score/mean": scores.mean().item(), f"{name}/score/max": scores.max().item(),
                        f"{name}/score/min": scores.min().item(),
                        f"{name}/score/std": scores.std(unbiased=False).item()}
        return metrics


@dataclass
class ModelScores:
    """A model's scores of a batch's samples: `name`, its config section (reward_model, judge), whose `settings` give
    its coef and mode; `stats`, its own counts (e.g. judge/parse_failures)."""
    name: str
    scores: Tensor
    settings: RewardModelConfig | JudgeConfig
    stats: dict[str, float] = field(default_factory=dict)

    def select(self, indices: list[int]) -> ModelScores:
        """The scores of the samples at `indices`, in that order (the counts stay the batch's)."""
        return dataclasses.replace(self, scores=self.scores[torch.tensor(indices, dtype=torch.long)])


def check_scorers(reward: RewardConfig, loaders: list[PromptLoader]) -> None:
    """Every row's data source needs a scorer (reward.custom_fn, or a registered one): found out before any worker
    starts, not at its first batch."""
    if reward.custom_fn is not None:
        return
    for source in sorted({row["data_source"] for loader in loaders for row in loader.rows}):
        SCORERS.check(source)
