"""Tool calls and answers in gpt-oss's harmony chat format, beside the Hermes format of calls.py.

A harmony conversation is a run of messages, each

    <|start|>{author}{header}<|message|>{content}{terminator}

The header names the channel (`<|channel|>analysis`, `commentary` or `final`), a recipient when the message is a call
(`to=functions.NAME`, written after the author or after the channel) and the content's type (`json`, or
`<|constrain|>json`). The terminator is <|end|>, <|call|> (a tool call: generation stops there, so that the reply
follows) or <|return|> (the end of the final answer). The model writes its turn after the generation prompt
`<|start|>assistant`, so its text is read as if that header came first:

    <|channel|>analysis<|message|>I need the digit.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.lookup <|constrain|>json<|message|>{}<|call|>

gpt-oss's chat template (tests/data/gpt_oss_chat_template.jinja) writes the same call as
`<|start|>assistant to=functions.lookup<|channel|>commentary json<|message|>{}<|call|>`; both forms are read.

A call is an assistant message with a recipient. It is well formed when addressed to `functions.NAME`, its content
is a JSON object (or nothing: no arguments), and it ends with <|call|> (or <|end|>, as the template's first release
wrote calls). Any other call becomes an "Error: ..." message worded for the model, never an exception, answered from
the tool it named. The reward reads the `final` channel (`HarmonyTurn.final`), never the analysis.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from rl_megatron.config.choices import AUTO_FORMAT, HARMONY, HERMES, TOOL_FORMATS
from rl_megatron.config.fields import choice_error
from rl_megatron.errors import ConfigError
from rl_megatron.tools.calls import ParsedCalls, ToolCall, _json_type

START, MESSAGE, CHANNEL, CONSTRAIN = "<|start|>", "<|message|>", "<|channel|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
TERMINATORS = (END, CALL, RETURN)
ASSISTANT = "assistant"
FUNCTIONS = "functions."
FINAL, ANALYSIS = "final", "analysis"
_HOW = "Call a function as a message to=functions.NAME on the commentary channel, its arguments a JSON object"
# A function's name, as the reply's markup will carry it: never a special-token string the model wrote into a header.
_NAME = re.compile(r"[\w.\-]+")
_PLACEHOLDER_NAME = "unknown"  # the author of the reply to a call that named no usable recipient


@dataclass(frozen=True)
class HarmonyMessage:
    author: str  # "assistant", or the tool a reply comes from ("functions.lookup")
    channel: str | None  # analysis, commentary or final; None when the header names none
    recipient: str | None  # "functions.lookup" for a call; None for a message to the user
    content_type: str | None  # "json" (from "json" or "<|constrain|>json"); None when the header names none
    content: str
    terminator: str | None  # <|end|>, <|call|> or <|return|>; None: the text stopped inside the message


@dataclass(frozen=True)
class HarmonyTurn:
    """One model turn read: its calls, what the reward reads, and what the next splice must close."""
    calls: ParsedCalls  # the well-formed calls, and an error message per malformed one
    reply_names: list[str]  # the function each reply comes from, in the order the replies go back: the calls',
    # then the errors' (the template writes a reply as from `functions.{name}`)
    final: str  # the last final-channel message's content, "" without one: the answer the reward reads
    analysis: str  # the analysis messages' contents, one per line
    closing: str | None  # the marker that ends the turn's last message when the turn stopped inside it (<|call|>
    # for a call, <|end|> otherwise); None when the turn ended a message

    def message_fields(self) -> dict:
        """The assistant message's fields beside its content (the final answer), as gpt-oss's template reads
        them: `thinking` (the analysis) and `tool_calls`."""
        fields: dict = {"thinking": self.analysis} if self.analysis else {}
        if self.calls.calls:
            fields["tool_calls"] = [{"type": "function", "function": {"name": call.name, "arguments": call.arguments}}
                                    for call in self.calls.calls]
        return fields


class _Malformed(ValueError):
    pass


def parse_messages(text: str) -> list[HarmonyMessage]:
    """The messages of a model turn: `text` continues the generation prompt `<|start|>assistant`, so its first
    message is the assistant's. A message that reaches no <|message|> before the next <|start|> (or the end) has an
    empty content and no terminator; text between a terminator and the next <|start|> belongs to no message."""
    messages: list[HarmonyMessage] = []
    position, author = 0, ASSISTANT  # the generation prompt wrote the first message's <|start|> and author
    while position >= 0:
        next_start = text.find(START, position)
        body = text.find(MESSAGE, position)
        if body < 0 or 0 <= next_start < body:  # a header that never reaches its content
            end = next_start if next_start >= 0 else len(text)
            messages.append(_message(author, text[position:end], "", None))
        else:
            content_start = body + len(MESSAGE)
            ends = [(at, marker) for marker in (*TERMINATORS, START) if (at := text.find(marker, content_start)) >= 0]
            at, marker = min(ends) if ends else (len(text), None)
            terminator = marker if marker in TERMINATORS else None
            messages.append(_message(author, text[position:body], text[content_start:at], terminator))
            next_start = text.find(START, at)
        position, author = (next_start + len(START), None) if next_start >= 0 else (-1, None)
    return messages


def _message(author: str | None, header: str, content: str, terminator: str | None) -> HarmonyMessage:
    """`header`: what lies between the author (the first word after <|start|>, unless `author` is given) and
    <|message|>, e.g. "assistant to=functions.f<|channel|>commentary json" or "assistant<|channel|>commentary
    to=functions.f <|constrain|>json"."""
    author_part, _, channel_part = header.partition(CHANNEL)
    author_words = author_part.split()
    if author is None:
        author = author_words.pop(0) if author_words and not author_words[0].startswith("to=") else ""
    channel_words = channel_part.replace(CONSTRAIN, " ").split()
    recipient = content_type = None
    for word in author_words + channel_words[1:]:
        if word.startswith("to="):
            recipient = word[len("to="):]
        elif content_type is None:
            content_type = word
    return HarmonyMessage(author=author, channel=channel_words[0] if channel_words else None, recipient=recipient,
                          content_type=content_type, content=content, terminator=terminator)


def parse_harmony_turn(text: str) -> HarmonyTurn:
    """A model turn's calls, final answer and analysis; `text` is its tokens decoded with the special tokens kept
    (continuing the generation prompt `<|start|>assistant`)."""
    messages = parse_messages(text)
    calls: list[ToolCall] = []
    errors: list[str] = []
    error_names: list[str] = []
    for message in messages:
        if message.author != ASSISTANT or message.recipient is None:
            continue
        number = len(calls) + len(errors) + 1
        try:
            calls.append(_call(message))
        except _Malformed as err:
            errors.append(f"Error: tool call #{number} {err}. {_HOW}.")
            named = message.recipient.removeprefix(FUNCTIONS)
            error_names.append(named if _NAME.fullmatch(named) else _PLACEHOLDER_NAME)
    own = [m for m in messages if m.author == ASSISTANT and m.recipient is None]
    last = messages[-1] if messages else None
    closing = None if last is None or last.terminator else CALL if last.recipient is not None else END
    return HarmonyTurn(calls=ParsedCalls(calls=calls, errors=errors),
                       reply_names=[call.name for call in calls] + error_names,
                       final=next((m.content for m in reversed(own) if m.channel == FINAL), ""),
                       analysis="\n".join(m.content for m in own if m.channel == ANALYSIS), closing=closing)


def _call(message: HarmonyMessage) -> ToolCall:
    recipient = message.recipient
    name = recipient.removeprefix(FUNCTIONS).strip() if recipient.startswith(FUNCTIONS) else ""
    if not _NAME.fullmatch(name):
        raise _Malformed(f"is addressed to={recipient}, which is not one of your functions (to=functions.NAME)")
    if message.terminator is None:
        raise _Malformed(f"to {recipient} was cut off before its end ({CALL}): write shorter arguments")
    body = message.content.strip()
    try:
        arguments = json.loads(body) if body else {}
    except json.JSONDecodeError as err:
        raise _Malformed(f"to {recipient} is malformed: its message is not valid JSON ({err})") from None
    if not isinstance(arguments, dict):
        raise _Malformed(f"to {recipient} is malformed: its message is a JSON {_json_type(arguments)}, not an "
                         "object of the arguments")
    return ToolCall(name=name, arguments=arguments)


def writes_harmony(chat_template) -> bool:
    """Whether a chat template writes harmony messages (gpt-oss's): each names a <|channel|>."""
    templates = chat_template.values() if isinstance(chat_template, dict) else [chat_template or ""]
    return any(CHANNEL in template for template in templates)


def resolve_tool_format(setting: str, chat_template) -> str:
    """rollout.multi_turn.format as the run uses it: hermes or harmony; auto follows the tokenizer's chat template
    (harmony when it writes <|channel|>). ConfigError for an unknown setting, and for hermes on a harmony template,
    whose tool messages can only follow harmony calls."""
    if setting not in TOOL_FORMATS:
        raise choice_error("rollout.multi_turn.format", setting, TOOL_FORMATS)
    harmony = writes_harmony(chat_template)
    if setting == HERMES and harmony:
        raise ConfigError("rollout.multi_turn.format=hermes, but model.path's chat template writes gpt-oss's harmony "
                          "format (<|channel|>), whose tool messages answer only harmony calls (to=functions.NAME): "
                          "set rollout.multi_turn.format=harmony, or auto.")
    if setting != AUTO_FORMAT:
        return setting
    return HARMONY if harmony else HERMES
