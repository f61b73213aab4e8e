"""trainer.rollout_data_dir: every training step's samples on disk, `<dir>/<step>.jsonl` (verl's key and file names),
a JSON object per sample: what the policy wrote, what the scorer or the user's agent gave it, the reward and the
advantage it was trained with, and which policy version sampled it. Put together in the step; serialised and
written in a thread of their own, each file through a temporary one renamed into place, so that a crash never leaves
half a file. A resumed run writes the steps after its checkpoint again, as the loggers record them again
(`Tracker`)."""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
from concurrent.futures import Future, ThreadPoolExecutor

from rl_megatron.algorithms import masked_mean
from rl_megatron.batch import Sample, TrainBatch
from rl_megatron.checkpoint.atomic import replace_file
from rl_megatron.trainer.rewards import Rewards
from rl_megatron.trainer.validation import Generation, generations

STEP_FILE = re.compile(r"(\d+)\.jsonl")
# Keys a record holds only where they apply: reward shaping, a user's agent, partial rollouts, multi-turn loops, a
# sample the rollout could not produce or that was too stale to train. A model that scored the samples (a reward model,
# a judge) adds its score as <section>_score.
OPTIONAL_KEYS = ("overlong_penalty", "agent_reward", "token_versions", "messages", "tool_stats", "agent_stats",
                 "error")


def step_file(folder: str, step: int) -> str:
    """Where step `step`'s samples go."""
    return os.path.join(folder, f"{step}.jsonl")


def sequence_advantages(batch: TrainBatch) -> list[float | None]:
    """Each row's advantage: the mean over the tokens it trains (the loss mask's ones), which for the outcome
    estimators (GRPO, RLOO, ...) is the one value all of them hold; None for a row that trains no token."""
    means = masked_mean(batch.advantages.float(), batch.response_mask, dim=1).tolist()
    return [None if math.isnan(mean) else mean for mean in means]


def sample_record(step: int, generation: Generation, sample: Sample, acc: float, penalty: float | None,
                  sources: dict[str, float], advantage: float | None) -> dict:
    """One sample's record: `generation`'s keys (a validation record's), then what it was trained with (`sources`:
    each scoring model's score, by its section)."""
    versions = sample.token_versions
    record = {"step": step, **vars(generation), "ground_truth": sample.ground_truth, "acc": acc,
              "overlong_penalty": penalty, **{f"{name}_score": score for name, score in sources.items()},
              "agent_reward": sample.agent_reward, "advantage": advantage,
              "status": sample.status.value, "model_tokens": sample.model_tokens(),
              "policy_version": sample.policy_version,
              "token_versions": [min(versions), max(versions)] if versions else None, "turns": sample.turns,
              "messages": sample.messages, "tool_stats": _as_dict(sample.tool_stats),
              "agent_stats": _as_dict(sample.agent_stats), "error": sample.error}
    return {key: value for key, value in record.items() if value is not None or key not in OPTIONAL_KEYS}


def _as_dict(stats) -> dict | None:
    return None if stats is None else dataclasses.asdict(stats)


def write_records(path: str, records: list[dict]) -> None:
    """`records` as JSON lines, replacing `path` whole (a value JSON cannot hold, e.g. a ground truth of another type,
    as its str)."""
    replace_file(path, "".join(json.dumps(record, ensure_ascii=False, default=str) + "\n" for record in records))


class RolloutRecords:
    """Writes each step's records into `folder` (None: nothing), one step's file at a time in a thread of its own;
    a failed write raises at the next step or at the end. `purge_after`, as the Tracker's: the files of the steps
    after it are deleted at the start (-1: every step's; None: none)."""

    def __init__(self, folder: str | None, tokenizer, purge_after: int | None):
        self.folder, self.tokenizer = folder, tokenizer
        self._writer = ThreadPoolExecutor(1, thread_name_prefix="rollout-records")
        self._writing: Future | None = None
        if folder is None:
            return
        os.makedirs(folder, exist_ok=True)
        if purge_after is None:
            return
        for name in os.listdir(folder):
            match = STEP_FILE.fullmatch(name)
            if match and int(match[1]) > purge_after:
                os.remove(os.path.join(folder, name))

    def write(self, step: int, samples: list[Sample], order: list[int], rewards: Rewards, batch: TrainBatch) -> None:
        """Step `step`'s samples, each with its reward as trained (`Sample.reward`), trained in `order` (sample i was
        the rollout's `order[i]`), written prompt-major: a prompt's samples together, as generated."""
        if self.folder is None:
            return
        decoded = generations(samples, [sample.reward for sample in samples], self.tokenizer)
        penalties = [None] * len(samples) if rewards.penalty is None else rewards.penalty.tolist()
        sources = [dict(zip(rewards.sources, row)) for row in zip(*(s.tolist() for s in rewards.sources.values()))
                   ] if rewards.sources else [{}] * len(samples)
        records = [sample_record(step, *row) for row in zip(decoded, samples, rewards.acc.tolist(), penalties, sources,
                                                            sequence_advantages(batch))]
        prompt_major = [records[row] for row in sorted(range(len(order)), key=order.__getitem__)]
        self.wait()
        self._writing = self._writer.submit(write_records, step_file(self.folder, step), prompt_major)

    def wait(self) -> None:
        """Until the last step's file is written (raising what its write raised)."""
        if self._writing is not None:
            self._writing.result()
            self._writing = None

    def __enter__(self) -> RolloutRecords:
        return self

    def __exit__(self, *exc_info) -> None:
        try:
            self.wait()
        finally:
            self._writer.shutdown()
