"""The episodes of a user's agent (rollout.agent.function) as the rollout's trajectories: each runs the user's
function against its own base URL on the gateway, and becomes one sample.

    async def my_agent(base_url: str, row: dict) -> float | dict:      rollout.agent.function=my_pkg.agents:my_agent
        client = openai.AsyncOpenAI(base_url=base_url, api_key="none")
        ...                                                              # any harness, any number of calls
        return reward                                                    # or {"reward": r, "turns": 3, ...}

Episodes run concurrently (rollout.agent.max_concurrency), each under rollout.agent.timeout_s. One that raises, times
out or returns something else than a reward ends alone: it is logged with its row, counted (agent/episodes_failed),
and its sample joins no loss, or is trained with rollout.agent.failed_reward when set. The function runs in
rollout.agent.num_workers processes of its own (rl_megatron/agent_workers.py: the harness's CPU beside the gateway's),
or with 0 in the rollout's event loop; a plain (not async) function runs in a thread of its own there, so that a
blocking client cannot stall that loop.
"""
from __future__ import annotations

import asyncio
import logging
import math
import time
import weakref
from numbers import Real

from rl_megatron.agent_workers import AgentWorkerFailed, AgentWorkers, call_agent
from rl_megatron.agents.base import AgentContext, AgentLoop, TurnGenerator
from rl_megatron.agents.gateway.episode import Episode
from rl_megatron.agents.gateway.server import GatewayServer
from rl_megatron.batch import Prompt, Sample, SampleStatus

logger = logging.getLogger(__name__)


class AgentFailed(Exception):
    pass


class GatewayLoop(AgentLoop):
    def __init__(self, context: AgentContext, function, server: GatewayServer, max_model_len: int,
                 workers: AgentWorkers | None = None):
        super().__init__(context)
        self.function, self.server, self.max_model_len, self.workers = function, server, max_model_len, workers
        self.agent = context.rollout.agent
        self._slots = weakref.WeakKeyDictionary()  # event loop -> its semaphore: per rollout (each its own loop)

    async def run(self, prompt: Prompt, generate: TurnGenerator) -> Sample:
        self.server.start()  # binds the socket once, for the run
        loop = asyncio.get_running_loop()
        slots = self._slots.setdefault(loop, asyncio.Semaphore(self.agent.max_concurrency))
        async with self.server.serving(), slots:
            episode = Episode(prompt, generate, self.context, self.server.model, self.max_model_len)
            base_url = self.server.open(episode)
            start = time.perf_counter()
            try:
                reward, metrics = self._reward(await asyncio.wait_for(self._call(base_url, agent_row(prompt)),
                                                                      self.agent.timeout_s))
                failure = None
            except asyncio.TimeoutError:
                failure = f"timed out after rollout.agent.timeout_s={self.agent.timeout_s:g} s"
            except AgentWorkerFailed as error:  # in a worker process: its message names the error's type
                failure = str(error)
            except Exception as error:  # noqa: BLE001 - one episode's failure ends that episode only
                failure = f"{type(error).__name__}: {error}"
            finally:
                self.server.close_episode(episode)
                async with episode.lock:  # a call still in flight is recorded before the sample is taken
                    episode.end()
            episode.stats.seconds = time.perf_counter() - start
        if failure is not None:
            return self._failed(episode, prompt, failure)
        sample = episode.sample()
        sample.agent_reward = reward
        episode.stats.metrics = metrics
        return sample

    def close(self) -> None:
        self.server.close()
        if self.workers is not None:
            self.workers.close()

    async def _call(self, base_url: str, row: dict):
        if self.workers is not None:
            return await self.workers.run(base_url, row)
        return await call_agent(self.function, base_url, row)

    def _reward(self, result) -> tuple[float | None, dict[str, float]]:
        """The reward (None: the scorer's) and the metrics of what the function returned."""
        by_function = self.agent.reward == "function"
        metrics = dict(result) if isinstance(result, dict) else {}
        reward = metrics.pop("reward", None) if isinstance(result, dict) else result
        if not by_function:
            if reward is not None:
                raise AgentFailed(f"returned a reward ({reward!r}) but rollout.agent.reward=scorer scores the episode: "
                                  "return None or a dict of metrics, or set rollout.agent.reward=function")
        elif not (isinstance(reward, Real) and math.isfinite(reward)):
            raise AgentFailed(f"returned {_shown(result)}, not a reward: return a finite number, or a dict with "
                              "'reward' (and metrics), or set rollout.agent.reward=scorer")
        bad = [key for key, value in metrics.items() if not (isinstance(value, Real) and math.isfinite(value))]
        if bad:
            raise AgentFailed(f"returned metrics that are not finite numbers: {', '.join(map(repr, bad))}")
        return (float(reward) if by_function else None), {key: float(value) for key, value in metrics.items()}

    def _failed(self, episode: Episode, prompt: Prompt, failure: str) -> Sample:
        episode.stats.failed = True
        logger.warning("rollout.agent.function=%s: an episode of the row %s failed (%s)",
                       self.agent.function, _row_name(prompt), failure)
        if self.agent.failed_reward is None:  # kept empty: it joins no loss (0 in its group's baseline)
            sample = Sample.answering(prompt, [], [], status=SampleStatus.ABORTED, error=failure,
                                      agent_stats=episode.stats)
            sample.agent_reward = 0.0 if self.agent.reward == "function" else None
            return sample
        sample = episode.sample(failure)
        sample.agent_reward = self.agent.failed_reward
        return sample


def agent_row(prompt: Prompt) -> dict:
    """What the agent function gets of its row (verl's keys): the prompt (its messages, when it is a conversation),
    the ground truth, the data source and the extra info (a copy: the function may edit it)."""
    return {"prompt": prompt.messages, "ground_truth": prompt.ground_truth, "data_source": prompt.data_source,
            "extra_info": dict(prompt.extra_info)}


def _row_name(prompt: Prompt) -> str:
    index = prompt.extra_info.get("index") if isinstance(prompt.extra_info, dict) else None
    return f"index {index}" if index is not None else f"with ground truth {prompt.ground_truth!r}"


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
