"""Tool calls in a model's text, in the Hermes format of the Qwen2.5 / Qwen3 chat templates:

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "2+3"}}
    </tool_call>

Several blocks per turn are allowed; text outside them is ignored. A malformed block becomes an error message
worded for the model (it starts with "Error:" and can be sent back as the tool message as is), never an exception.
"""
from __future__ import annotations

import json
from dataclasses import dataclass

OPEN = "<tool_call>"
CLOSE = "</tool_call>"
_EXAMPLE = f'{OPEN}{{"name": "...", "arguments": {{...}}}}{CLOSE}'


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict


@dataclass(frozen=True)
class ParsedCalls:
    calls: list[ToolCall]  # the well-formed calls, in order
    errors: list[str]  # one message per malformed block, in order


class _Malformed(ValueError):
    pass


def parse_tool_calls(text: str) -> ParsedCalls:
    """The tool calls in `text`, and an error message for each <tool_call> block that is not a valid call."""
    calls: list[ToolCall] = []
    errors: list[str] = []
    position = 0
    while (start := text.find(OPEN, position)) >= 0:
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        number = len(calls) + len(errors) + 1
        if end < 0:
            errors.append(f"Error: tool call #{number} has no closing {CLOSE}. Write {_EXAMPLE}.")
            break
        try:
            calls.append(_call(text[body_start:end]))
        except _Malformed as err:
            errors.append(f"Error: tool call #{number} is malformed: {err}. Write {_EXAMPLE}.")
        position = end + len(CLOSE)
    return ParsedCalls(calls=calls, errors=errors)


def text_outside_calls(text: str) -> str:
    """`text` less its <tool_call> blocks, stripped (what an OpenAI client reads as the message's content)."""
    kept, position = [], 0
    while (start := text.find(OPEN, position)) >= 0:
        kept.append(text[position:start])
        end = text.find(CLOSE, start)
        position = len(text) if end < 0 else end + len(CLOSE)
    kept.append(text[position:])
    return "".join(kept).strip()


def _call(body: str) -> ToolCall:
    payload = _json(body.strip(), "the block")
    if not isinstance(payload, dict):
        raise _Malformed(f"the block holds a JSON {_json_type(payload)}, not an object")
    name = payload.get("name")
    if not isinstance(name, str) or not name.strip():
        raise _Malformed('no "name" string')
    arguments = payload.get("arguments")
    if arguments is None:
        arguments = {}
    elif isinstance(arguments, str):
        # Some models write the arguments as a JSON string holding the object.
        arguments = _json(arguments, '"arguments"') if arguments.strip() else {}
    if not isinstance(arguments, dict):
        raise _Malformed(f'"arguments" is a JSON {_json_type(arguments)}, not an object')
    return ToolCall(name=name.strip(), arguments=arguments)


def _json(text: str, what: str):
    try:
        return json.loads(text)
    except json.JSONDecodeError as err:
        raise _Malformed(f"{what} is not valid JSON ({err})") from None


def _json_type(value) -> str:
    return {list: "array", str: "string", bool: "boolean", int: "number", float: "number"}.get(type(value), "null")
