"""What every tool is: a class built once per run from its config entry, called with a call's arguments."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ToolOutcome:
    text: str  # what goes back to the model: the tool message's content
    error: bool = False  # the call failed (unknown tool, bad arguments, exception, malformed call): tool/errors
    timed_out: bool = False  # the call ran past its time limit (error is True too): tool/timeouts
    # how long the call waited for one of the tool's slots (its rate_limit) before it ran: a measurement, not part of
    # what the call returned (outcomes compare equal without it)
    slot_wait_s: float = field(default=0.0, compare=False)

    @classmethod
    def failure(cls, text: str, timed_out: bool = False) -> ToolOutcome:
        return cls(text=text, error=True, timed_out=timed_out)


class Tool:
    """Base class. A tool is built once per run from its config entry, as Tool(config, schema), and shared by every
    trajectory: calls run concurrently on one event loop, so a tool keeps no per-call state on self (per-sample
    state comes in `state`). `rate_limit`: the most calls of this tool that run at once in a process (verl's key;
    None: no limit); the others wait for a slot, and that wait is not part of their time limit."""

    rate_limit: int | None = None

    def __init__(self, config: dict, schema: dict):
        self.config = config
        self.schema = schema  # the OpenAI function schema: {"type": "function", "function": {"name": ...}}
        self.name: str = schema["function"]["name"]

    async def execute(self, arguments: dict, state: dict) -> ToolOutcome:
        """Run one call. `arguments` already match the schema's `function.parameters`; `state` is the sample's
        `extra_info["tools_kwargs"][name]` ({} when absent). An exception becomes an error outcome."""
        raise NotImplementedError(f"{type(self).__name__} does not implement execute()")
