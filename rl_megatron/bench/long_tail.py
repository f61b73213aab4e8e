"""The long-tailed workload of `python -m rl_megatron.bench async --workload long_tail` (issue 54): the demo's
prompts answered at response lengths drawn log-normally, so that a batch waits for a few answers about ten times
the median, as reasoning and agent rollouts do.

    rollout.agent_loop=rl_megatron.bench.long_tail:LongTailLoop rollout.ignore_eos=true

Each answer's length is drawn (sigma 1 on the log scale, median rollout.max_tokens / 12, capped at
rollout.max_tokens: about 1 answer in 100 reaches ten times the median) and the engine decodes exactly that many
tokens (ignore_eos). The draws depend on the prompt's tokens and on how many answers of that prompt the run drew
before, so two runs of the same steps draw the same lengths (the n answers of a prompt among themselves in
whichever order their trajectories start).
"""
from __future__ import annotations

import math
import random
import zlib
from collections import Counter

from rl_megatron.agents.base import AgentContext, SingleTurnLoop
from rl_megatron.batch import Prompt

SIGMA = 1.0
MEDIAN_DIVISOR = 12  # the median length: rollout.max_tokens / this, so that 10x the median fits under the cap


def response_length(key: int, draw: int, max_tokens: int) -> int:
    """The `draw`-th length drawn for the prompt `key`: log-normal around max_tokens / MEDIAN_DIVISOR, 1 to
    max_tokens."""
    median = max(1.0, max_tokens / MEDIAN_DIVISOR)
    z = random.Random(key * 1_000_003 + draw).gauss(0.0, 1.0)
    return min(max_tokens, max(1, round(median * math.exp(SIGMA * z))))


class LongTailLoop(SingleTurnLoop):
    """A single-turn answer whose length is drawn log-normally (`response_length`)."""

    def __init__(self, context: AgentContext):
        super().__init__(context)
        self.drawn: Counter[int] = Counter()  # draws so far, by prompt

    def response_limit(self, prompt: Prompt) -> int:
        key = zlib.crc32(str(prompt.ids).encode())
        draw, self.drawn[key] = self.drawn[key], self.drawn[key] + 1
        return response_length(key, draw, self.context.rollout.max_tokens)
