"""The agent-loop interface: one trajectory per call, a coroutine, over an asynchronous `generate` handle.

    class MyLoop(AgentLoop):                                   rollout.agent_loop=my_pkg.loops:MyLoop
        async def run(self, prompt, generate) -> Sample:
            completion = await generate(prompt.ids)            # the model's tokens, log-probs, how the turn ended
            ...                                                # tools, environments, user simulators
            return trajectory.sample(status)                   # loss mask 1 on the model's tokens, 0 elsewhere

Many trajectories run at once: while one awaits a tool, the engines keep decoding the others (`TurnScheduler`).
A loop samples at the run's temperature (the trainer's log-probs assume it) and each of its generations draws from
a seed of its own (trainer.seed, the step, the sample and the turn), so a resumed run replays the same rollouts.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

from rl_megatron.agents.harmony_deltas import HarmonyDeltas
from rl_megatron.agents.trajectory import ChatDeltas
from rl_megatron.batch import Prompt, Sample
from rl_megatron.config.choices import SINGLE_TURN
from rl_megatron.config.schema import RolloutConfig
from rl_megatron.registry import Registry
from rl_megatron.rollout.completions import Completion
from rl_megatron.tools import ToolSet


class TurnGenerator(Protocol):
    async def __call__(self, token_ids: list[int], max_tokens: int | None = None) -> Completion:
        """The model's continuation of `token_ids`, up to `max_tokens` (default rollout.max_tokens) new tokens."""


@dataclass(frozen=True)
class AgentContext:
    """What every trajectory of a run shares: the tokenizer, the rollout settings (rollout.multi_turn's limits), the
    tools (None without rollout.multi_turn.tool_config_path) and the chat template's deltas (HarmonyDeltas for
    gpt-oss's harmony format, whose tool messages carry the `name` of the function they answer)."""
    tokenizer: Any
    rollout: RolloutConfig
    tools: ToolSet | None
    deltas: ChatDeltas | HarmonyDeltas | None  # as rollout.multi_turn.format says; None for SingleTurnLoop (no turn
    # follows)


class AgentLoop:
    """Subclass it and implement `run`; rollout.agent_loop names the class ("pkg.module:Class"), or the name it is
    registered under (`register_agent_loop`)."""

    def __init__(self, context: AgentContext):
        self.context = context

    async def run(self, prompt: Prompt, generate: TurnGenerator) -> Sample:
        raise NotImplementedError

    def close(self) -> None:
        """Release what the loop holds for the run (the gateway's server); called once, at the run's end."""


class SingleTurnLoop(AgentLoop):
    """One generation per trajectory, through the turn scheduler rather than one batched call: what partial rollouts
    need for single-turn tasks (a request can be interrupted by a weight update and continued)."""

    async def run(self, prompt: Prompt, generate: TurnGenerator) -> Sample:
        completion = await generate(prompt.ids, self.response_limit(prompt))
        return Sample.answering(prompt, completion.response_ids, completion.log_probs, status=completion.status,
                                token_versions=completion.versions, routed_experts=completion.routed_experts)

    def response_limit(self, prompt: Prompt) -> int | None:
        """The most tokens this trajectory's answer may have (None: rollout.max_tokens)."""
        return None


# The agent loops rollout.agent_loop names: single_turn (no loop: each prompt answered in one batched generation) and
# the registered AgentLoop subclasses.
AGENT_LOOPS: Registry[type[AgentLoop] | None] = Registry(
    "agent loop", "rollout.agent_loop",
    "register yours with @rl_megatron.agents.register_agent_loop({name!r}) on an AgentLoop subclass in a module "
    "listed in trainer.imports, or name the subclass as 'package.module:Class'")
AGENT_LOOPS.add(SINGLE_TURN, None)


def register_agent_loop(name: str):
    """Register an AgentLoop subclass under `name`, for rollout.agent_loop to name."""
    return AGENT_LOOPS.register(name)
