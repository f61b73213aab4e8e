"""What an engine returns per sampled response (`Completion`) and what an agent loop's turn asks of it
(`TurnRequest`): a leaf module, so that the agent loops need nothing of the engine's own module."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from rl_megatron.batch import SampleStatus, known_routing_then


@dataclass
class Completion:
    """One sampled response: its tokens, their log-probs (after temperature), and how it ended; with partial rollouts
    also the policy version that sampled each token (a response continued across a weight update has two); with
    moe.engine_routing the experts of each position the engine fed, prompt included (`rollout/routing_capture.py`)."""
    response_ids: list[int]
    log_probs: list[float]
    status: SampleStatus
    versions: list[int] | None = None
    routed_experts: np.ndarray | None = field(default=None, compare=False)  # [prompt + response - 1, MoE layers,
    # top-k] int16

    def followed_by(self, rest: Completion) -> Completion:
        """This response continued by `rest` (sampled after it, from this response's end): how `rest` ended. Each
        position keeps the routing of the request that fed it first (the weights that sampled what follows it)."""
        return Completion(self.response_ids + rest.response_ids, self.log_probs + rest.log_probs, rest.status,
                          self.versions + rest.versions, known_routing_then(self.routed_experts, rest.routed_experts))


FINISH_STATUS = {"length": SampleStatus.TRUNCATED, "abort": SampleStatus.ABORTED}  # vLLM's finish_reason; else OK


def completion_of(output, routed_experts: np.ndarray | None = None) -> Completion:
    """A vLLM CompletionOutput as a Completion (with its routing, when the engine returns it)."""
    return sampled(output.token_ids, output.logprobs, FINISH_STATUS.get(output.finish_reason, SampleStatus.OK),
                   routed_experts)


def sampled(token_ids, logprobs, status: SampleStatus, routed_experts: np.ndarray | None = None) -> Completion:
    """A Completion of the tokens vLLM sampled and its log-probs of them (a list per position, indexed by token)."""
    ids = list(token_ids)
    log_probs = [step[token].logprob for step, token in zip(logprobs, ids)]
    return Completion(ids, log_probs, status, routed_experts=routed_experts)


@dataclass(frozen=True)
class TurnRequest:
    """One generation of a multi-turn trajectory: the whole context so far, and its own seed (a trajectory samples
    alike whichever engine serves it and whatever else that engine decodes meanwhile)."""
    request_id: str
    token_ids: list[int]
    seed: int
    max_tokens: int
    temperature: float
