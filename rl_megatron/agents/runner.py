"""A batch of prompts through the run's agent loop: `rollout.n` trajectories per prompt, all in flight at once over
the engines, each checked when it comes back."""
from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Callable, Coroutine

import numpy as np

from rl_megatron.agents.base import AgentLoop
from rl_megatron.batch import Prompt, Sample, SampleStatus
from rl_megatron.rollout.completions import Completion, TurnRequest
from rl_megatron.rollout.serving import Pausing, ServeFn, TurnScheduler

logger = logging.getLogger(__name__)


def turn_seed(prompt_seed: int, sample: int, turn: int) -> int:
    """The sampling seed of one generation: a function of the prompt's seed (trainer.seed, purpose, step, prompt),
    the sample's index among the prompt's n and the turn, and of nothing else."""
    return int(np.random.SeedSequence([prompt_seed, sample, turn]).generate_state(1, dtype=np.uint32)[0])


class AgentRunner:
    def __init__(self, loop: AgentLoop, name: str, serve: ServeFn, engines: int, vocab_size: int,
                 turn_synchronous: bool = False, pausing: Pausing | None = None):
        self.loop, self.name, self.serve, self.engines = loop, name, serve, engines
        self.vocab_size, self.turn_synchronous, self.pausing = vocab_size, turn_synchronous, pausing

    def run(self, prompts: list[Prompt], seeds: list[int], n: int, temperature: float, tag: str,
            awaited_version: int | None = None) -> list[Sample]:
        """`n` trajectories per prompt, prompt-major; prompt i's draw from seeds[i]. `tag` makes the engines'
        request ids unique (the purpose and step); with partial rollouts, `awaited_version` is the policy version the
        batch is trained with (where a fixed sync point waits for it). A trajectory whose loop raises or returns a
        bad sample is logged with its index and kept as an empty, ABORTED sample carrying the error (it joins no
        loss)."""
        scheduler = self.scheduler(awaited_version)
        trajectories = [self.trajectory(scheduler, prompts[index // n], seeds[index // n], index % n, temperature,
                                        f"{tag}/{index}", index % self.engines) for index in range(len(prompts) * n)]
        results = asyncio.run(scheduler.run(trajectories))
        return [self.checked(index, result, prompts[index // n]) for index, result in enumerate(results)]

    def scheduler(self, awaited_version: int | None = None) -> TurnScheduler:
        """A turn scheduler over the engines (with partial rollouts, awaiting `awaited_version` at a fixed sync
        point, if any)."""
        pausing = None if self.pausing is None else self.pausing.awaiting(awaited_version)
        return TurnScheduler(self.serve, self.engines, self.turn_synchronous, pausing)

    def trajectory(self, scheduler: TurnScheduler, prompt: Prompt, prompt_seed: int, sample: int, temperature: float,
                   request_tag: str, engine: int) -> Callable[[], Coroutine]:
        """Sample `sample` of `prompt` through the loop on `engine`, as a coroutine to build: its turns are requests
        `<request_tag>/<turn>`, each drawing from a seed of (prompt_seed, sample, turn)."""
        turns = itertools.count()

        async def generate(token_ids: list[int], max_tokens: int | None = None) -> Completion:
            turn = next(turns)
            request = TurnRequest(f"{request_tag}/{turn}", list(token_ids), turn_seed(prompt_seed, sample, turn),
                                  max_tokens or self.loop.context.rollout.max_tokens, temperature)
            return await scheduler.generate(engine, request)

        return lambda: self.loop.run(prompt, generate)

    def checked(self, index: int, result, prompt: Prompt) -> Sample:
        problem = self._problem(result)
        if problem is None:
            return result
        logger.warning("rollout.agent_loop=%s: sample %d failed (%s); it is kept empty and joins no loss",
                       self.name, index, problem)
        return Sample.answering(prompt, [], [], status=SampleStatus.ABORTED, error=problem)

    def _problem(self, result) -> str | None:
        if isinstance(result, Exception):
            return f"{type(result).__name__}: {result}"
        if not isinstance(result, Sample):
            return f"returned a {type(result).__name__}, not a rl_megatron.batch.Sample"
        if not len(result.loss_mask) == len(result.rollout_log_probs) == len(result.response_ids):
            return (f"a response of {len(result.response_ids)} tokens with a loss mask of {len(result.loss_mask)} and "
                    f"{len(result.rollout_log_probs)} log-probs")
        outside = [t for t in result.prompt_ids + result.response_ids if not 0 <= t < self.vocab_size]
        if outside:
            return f"token ids outside the vocabulary of {self.vocab_size}: {outside[:5]}"
        if any(m not in (0, 1) for m in result.loss_mask):
            return "a loss mask with values other than 0 and 1"
        return None
