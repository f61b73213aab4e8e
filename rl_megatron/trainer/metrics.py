"""What a step reports: its timings, and the metrics of its batch (verl's names)."""
from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from rl_megatron.algorithms import masked_mean, reverse_kl, rollout_correction_metrics, rollout_mismatch_metrics
from rl_megatron.batch import Sample, SampleStatus, TrainBatch
from rl_megatron.config.schema import AlgorithmConfig
from rl_megatron.trainer.validation import Validation, validation_file

REWARD_WINDOW = 5  # steps averaged for early stopping and the final summary


@dataclass(frozen=True)
class RunSummary:
    """What a run reports at its end (the console's summary)."""
    steps: int  # RL steps the run's reward history holds (a resumed run's earlier ones included)
    reward_first: float  # mean reward of the first REWARD_WINDOW steps
    reward_last: float  # and of the last
    reward_window: int  # steps in those windows (fewer in a short run)
    run_dir: str
    training_started: float  # time.time() when the workers were ready: what came before is start-up
    validation: Validation | None  # the last validation's, if any
    resumed_at: int = 0  # steps the checkpoint this run resumed from had trained: not this run's

    @classmethod
    def of(cls, reward_history: list[float], run_dir: str, training_started: float,
           validation: Validation | None, resumed_at: int = 0) -> RunSummary:
        """The summary of a run whose steps had the mean rewards `reward_history` (a validation-only run of weights
        that never trained has none: NaN means)."""
        first = reward_history[:REWARD_WINDOW]
        first_mean, last_mean = ((sum(first) / len(first), window_mean(reward_history)) if first
                                 else (float("nan"), float("nan")))
        return cls(len(reward_history), first_mean, last_mean, len(first), run_dir, training_started, validation,
                   resumed_at)

    @property
    def validation_path(self) -> str:
        """Where the last validation wrote its samples."""
        return validation_file(self.run_dir, self.validation.step)


class Timer:
    def __init__(self):
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, phase: str):
        start = time.perf_counter()
        yield
        self.seconds[phase] = time.perf_counter() - start


def step_metrics(samples: list[Sample], scores: torch.Tensor, batch: TrainBatch, seconds: dict[str, float],
                 algorithm: AlgorithmConfig) -> dict[str, float]:
    """The batch's metrics, after the update: the old log-probs and the entropy are known by then, from a pass of
    their own or from the update's forward pass (`old_log_probs.py`)."""
    mask, correction = batch.response_mask, algorithm.rollout_correction
    tokens = sum(len(s.prompt_ids) + len(s.response_ids) for s in samples)
    metrics = {
        "reward/mean": scores.mean().item(),
        "reward/std": scores.std().item(),
        **length_metrics(samples),
        **multi_turn_metrics(samples),
        **agent_metrics(samples),
        "actor/entropy": masked_mean(batch.entropy, mask).item(),
        "critic/advantages/mean": masked_mean(batch.advantages, mask).item(),
        # vLLM's sampling log-probs against Megatron's for the same tokens (1 and 0 when both agree).
        **rollout_mismatch_metrics(batch.old_log_probs, batch.rollout_log_probs, mask),
        **{f"timing_s/{phase}": s for phase, s in seconds.items()},
        "perf/tokens_per_s": tokens / seconds["step"],
    }
    if batch.teacher_log_probs is not None:  # on-policy distillation: how far the policy is from the teacher
        metrics["distill/reverse_kl"] = reverse_kl(batch.old_log_probs, batch.teacher_log_probs, mask)
    if correction.level is not None:  # the weights the update applied (computed again: cheap, and no transfer)
        metrics |= rollout_correction_metrics(batch.old_log_probs, batch.rollout_log_probs, mask, correction.level,
                                              correction.mode, correction.threshold)
    if batch.values is not None:
        values, returns = batch.values, batch.returns
        residual_var = torch.var((returns - values)[mask.bool()])
        metrics.update({"critic/values/mean": masked_mean(values, mask).item(),
                        "critic/returns/mean": masked_mean(returns, mask).item(),
                        # 1 - Var(returns - values) / Var(returns): how much of the returns the critic predicts.
                        "critic/vf_explained_var": (1 - residual_var / torch.var(returns[mask.bool()])).item()})
    return metrics


def length_metrics(samples: list[Sample]) -> dict[str, float]:
    """Response and prompt lengths in tokens, and the share of responses cut off at rollout.max_tokens (or at
    rollout.max_model_len, or at a multi-turn limit): vLLM's finish reason or the agent loop's, recorded as the
    sample's status. A response whose stop token falls exactly on the limit is not cut off (vLLM checks for the stop
    token first). A response's length counts the model's tokens only, not the tools' (a length penalty must not
    punish a tool's long reply)."""
    responses = torch.tensor([s.model_tokens() for s in samples], dtype=torch.float)
    prompts = torch.tensor([len(s.prompt_ids) for s in samples], dtype=torch.float)
    clipped = sum(s.status == SampleStatus.TRUNCATED for s in samples)
    return {"response_length/mean": responses.mean().item(), "response_length/max": responses.max().item(),
            "response_length/min": responses.min().item(), "response_length/clip_ratio": clipped / len(samples),
            "prompt_length/mean": prompts.mean().item(), "prompt_length/max": prompts.max().item(),
            "prompt_length/min": prompts.min().item()}


def multi_turn_metrics(samples: list[Sample]) -> dict[str, float]:
    """Turns and tool calls of multi-turn samples (none for single-turn ones); verl's multi_turn/ names. Tool errors,
    timeouts and failed samples are counts over the step."""
    tools = [s.tool_stats for s in samples if s.tool_stats is not None]
    failed = sum(s.error is not None for s in samples)
    if not tools and not failed:
        return {}
    turns = torch.tensor([float(s.turns) for s in samples])
    mean = lambda values: sum(values) / len(samples)  # noqa: E731
    return {"multi_turn/turns/mean": turns.mean().item(), "multi_turn/turns/max": turns.max().item(),
            "multi_turn/tool_tokens/mean": mean([t.tokens for t in tools]),
            "multi_turn/failed": float(failed),
            "tool/calls/mean": mean([t.calls for t in tools]),
            "tool/call_rate": sum(t.calls > 0 for t in tools) / len(samples),
            "tool/errors": float(sum(t.errors for t in tools)),
            "tool/timeouts": float(sum(t.timeouts for t in tools)),
            "tool/seconds/mean": mean([t.seconds for t in tools]),
            "tool/slot_wait_s/mean": mean([t.slot_wait_seconds for t in tools])}


def agent_metrics(samples: list[Sample]) -> dict[str, float]:
    """Episodes of a user's agent through the gateway (rollout.agent.function): calls, prefix breaks (the harness's
    history stopped extending what was sampled), segments (samples) per episode, wall time, failures (a count over
    the step), and the means of the metrics the agents returned."""
    stats = [s.agent_stats for s in samples if s.agent_stats is not None]
    if not stats:
        return {}
    mean = lambda values: sum(values) / len(stats)  # noqa: E731
    metrics = {"agent/calls_per_episode": mean([a.calls for a in stats]),
               "agent/prefix_breaks": float(sum(a.prefix_breaks for a in stats)),
               "agent/segments_per_episode": mean([a.segments for a in stats]),
               "agent/episode_s": mean([a.seconds for a in stats]),
               "agent/episode_s_max": max(a.seconds for a in stats),
               "agent/episodes_failed": float(sum(a.failed for a in stats))}
    for key in sorted({key for a in stats for key in a.metrics}):
        values = [a.metrics[key] for a in stats if key in a.metrics]
        metrics[f"agent/{key}"] = sum(values) / len(values)
    return metrics


def window_mean(rewards: list[float]) -> float:
    """The mean reward of the last REWARD_WINDOW steps."""
    recent = rewards[-REWARD_WINDOW:]
    return sum(recent) / len(recent)


def reached_target(rewards: list[float], target: float | None) -> bool:
    return target is not None and len(rewards) >= REWARD_WINDOW and window_mean(rewards) >= target
