"""The default rollout function (`rollout.function`): every prompt answered `sampling.n` times in one generation.

A rollout function turns a batch of prompts into samples: `fn(engines, prompts, sampling) -> list[Sample]`, with
`len(prompts) * sampling.n` samples, prompt-major (the samples of a prompt are adjacent: GRPO groups them). It runs
in the controller and may call `engines.generate` as often as it likes (a multi-turn agent loop calls it once per
turn), edit the samples (e.g. put 0 in `loss_mask` under tokens the policy did not generate), or drop a sample's
answer by setting its status to ABORTED.
"""
from __future__ import annotations

from rl_megatron.batch import Prompt, Sample
from rl_megatron.rollout.engines import RolloutEngines, Sampling


def generate(engines: RolloutEngines, prompts: list[Prompt], sampling: Sampling) -> list[Sample]:
    return engines.generate(prompts, sampling)
