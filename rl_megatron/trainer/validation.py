"""Validation: generate on the held-out prompts, score, and summarise per data source."""
from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable

import torch

from rl_megatron.config import Config
from rl_megatron.data.loader import PromptLoader
from rl_megatron.rewards.scorer import RewardScorer
from rl_megatron.batch import Prompt, Sample
from rl_megatron.rollout.engines import Sampling

GENERATION_COLUMNS = ["prompt", "response", "score"]  # the table of validation samples the loggers show
CORRECT = 1.0 - 1e-6  # a sample counts as solved at the scorer's full score (partial credit, e.g. format, does not)


def validate(rollout: Callable[[list[Prompt], Sampling], list[Sample]], val_loader: PromptLoader,
             scorer: RewardScorer, tokenizer, cfg: Config, step: int) -> tuple[dict[str, float], list[list]]:
    """One pass over the validation prompts through `rollout` (the run's rollout function): rollout.val_n answers
    each (greedy for one, sampled at rollout.temperature for more); rewards per data source, pass@k, and the rows of
    a table of the first samples (GENERATION_COLUMNS)."""
    n = cfg.rollout.val_n
    sources, scores, texts = [], [], []
    for batch_index, prompts in enumerate(val_loader.in_order()):
        sampling = Sampling(n, 0.0 if n == 1 else cfg.rollout.temperature, f"validation {batch_index}", step)
        samples = rollout(prompts, sampling)
        sources += [p.data_source for p in prompts]
        scores.append(scorer.submit_samples(samples, tokenizer).result().scores)
        texts += [(tokenizer.decode(s.prompt_ids, skip_special_tokens=True),
                   tokenizer.decode(s.response_ids, skip_special_tokens=True)) for s in samples]
    scores = torch.cat(scores)
    rows = generation_rows([p for p, _ in texts], [r for _, r in texts], scores.tolist(),
                           cfg.trainer.val_generations_to_log)
    return validation_metrics(sources, scores, n), rows


def validation_metrics(data_sources: list[str], scores: torch.Tensor, n: int) -> dict[str, float]:
    """`val/<data_source>/reward_mean` over all samples, and with n > 1 samples per prompt (prompt-major: sample j
    of prompt i at i * n + j) `val/<data_source>/pass@n`: the share of prompts with a solved sample."""
    per_prompt = scores.reshape(-1, n)
    groups: dict[str, list[int]] = defaultdict(list)
    for prompt, source in enumerate(data_sources):
        groups[source].append(prompt)
    metrics = {}
    for source, prompts in sorted(groups.items()):
        mine = per_prompt[prompts]
        metrics[f"val/{source}/reward_mean"] = mine.mean().item()
        if n > 1:
            metrics[f"val/{source}/pass@{n}"] = (mine >= CORRECT).any(dim=1).float().mean().item()
    return metrics


def generation_rows(prompts: list[str], responses: list[str], scores: list[float], rows: int) -> list[list]:
    """The first `rows` samples as rows of a table of GENERATION_COLUMNS."""
    return [list(sample) for sample in zip(prompts, responses, scores)][:rows]
