"""The controller's handle on the rollout engines, which a rollout function (`rollout.function`) calls."""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from rl_megatron.batch import Prompt, Sample
from rl_megatron.rollout.completions import Completion, TurnRequest
from rl_megatron.rollout.engine import request_seeds
from rl_megatron.rollout.gate import EngineGate
from rl_megatron.rollout.serving import Pausing

# Partial rollouts: an engine's decoding returns to the controller at least this often (scheduler steps), so that a
# weight update waits at most this long for it to pause.
PAUSE_STEPS = 8


@dataclass(frozen=True)
class Sampling:
    """How one rollout call samples: `n` answers per prompt at `temperature` (0: greedy), with seeds drawn from
    (trainer.seed, `purpose`, `step`) alone, so that a resumed run samples as the original did."""
    n: int
    temperature: float
    purpose: str  # "train", or "validation <batch>"
    step: int
    trained_version: int | None = None  # the policy version the batch is trained with (None: not trained)
    max_tokens: int | None = None  # each answer's token budget (None: rollout.max_tokens)


def round_purpose(purpose: str, round_: int) -> str:
    """The purpose of a dynamic-sampling round's requests (`Sampling.purpose`): round 1 keeps `purpose`, each later
    round gets seeds of its own."""
    return purpose if round_ == 1 else f"{purpose} round {round_}"


class RolloutEngines:
    """`generate` spreads prompts over the engines (a worker group hosting them) and returns their samples, each
    stamped with the policy version the engines hold (`weight_version`, kept current by the trainer's weight syncs).
    `run_agent_loop` runs rollout.agent_loop's trajectories instead (`agent_runner`, set by the trainer when the
    loop is not single_turn, or for partial rollouts), through `serve`. With partial rollouts (`gate` given), a weight
    sync may interrupt `serve`'s requests (`pausing`), at `sync_at_tokens` when given."""

    def __init__(self, group, run_seed: int, gate: EngineGate | None = None, sync_at_tokens: int | None = None):
        self.group, self.run_seed, self.gate, self.sync_at_tokens = group, run_seed, gate, sync_at_tokens
        self.count = group.meshes[0]["rollout"][1]  # engines
        self.weight_version = 0
        self.agent_runner = None  # an rl_megatron.agents.AgentRunner

    def pausing(self) -> Pausing | None:
        """What the turn scheduler needs to let weight updates in mid-generation (partial rollouts)."""
        return None if self.gate is None else Pausing(self.gate, self.interrupt, lambda: self.weight_version,
                                                      self.sync_at_tokens)

    def generate(self, prompts: list[Prompt], sampling: Sampling) -> list[Sample]:
        """`sampling.n` samples per prompt, prompt-major (sample j of prompt i at i * n + j)."""
        padded = prompts + prompts[:1] * (-len(prompts) % self.count)  # every engine gets as many prompts
        seeds = request_seeds(self.run_seed, sampling.purpose, sampling.step, len(padded))
        samples = self.group.generate(padded, seeds, n=sampling.n, temperature=sampling.temperature,
                                      max_tokens=sampling.max_tokens)
        samples = samples[:len(prompts) * sampling.n]
        return self.stamped(samples)

    def run_agent_loop(self, prompts: list[Prompt], sampling: Sampling) -> list[Sample]:
        """`sampling.n` trajectories per prompt through the agent loop, prompt-major."""
        seeds = request_seeds(self.run_seed, sampling.purpose, sampling.step, len(prompts))
        self.group.prepare_generation()  # every engine awake with the policy's weights, before any engine is driven
        samples = self.agent_runner.run(prompts, seeds, sampling.n, sampling.temperature,
                                        tag=f"{sampling.purpose}/{sampling.step}",
                                        awaited_version=sampling.trained_version)
        return self.stamped(samples)

    async def serve(self, engine: int, requests: list[TurnRequest]) -> list[tuple[str, Completion]]:
        """Engine `engine`'s `RolloutEngine.serve` (on each of its shards; the first's result)."""
        return await self.group.call_shard("serve", "rollout", engine, requests,
                                           None if self.gate is None else PAUSE_STEPS)

    async def interrupt(self, engine: int) -> list[tuple[str, Completion]]:
        """Engine `engine`'s `RolloutEngine.interrupt` (partial rollouts)."""
        return await self.group.call_shard("interrupt", "rollout", engine)

    def stamped(self, samples: list[Sample]) -> list[Sample]:
        for sample in samples:
            if sample.token_versions is None:  # else its tokens' versions set it
                sample.policy_version = self.weight_version
        return samples


# fn(engines, prompts, sampling) -> len(prompts) * sampling.n samples, prompt-major: what rollout.function names.
RolloutFn = Callable[[RolloutEngines, list[Prompt], Sampling], list[Sample]]
