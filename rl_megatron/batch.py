"""The data of a step, typed: what the rollout hands to the rewards and the Megatron workers, and what they return.

    Prompt      one row of the data: token ids, data source, ground truth, extra info (and its chat messages)
    Sample      one trajectory: a prompt, the response the engine sampled, its log-probs, a per-token loss mask,
                how it ended, which policy version made it, and (once scored) its reward; a multi-turn one also
                its turns, its conversation and its tool statistics
    TrainBatch  the samples as right-padded [B, S] tensors, plus what the step adds (log-probs, values, advantages)
    TokenOutputs what a forward pass returns per token (log-probs, entropy, values)
    PolicyUpdate what the actor's update returns: its metrics (and, on-policy, its forward pass's log-probs)

Position t of every per-token tensor refers to the token at t + 1, i.e. the label predicted at position t: a
response of R tokens after a prompt of P tokens occupies label positions P-1 .. P+R-2.

A leaf module: it imports nothing from the project, so every package can use it.
"""
from __future__ import annotations

import dataclasses
import enum
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

UNROUTED = -1  # a position without routing in `routed_experts` (the engine never fed it, or padding)


@dataclass
class Prompt:
    ids: list[int]
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    messages: list[dict] | None = None  # the row's chat messages, when its prompt is a conversation


class SampleStatus(str, enum.Enum):
    OK = "ok"  # the response ended with a stop token
    TRUNCATED = "truncated"  # the response ran into rollout.max_tokens
    ABORTED = "aborted"  # generation was cut off (e.g. a stopped multi-turn episode); the sample may be partial


@dataclass
class AgentStats:
    """What one episode of a user's agent did through the gateway (`rl_megatron.agents.gateway`): its calls, the times
    the harness's history stopped extending what the episode had sampled (each starts a new segment of its sample),
    its wall time, whether it failed, and the metrics its function returned beside the reward."""
    calls: int = 0
    prefix_breaks: int = 0
    segments: int = 1
    seconds: float = 0.0
    failed: bool = False
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class ToolStats:
    """What a trajectory's tool calls did: calls made (well-formed or not), the failed ones (errors, which include the
    timed-out ones), the tokens the tools' replies added to the response, and the seconds spent waiting on tools (and
    of those calls, for a free slot)."""
    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    tokens: int = 0
    seconds: float = 0.0
    slot_wait_seconds: float = 0.0  # of the calls' time, waiting for a tool's slot (its rate_limit), summed
    by_tool: dict[str, int] = field(default_factory=dict)  # well-formed calls per tool name


@dataclass
class Sample:
    """One trajectory. `loss_mask` has one entry per response token: 1 where the token is the policy's own (it joins
    the loss), 0 where it is not (e.g. a tool's output spliced into a multi-turn response)."""
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]  # the engine's log-probs of the response tokens, after temperature
    data_source: str
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)
    loss_mask: list[int] | None = None  # None: every response token joins the loss
    status: SampleStatus = SampleStatus.OK
    policy_version: int = 0  # the number of policy updates behind the weights that sampled it (the oldest, when
    # a partial rollout continued it after a weight update: what its staleness counts)
    token_versions: list[int] | None = None  # partial rollouts: the policy version that sampled each response token
    reward: float | None = None  # set by the reward function
    turns: int = 1  # the model's turns (generations) in the trajectory
    messages: list[dict] | None = None  # multi-turn: the conversation, the prompt's messages (if it has them) then
    # the trajectory's (its last assistant message is the final answer the reward reads)
    tool_stats: ToolStats | None = None  # multi-turn: its tool calls
    error: str | None = None  # why the rollout could not produce it (an agent loop's failure); it joins no loss
    agent_reward: float | None = None  # rollout.agent.reward=function: the reward the user's agent returned (no scorer)
    agent_stats: AgentStats | None = None  # an episode of a user's agent (rollout.agent.function)
    routed_experts: np.ndarray | None = field(default=None, compare=False)  # moe.engine_routing: the engine's
    # experts of each position it fed, [positions, MoE layers, top-k] int16 (`rollout/routing_capture.py`)
    prompt_messages: list[dict] | None = None  # the prompt's chat messages, when it is a conversation (what a reward
    # model's chat template renders the scored conversation from)
    segment_starts: list[int] | None = None  # an agent episode its harness forked (rewrote its history): where each
    # segment after the first starts in prompt + response; each attends to itself only, its prompt masked out

    def model_tokens(self) -> int:
        """The response tokens the policy generated (the loss mask's ones), not a tool's or the template's."""
        return sum(self.loss_mask)

    def __post_init__(self):
        if self.loss_mask is None:
            self.loss_mask = [1] * len(self.response_ids)
        if not len(self.loss_mask) == len(self.rollout_log_probs) == len(self.response_ids):
            raise ValueError(f"a sample's response has {len(self.response_ids)} tokens but "
                             f"{len(self.rollout_log_probs)} log-probs and a loss mask of {len(self.loss_mask)}")
        if self.token_versions is not None:
            if len(self.token_versions) != len(self.response_ids):
                raise ValueError(f"a sample's response has {len(self.response_ids)} tokens but "
                                 f"{len(self.token_versions)} token versions")
            self.policy_version = min(self.token_versions, default=self.policy_version)

    @classmethod
    def answering(cls, prompt: Prompt, response_ids: list[int], rollout_log_probs: list[float], **fields) -> Sample:
        """A sample that answers `prompt` (its ids, data source, ground truth, chat messages, and a copy of its extra
        info, which a rollout function may edit per sample)."""
        return cls(prompt.ids, response_ids, rollout_log_probs, prompt.data_source, prompt.ground_truth,
                   dict(prompt.extra_info), prompt_messages=prompt.messages, **fields)


def _spans(starts: Tensor, counts: Tensor) -> tuple[Tensor, Tensor]:
    """(rows, columns) of `counts[i]` positions from `starts[i]` in each row i, row after row."""
    rows = torch.repeat_interleave(torch.arange(len(counts)), counts)
    offsets = torch.arange(int(counts.sum())) - torch.repeat_interleave(counts.cumsum(0) - counts, counts)
    return rows, torch.repeat_interleave(starts, counts) + offsets


def _segment_positions(samples: list[Sample], length: int) -> Tensor | None:
    """[B, length] positions restarting at each sample's segment starts; None where no sample has segments."""
    if not any(s.segment_starts for s in samples):
        return None
    positions = torch.zeros(len(samples), length, dtype=torch.long)
    for row, s in enumerate(samples):
        bounds = [0, *(s.segment_starts or []), len(s.prompt_ids) + len(s.response_ids)]
        for start, end in zip(bounds, bounds[1:]):
            positions[row, start:end] = torch.arange(end - start)
    return positions


def known_routing_then(known: np.ndarray | None, later: np.ndarray | None) -> np.ndarray | None:
    """The routing of a sequence from `known` where it has rows, then from `later` (a request that fed the sequence
    again, further)."""
    if known is None or later is None:
        return later if known is None else known
    return np.concatenate([known, later[known.shape[0]:]])


def to_device(tensor: Tensor, device: torch.device) -> Tensor:
    """A host tensor on the compute `device` without the host waiting: on a GPU the copy is queued from pinned
    memory (a copy from pageable memory makes the host wait for the GPU's queue)."""
    if device.type == "cuda" and tensor.device.type == "cpu":
        tensor = tensor.pin_memory()
    return tensor.to(device, non_blocking=True)


def _engine_routing(samples: list[Sample], length: int) -> Tensor | None:
    """The samples' engine routing as [B, length, MoE layers, top-k] (UNROUTED where a sample has none)."""
    shapes = {s.routed_experts.shape[1:] for s in samples if s.routed_experts is not None}
    if not shapes:
        return None
    if len(shapes) > 1:
        raise ValueError(f"the samples' engine routing differs in (MoE layers, top-k): {sorted(shapes)}")
    routing = torch.full((len(samples), length, *shapes.pop()), UNROUTED, dtype=torch.int16)
    for row, s in enumerate(samples):
        if s.routed_experts is not None:
            # A copy: the engines' arrays may be read-only (torch.from_numpy would warn on the console)
            routing[row, :s.routed_experts.shape[0]] = torch.tensor(s.routed_experts[:length])
    return routing


def pad_token_id(tokenizer) -> int:
    """The token that pads sequences: the tokenizer's pad token, else its end-of-sequence token. Decided here only;
    every padded tensor carries it (`TrainBatch.pad_id`). Padding never joins a loss (the mask is 0 there) and
    causal attention keeps it out of the real tokens' outputs."""
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


Rows = TypeVar("Rows", bound="RowTensors")


@dataclass
class RowTensors:
    """Per-row tensors (fields of type Tensor, some None) and plain fields shared by all rows. The worker groups'
    dispatch cuts them into equal contiguous parts by data-parallel rank and puts the results back together."""

    def tensors(self) -> dict[str, Tensor]:
        return {f.name: value for f in dataclasses.fields(self)
                if isinstance(value := getattr(self, f.name), Tensor)}

    def rows(self) -> int:
        return next(iter(self.tensors().values())).shape[0]

    def _with(self: Rows, tensors: dict[str, Tensor]) -> Rows:
        return dataclasses.replace(self, **tensors)

    def chunks(self: Rows, size: int) -> list[Rows]:
        """Consecutive parts of `size` rows (the last may be shorter)."""
        return [self._with({k: v[i:i + size] for k, v in self.tensors().items()}) for i in range(0, self.rows(), size)]

    def split(self: Rows, parts: int) -> list[Rows]:
        """`parts` equal, contiguous parts."""
        if self.rows() % parts:
            raise ValueError(f"A batch of {self.rows()} samples does not split into {parts} equal parts.")
        return self.chunks(self.rows() // parts)

    @classmethod
    def cat(cls: type[Rows], parts: list[Rows]) -> Rows:
        """The rows of `parts`, in order (their plain fields are the first part's)."""
        return parts[0]._with({k: torch.cat([p.tensors()[k] for p in parts]) for k in parts[0].tensors()})

    def to(self: Rows, device) -> Rows:
        """These rows on `device`, the host waiting for the copy (the way back from a GPU)."""
        return self._with({k: v.to(device) for k, v in self.tensors().items()})

    def to_device(self: Rows, device: torch.device) -> Rows:
        """These host rows on the compute `device`, without the host waiting (`to_device`)."""
        return self._with({k: to_device(v, device) for k, v in self.tensors().items()})

    def truncated(self: Rows, length: int) -> Rows:
        """The first `length` positions of every per-token ([B, S, ...]) tensor."""
        return self._with({k: v[:, :length] for k, v in self.tensors().items() if v.dim() >= 2})


@dataclass
class TokenOutputs(RowTensors):
    """Per-token outputs of a forward pass ([B, S], position t for the token at t + 1)."""
    log_probs: Tensor | None = None  # log p(token) under the sampling temperature
    entropy: Tensor | None = None  # the policy's entropy at each position
    values: Tensor | None = None  # the critic's value of the state before each token
    routed_experts: Tensor | None = None  # [B, S, MoE layers, top-k] int16: the experts token t went to (R2 records)
    top_log_probs: Tensor | None = None  # [B, S, k]: a teacher's k likeliest tokens' log-probs (best first); the
    # policy's update: its log-probs of those tokens (algorithm.distillation.top_k)
    top_ids: Tensor | None = None  # [B, S, k] int32: a teacher's k likeliest tokens


@dataclass
class PolicyUpdate(RowTensors):
    """What the actor's update returns: its metrics (the same on every rank) and, for a batch sent without
    old_log_probs (trained on-policy in one optimizer step, `trainer/old_log_probs.py`), its forward pass's log-probs
    and entropy, detached: the old policy's, as a pass of their own computes them ([B, S])."""
    metrics: dict[str, float]
    log_probs: Tensor | None = None
    entropy: Tensor | None = None


@dataclass
class TrainBatch(RowTensors):
    """The step's samples as right-padded tensors, and what the step computes about them ([B, S] each; None until
    computed or when the run does not need it)."""
    input_ids: Tensor  # long, prompt + response tokens, then pad_id
    response_mask: Tensor  # float 0/1: the label positions that join the loss (the samples' loss masks)
    pad_id: int
    lengths: Tensor | None = None  # [B] long: each row's prompt + response tokens (None: every row is full length)
    rollout_log_probs: Tensor | None = None  # the engine's, at sampling time
    old_log_probs: Tensor | None = None  # Megatron's, before this step's update
    entropy: Tensor | None = None  # the policy's, before this step's update (a metric)
    ref_log_probs: Tensor | None = None  # the reference policy's (KL)
    teacher_log_probs: Tensor | None = None  # the teacher's (on-policy distillation)
    teacher_top_log_probs: Tensor | None = None  # [B, S, k]: the teacher's k likeliest tokens' log-probs and their
    teacher_top_ids: Tensor | None = None  # ids, int32 (algorithm.distillation.top_k)
    values: Tensor | None = None  # the critic's, before this step's update
    advantages: Tensor | None = None  # per token, or [B]: one per sequence
    returns: Tensor | None = None  # the critic's targets
    importance_weights: Tensor | None = None  # rollout correction: p_train / p_rollout truncated or masked
    routed_experts: Tensor | None = None  # [B, S, MoE layers, top-k] int16: the experts token t went to (UNROUTED
    # where unknown): the engine's (moe.engine_routing), then under actor.router_replay=R2 the old log-prob pass's,
    # replayed by the update (models/router_replay.py)
    position_ids: Tensor | None = None  # [B, S] long: each token's position in its attention span, restarting where
    # a forked agent episode's next segment starts (`Sample.segment_starts`); None: no sample has segments

    @classmethod
    def from_samples(cls, samples: list[Sample], pad_id: int) -> TrainBatch:
        # Each tensor filled by one indexed write of every sample's values (a write per sample and tensor was a third
        # of the controller's time in a small model's step).
        prompts = torch.tensor([len(s.prompt_ids) for s in samples])
        responses = torch.tensor([len(s.response_ids) for s in samples])
        lengths = prompts + responses
        count, length = len(samples), int(lengths.max())
        input_ids = torch.full((count, length), pad_id, dtype=torch.long)
        input_ids[_spans(torch.zeros_like(prompts), lengths)] = torch.tensor(
            [token for s in samples for ids in (s.prompt_ids, s.response_ids) for token in ids], dtype=torch.long)
        # A response token is predicted at the position before it: the labels' layout.
        predicted = _spans(prompts - 1, responses)
        response_mask = torch.zeros(count, length)
        response_mask[predicted] = torch.tensor([m for s in samples for m in s.loss_mask], dtype=torch.float)
        rollout_log_probs = torch.zeros(count, length)
        rollout_log_probs[predicted] = torch.tensor([p for s in samples for p in s.rollout_log_probs],
                                                    dtype=torch.float)
        return cls(input_ids, response_mask, pad_id, lengths, rollout_log_probs=rollout_log_probs,
                   routed_experts=_engine_routing(samples, length), position_ids=_segment_positions(samples, length))

    def select(self, *names: str) -> TrainBatch:
        """The sequences with only the computed fields `names` (what one worker call reads: less to send)."""
        return TrainBatch(self.input_ids, self.response_mask, self.pad_id, self.lengths,
                          position_ids=self.position_ids, **{name: getattr(self, name) for name in names})

    def sequence_lengths(self) -> list[int]:
        """Each row's real tokens (prompt + response), before the right padding."""
        if self.lengths is None:
            return [self.input_ids.shape[1]] * self.input_ids.shape[0]
        return self.lengths.tolist()

    def labels(self) -> Tensor:
        """The token each position predicts (pad at the last position)."""
        ids = self.input_ids
        return torch.cat([ids[:, 1:], ids.new_full((ids.shape[0], 1), self.pad_id)], dim=1)

    def padded_to_multiple(self, multiple: int) -> TrainBatch:
        """Right-padded to a length that is a multiple of `multiple`: pad tokens, and zeros in the masks and
        log-probs, so that the padding joins no loss."""
        extra = -self.input_ids.shape[1] % multiple
        if not extra:
            return self
        fill = {"input_ids": self.pad_id, "routed_experts": UNROUTED}
        return self._with({k: F.pad(v, (0, 0) * (v.dim() - 2) + (0, extra), value=fill.get(k, 0))
                           for k, v in self.tensors().items() if v.dim() >= 2})
