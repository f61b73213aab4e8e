"""A generative judge (GenRM) scoring a batch's samples (judge.enable): a judge of its own (judge.model.path, on
vLLM engines of its own: `workers/rollout_worker.py::JudgeWorker`) or the policy's own engines read each (prompt,
response) in judge.prompt_template and write a verdict, greedy by default, right after the batch's rollout and in the
same thread (so, ahead of the trainer with trainer.rollout_staleness > 0, between two rollouts, never beside one);
with dynamic sampling each round as it is generated, and under streaming (a judge of its own only) each group as it
is scored, so that the filter and the queue read the rewards trained on;
the verdicts are parsed (`rl_megatron.rewards.judge`) into scores that enter the reward as judge.mode says. The
samples are decoded with the policy's tokenizer; the messages rendered and the verdicts decoded with the judge's.

The policy judging its own answers is verl's and OpenRLHF's "self-rewarding" setting, with the usual caveat that a
policy can drift towards answers its own judgements favour: judge.coef and mode=mixed keep a rule's signal beside it.

A verdict that cannot be read takes judge.failure_score and counts in judge/parse_failures; a message too long for
the engines (its tokens and judge.max_tokens past their max_model_len) is not sent, takes the same score and counts
in judge/too_long. Metrics: judge/score/* (of the scores trained on), judge/parse_failures, judge/too_long and
timing_s/judge (its verdicts' time, within the rollout's).
"""
from __future__ import annotations

import threading
import time
from contextlib import nullcontext

import torch

from rl_megatron.batch import Prompt, Sample
from rl_megatron.config.schema import Config
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.tokenizer import load_tokenizer
from rl_megatron.rewards.judge import (JUDGE_PATH_KEY, encode_message, judge_engine_settings, judge_message,
                                       parse_verdict)
from rl_megatron.roles import Role
from rl_megatron.rollout.engines import RolloutEngines, Sampling, round_purpose
from rl_megatron.trainer.rewards import ModelScores, Rewards
from rl_megatron.workers.worker_group import WorkerGroup

PURPOSE = "judge"  # its own request seeds: a sampled verdict never shares the policy's rollout seeds


class Judge:
    """Renders the samples' judge messages and scores their verdicts, on the engines `connect` gives it."""

    def __init__(self, cfg: Config, policy_tokenizer):
        self.settings, self.policy_tokenizer, self.seed = cfg.judge, policy_tokenizer, cfg.trainer.seed
        path = cfg.judge.model.path
        if path is None:  # a self-judge: the policy's engines, which read the policy's tokens
            self.tokenizer, self.max_model_len = policy_tokenizer, cfg.rollout.max_model_len
        else:
            self.tokenizer = load_tokenizer(path, JUDGE_PATH_KEY)
            self.max_model_len = judge_engine_settings(cfg, read_hf_config(path, JUDGE_PATH_KEY)).max_model_len
        self.engines: RolloutEngines | None = None
        # Streaming judges groups in threads of their own: one call on the engines at a time, so that every rank of
        # a judge engine runs the calls (and their collectives) in the same order.
        self.calls = threading.Lock()

    def connect(self, policy_engines: RolloutEngines, groups: dict[Role, WorkerGroup]) -> None:
        """Judge on the judge's own engines where it has them (`groups`' judge group), else on the policy's."""
        own = groups.get(Role.JUDGE)
        self.engines = policy_engines if own is None else RolloutEngines(own, self.seed)

    def message(self, sample: Sample) -> str:
        """The judge's user message for `sample`: its question (a chat prompt's last user message, else the prompt's
        text) and its response as text."""
        user = [m["content"] for m in sample.prompt_messages or () if m.get("role") == "user"]
        prompt = user[-1] if user else self.policy_tokenizer.decode(sample.prompt_ids, skip_special_tokens=True)
        response = self.policy_tokenizer.decode(sample.response_ids, skip_special_tokens=True)
        return judge_message(self.settings.prompt_template, prompt, response, sample.ground_truth)

    def scores(self, samples: list[Sample], step: int, round_: int = 1) -> ModelScores:
        """The judge's score of each of `samples` (judge.failure_score where it gave none); `round_`: the dynamic
        sampling round that generated them, whose verdicts are sampled with seeds of their own."""
        settings, started = self.settings, time.perf_counter()
        encoded = [encode_message(self.tokenizer, self.message(sample)) for sample in samples]
        fits = [i for i, ids in enumerate(encoded) if len(ids) + settings.max_tokens <= self.max_model_len]
        # With partial rollouts the policy's engines are not held for the whole rollout: a weight sync waits for the
        # verdicts through the gate, as for any other use of the engines.
        with self.calls, nullcontext() if self.engines.gate is None else self.engines.gate.use():
            sampling = Sampling(1, settings.temperature, round_purpose(PURPOSE, round_), step,
                                max_tokens=settings.max_tokens)
            verdicts = self.engines.generate([Prompt(encoded[i], PURPOSE, None) for i in fits],
                                             sampling) if fits else []
        parsed = {i: parse_verdict(self.tokenizer.decode(verdict.response_ids, skip_special_tokens=True),
                                   settings.parser, settings.json_field) for i, verdict in zip(fits, verdicts)}
        scores = [settings.failure_score if parsed.get(i) is None else parsed[i] / settings.score_scale
                  for i in range(len(samples))]
        stats = {"judge/parse_failures": float(sum(value is None for value in parsed.values())),
                 "judge/too_long": float(len(samples) - len(fits)), "timing_s/judge": time.perf_counter() - started}
        return ModelScores("judge", torch.tensor(scores, dtype=torch.float32), settings, stats)
