"""Token in, token out: a trajectory's tokens are the model's own, exactly as sampled, with what the environment adds
(tool replies, the chat template's markers) encoded once and spliced in between, masked out of the loss.

Re-tokenising a conversation's text at every turn would change the model's tokens (a different split of the same
text), so the trainer would score tokens the policy never sampled; verl found that this broke PPO's convergence.
Only the new messages are encoded, as the tokenizer's chat template renders them after an assistant turn:
`ChatDeltas` renders a fixed conversation ending in an assistant turn, with and without the new messages, and takes
the text after the assistant's end-of-turn token. That keeps the separator the template writes after the end-of-turn
token (Qwen's "\n", which the model never generates: dropping it was verl#6921) and leaves out the system prompt the
template would add to a conversation of its own.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np

from rl_megatron.batch import UNROUTED, Prompt, Sample, SampleStatus, ToolStats, known_routing_then
from rl_megatron.rollout.completions import Completion

# An assistant message that no template rewrites, to find where the template's assistant turn ends.
_ANCHOR = "rl_megatron_anchor"


class ChatDeltas:
    def __init__(self, tokenizer, stop_ids: list[int]):
        """`stop_ids`: the tokens generation stops at; the one the chat template ends an assistant turn with is the
        end-of-turn token."""
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("a multi-turn agent loop needs a tokenizer with a chat template (model.path's "
                             "tokenizer_config.json has none)")
        self.tokenizer = tokenizer
        self.base = [{"role": "user", "content": "?"}, {"role": "assistant", "content": _ANCHOR}]
        text = tokenizer.apply_chat_template(self.base, tokenize=False)
        anchor = text.rindex(_ANCHOR)
        ends = sorted((text.find(tokenizer.decode([i]), anchor), i) for i in stop_ids
                      if text.find(tokenizer.decode([i]), anchor) >= 0)
        if not ends:
            raise ValueError(f"the chat template ends an assistant turn with none of the tokens generation stops at "
                             f"({[tokenizer.decode([i]) for i in stop_ids]}): fix the model's eos_token_id or template")
        self.end_of_turn_id = ends[0][1]
        self.end_of_turn = tokenizer.decode([self.end_of_turn_id])
        self._writing: dict[str, Callable[[str], str]] = {}  # role -> how the template writes its contents

    def after_turn(self, messages: list[dict], turn_ended: bool) -> list[int]:
        """The tokens that follow an assistant turn: the end-of-turn token if the model did not write it (the turn
        ran into its token limit), the template's separator, `messages` (tool replies, a user's next message), and
        the next assistant turn's opening.

        The messages' contents are text from outside the model (a tool's output may be written by model code): they
        are encoded with special-token strings as ordinary characters, so that a reply holding `<|im_end|>` cannot
        end the turn or open a forged one. Only the template's own markup becomes control tokens."""
        holders = [f"\ue000{i}\ue001" for i in range(len(messages))]  # private-use characters: in no real text
        text = self._rendered([dict(m, content=holder) for m, holder in zip(messages, holders)])
        ids = [] if turn_ended else [self.end_of_turn_id]
        for holder, message in zip(holders, messages):
            markup, _, text = text.partition(holder)
            content = self._as_written(message["role"])(message["content"])
            ids += self._encode(markup) + self._encode(content, split_special_tokens=True)
        return ids + self._encode(text)

    def _rendered(self, messages: list[dict]) -> str:
        """The template's text for `messages` after the anchor's end-of-turn token, with the next turn's opening."""
        text = self.tokenizer.apply_chat_template(self.base + messages, tokenize=False, add_generation_prompt=True)
        return text[text.find(self.end_of_turn, text.rindex(_ANCHOR)) + len(self.end_of_turn):]

    def _encode(self, text: str, **options) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False, **options) if text else []

    def _as_written(self, role: str) -> Callable[[str], str]:
        """How the template writes a `role` message's content: as given, or stripped (`| trim`) at either end or
        both, found once per role from a probe with spaces around it."""
        if role not in self._writing:
            probe = " \ue002 \n"
            text = self._rendered([{"role": role, "content": probe}])
            ways = [(probe, _as_given), (probe.rstrip(), str.rstrip), (probe.lstrip(), str.lstrip),
                    (probe.strip(), str.strip)]
            found = [way for written, way in ways if written in text]
            if not found:
                raise ValueError(f"the chat template rewrites a {role} message's content (beyond stripping it): a "
                                 "multi-turn agent loop needs a template that writes message contents as given")
            self._writing[role] = found[0]
        return self._writing[role]


def _as_given(content: str) -> str:
    return content


@dataclass
class Trajectory:
    """A sample being built turn by turn: the model's turns (loss mask 1, the engine's log-probs) and the context
    spliced between them (mask 0, log-prob 0)."""
    prompt: Prompt
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    messages: list[dict] = field(default_factory=list)  # the conversation: the prompt's messages, then the turns'
    turns: int = 0
    tool_stats: ToolStats = field(default_factory=ToolStats)
    versions: list[int | None] = field(default_factory=list)  # partial rollouts: the policy version of each model
    # token (None elsewhere)
    routed_experts: np.ndarray | None = field(default=None, compare=False)  # moe.engine_routing: each position's
    # experts, from the turn that fed it first

    def __post_init__(self):
        self.messages = list(self.prompt.messages or [])

    def context(self) -> list[int]:
        """What the model reads next: the prompt and everything after it."""
        return self.prompt.ids + self.response_ids

    def add_turn(self, completion: Completion, text: str, **fields) -> None:
        """The model's turn; `text` is its message's content (the last turn's is the answer the reward reads) and
        `fields` its other keys (harmony: `thinking`, `tool_calls`)."""
        self.response_ids += completion.response_ids
        self.versions += completion.versions or [None] * len(completion.response_ids)
        self.loss_mask += [1] * len(completion.response_ids)
        self.log_probs += completion.log_probs
        self.routed_experts = known_routing_then(self.routed_experts, completion.routed_experts)
        self.messages.append({"role": "assistant", "content": text, **fields})
        self.turns += 1

    def add_context(self, ids: list[int], messages: list[dict]) -> None:
        self.response_ids += ids
        self.loss_mask += [0] * len(ids)
        self.log_probs += [0.0] * len(ids)
        self.versions += [None] * len(ids)
        self.messages += messages

    def sample(self, status: SampleStatus, later: list[Trajectory] = ()) -> Sample:
        """This trajectory as a sample; with `later` (the segments an agent episode forked into after it, when its
        harness rewrote its history), one sample of them all: each later segment's prompt spliced in as context
        (mask 0) and attending to its own segment only (`Sample.segment_starts`), so that every token is trained as
        it was sampled, in the context the engine read. Its conversation is the last segment's."""
        whole = Trajectory(self.prompt, list(self.response_ids), list(self.loss_mask), list(self.log_probs),
                           turns=self.turns, tool_stats=self.tool_stats, versions=list(self.versions),
                           routed_experts=(_routing_to(self.routed_experts, len(self.context())) if later
                                           else self.routed_experts))
        whole.messages = self.messages
        starts = []
        for segment in later:
            starts.append(len(whole.context()))
            whole.add_context(segment.prompt.ids, [])
            whole.response_ids += segment.response_ids
            whole.loss_mask += segment.loss_mask
            whole.log_probs += segment.log_probs
            whole.versions += segment.versions
            whole.routed_experts = _joined_routing(whole.routed_experts, segment.routed_experts,
                                                   len(segment.context()))
            whole.turns += segment.turns
            whole.messages, whole.tool_stats = segment.messages, segment.tool_stats
        known = [v for v in whole.versions if v is not None]
        # Context tokens join no loss: the oldest version stands in for theirs.
        versions = [min(known) if v is None else v for v in whole.versions] if known else None
        return Sample.answering(whole.prompt, whole.response_ids, whole.log_probs, loss_mask=whole.loss_mask,
                                status=status, turns=whole.turns, messages=whole.messages,
                                tool_stats=whole.tool_stats, token_versions=versions,
                                routed_experts=whole.routed_experts, segment_starts=starts or None)


def _routing_to(routing: np.ndarray | None, positions: int) -> np.ndarray | None:
    """A segment's routing over all its `positions` (UNROUTED where the engine never fed one: its last token)."""
    if routing is None or routing.shape[0] >= positions:
        return routing
    return np.concatenate([routing, np.full((positions - routing.shape[0], *routing.shape[1:]), UNROUTED,
                                            dtype=routing.dtype)])


def _joined_routing(known: np.ndarray | None, later: np.ndarray | None, positions: int) -> np.ndarray | None:
    """The routing of the segments so far, then of a later one over its `positions`; None where neither has any."""
    if known is None:  # no routing captured (moe.engine_routing off: no segment has any)
        return None
    if later is None:
        later = np.full((positions, *known.shape[1:]), UNROUTED, dtype=known.dtype)
    return np.concatenate([known, _routing_to(later, positions)])
