"""Tools a model calls during multi-turn rollouts: parse the calls in a turn, run them, send back the outcomes.

    calls = parse_tool_calls(text)                   # ParsedCalls: the well-formed calls and an error per bad block
    tools = ToolSet.from_config_file(path)           # built once per run from a verl-layout tool config
    outcome = await tools.call(call, tools_kwargs, timeout_s)   # never raises; outcome.text is the tool message

The built-in tools (rl_megatron.tools.calculator.CalculatorTool, rl_megatron.tools.python_tool.PythonTool) are
named by their class in the config, like any user tool, and imported only then.
"""
from rl_megatron.tools.base import Tool, ToolOutcome
from rl_megatron.tools.calls import ParsedCalls, ToolCall, parse_tool_calls
from rl_megatron.tools.registry import ToolSet

__all__ = ["ParsedCalls", "Tool", "ToolCall", "ToolOutcome", "ToolSet", "parse_tool_calls"]
