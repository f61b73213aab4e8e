"""The default rollout function (`rollout.function`): rollout.agent_loop's trajectories. With single_turn (the
default) every prompt is answered `sampling.n` times in one batched generation; with an agent loop (tool_agent, or
a user's) every trajectory runs its own turns, all at once over the engines (`rl_megatron.agents`).

A rollout function turns a batch of prompts into samples: `fn(engines, prompts, sampling) -> list[Sample]`, with
`len(prompts) * sampling.n` samples, prompt-major (the samples of a prompt are adjacent: GRPO groups them). It runs
in the controller and may call `engines.generate` (or `engines.run_agent_loop`) as often as it likes, edit the
samples (e.g. put 0 in `loss_mask` under tokens the policy did not generate), or drop a sample's answer by setting
its status to ABORTED.
"""
from __future__ import annotations

from rl_megatron.batch import Prompt, Sample
from rl_megatron.rollout.engines import RolloutEngines, Sampling


def generate(engines: RolloutEngines, prompts: list[Prompt], sampling: Sampling) -> list[Sample]:
    if engines.agent_runner is None:
        return engines.generate(prompts, sampling)
    return engines.run_agent_loop(prompts, sampling)
