"""One model turn of a multi-turn trajectory, read and followed, the same way wherever it runs: the built-in tool loop
(`tool_agent.py`) and the OpenAI-compatible gateway (`rl_megatron.gateway`) both read a turn's text and tool calls
here, and both splice what follows it (tool replies, a user's message) with the chat template's deltas.

    hermes:  the text decoded without special tokens (the <tool_call> blocks stay for the parser), calls parsed from it
    harmony: the markers kept for the parser; the text the reward reads is the final channel, the analysis its thinking
"""
from __future__ import annotations

from dataclasses import dataclass, field

from rl_megatron.agents.harmony_deltas import HarmonyDeltas
from rl_megatron.batch import SampleStatus
from rl_megatron.rollout.completions import Completion
from rl_megatron.tools import ParsedCalls, parse_tool_calls
from rl_megatron.tools.calls import text_outside_calls
from rl_megatron.tools.harmony import parse_harmony_turn


@dataclass(frozen=True)
class ModelTurn:
    text: str  # the assistant message's content as the reward reads it (hermes: the whole text, calls included;
    # harmony: the final channel)
    calls: ParsedCalls  # the well-formed calls, and an error message per malformed one
    ended: bool  # the model ended its turn itself (a stop token), rather than running into its token limit
    fields: dict = field(default_factory=dict)  # the message's other keys (harmony: thinking, tool_calls)
    reply_names: list[str] = field(default_factory=list)  # harmony: the function each reply comes from
    closing: str | None = None  # harmony: the marker that ends the turn's last message, when it stopped inside it
    thinking: str = ""  # harmony: the analysis channel
    answer: str = ""  # the text outside the tool calls (hermes) or the final channel (harmony): what a user sees

    def attempts(self) -> int:
        """The calls the turn tried, well-formed or not."""
        return len(self.calls.calls) + len(self.calls.errors)


def read_turn(tokenizer, deltas, completion: Completion) -> ModelTurn:
    """`completion` (one model turn) read in the format `deltas` splices (HarmonyDeltas: harmony; else hermes)."""
    ended = completion.status == SampleStatus.OK
    if isinstance(deltas, HarmonyDeltas):  # the markers (<|channel|>, <|call|>, ...) are special tokens: kept
        turn = parse_harmony_turn(tokenizer.decode(completion.response_ids))
        return ModelTurn(turn.final, turn.calls, ended, turn.message_fields(), turn.reply_names, turn.closing,
                         turn.analysis, turn.final)
    text = tokenizer.decode(completion.response_ids, skip_special_tokens=True)
    return ModelTurn(text, parse_tool_calls(text), ended, answer=text_outside_calls(text))


def after_turn(deltas, turn: ModelTurn, messages: list[dict]) -> list[int]:
    """The tokens that follow `turn`: `messages` (tool replies, a user's message; harmony replies carry the `name`
    of the function they answer) and the next assistant turn's opening, as the chat template writes them."""
    if isinstance(deltas, HarmonyDeltas):
        return deltas.after_turn(messages, closing=turn.closing)
    return deltas.after_turn(messages, turn_ended=turn.ended)

