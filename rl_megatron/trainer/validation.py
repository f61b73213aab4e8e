"""Validation: generate on the held-out prompts, score, and summarise per data source."""
from __future__ import annotations

import dataclasses
import json
import os
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

import torch

from rl_megatron.config import Config
from rl_megatron.config.schema import ModelConfig
from rl_megatron.data.loader import PromptLoader
from rl_megatron.rewards.scorer import RewardScorer
from rl_megatron.batch import Prompt, Sample
from rl_megatron.rollout.engines import Sampling

GENERATION_COLUMNS = ["prompt", "response", "score"]  # the table of validation samples the loggers show
CORRECT = 1.0 - 1e-6  # a sample counts as solved at full accuracy (partial credit, e.g. format, does not)


@dataclass(frozen=True)
class Generation:
    """One validation sample, as the JSONL of a validation records it."""
    data_source: str
    prompt: str
    response: str
    score: float


@dataclass(frozen=True)
class Validation:
    step: int  # the policy's step (its updates so far)
    metrics: dict[str, float]  # val/<data_source>/reward_mean and acc (and pass@n)
    generations: list[Generation]  # every sample, prompt-major

    def table_rows(self, rows: int) -> list[list]:
        """The first `rows` samples as rows of a table of GENERATION_COLUMNS (what the loggers show)."""
        return [[g.prompt, g.response, g.score] for g in self.generations[:rows]]

    def write_jsonl(self, path: str) -> None:
        """Every sample with its score, a JSON object per line (verl's validation dump)."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.writelines(json.dumps(dataclasses.asdict(g)) + "\n" for g in self.generations)


def weights_source(model: ModelConfig, resume_dir: str | None, step: int) -> str:
    """Where a validation-only run's policy weights come from: the checkpoint it resumes, else model.checkpoint, else
    model.path."""
    if resume_dir:
        return f"the checkpoint {resume_dir} (step {step})"
    if model.checkpoint is not None:
        return f"model.checkpoint={model.checkpoint}"
    return f"model.path={model.path}" + (" (randomly initialised: model.random_init=true)" if model.random_init
                                         else "")


def validation_file(run_dir: str, step: int) -> str:
    """Where the validation at `step` writes every sample."""
    return os.path.join(run_dir, "validation", f"step_{step}.jsonl")


def validate(rollout: Callable[[list[Prompt], Sampling], list[Sample]], val_loader: PromptLoader,
             scorer: RewardScorer, tokenizer, cfg: Config, step: int) -> Validation:
    """One pass over the validation prompts through `rollout` (the run's rollout function): rollout.val_n answers
    each (greedy for one, sampled at rollout.temperature for more); rewards per data source, pass@k, and every
    sample."""
    n = cfg.rollout.val_n
    sources, scores, accuracies, decoded = [], [], [], []
    for batch_index, prompts in enumerate(val_loader.in_order()):
        sampling = Sampling(n, 0.0 if n == 1 else cfg.rollout.temperature, f"validation {batch_index}", step)
        samples = rollout(prompts, sampling)
        sources += [p.data_source for p in prompts]
        scored = scorer.submit_samples(samples, tokenizer).result()
        scores.append(scored.scores)
        accuracies.append(scored.acc)
        decoded += generations(samples, scored.scores.tolist(), tokenizer)
    return Validation(step, validation_metrics(sources, torch.cat(scores), torch.cat(accuracies), n), decoded)


def generations(samples: list[Sample], scores: list[float], tokenizer) -> list[Generation]:
    """The samples decoded, special tokens skipped (as verl's dumps decode them), each with its score."""
    prompts = tokenizer.batch_decode([s.prompt_ids for s in samples], skip_special_tokens=True)
    responses = tokenizer.batch_decode([s.response_ids for s in samples], skip_special_tokens=True)
    return [Generation(s.data_source, prompt, response, score)
            for s, prompt, response, score in zip(samples, prompts, responses, scores)]


def validation_metrics(data_sources: list[str], scores: torch.Tensor, acc: torch.Tensor,
                       n: int) -> dict[str, float]:
    """`val/<data_source>/reward_mean` over all samples; `val/<data_source>/acc`, the share of samples solved (on
    0-1 for every scorer: DAPO's scores are ±1, countdown gives 0.1 for format alone); and with n > 1 samples per
    prompt (prompt-major: sample j of prompt i at i * n + j) `val/<data_source>/pass@n`, the share of prompts with a
    solved sample. A sample is solved at its full accuracy (the scorer's "acc", else its score)."""
    scores_per_prompt = scores.reshape(-1, n)
    solved_per_prompt = (acc >= CORRECT).reshape(-1, n)
    groups: dict[str, list[int]] = defaultdict(list)
    for prompt, source in enumerate(data_sources):
        groups[source].append(prompt)
    metrics = {}
    for source, prompts in sorted(groups.items()):
        solved = solved_per_prompt[prompts]
        metrics[f"val/{source}/reward_mean"] = scores_per_prompt[prompts].mean().item()
        metrics[f"val/{source}/acc"] = solved.float().mean().item()
        if n > 1:
            metrics[f"val/{source}/pass@{n}"] = solved.any(dim=1).float().mean().item()
    return metrics
