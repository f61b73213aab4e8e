"""The tools of a run: built from a tool config file (verl's layout), and one `call` that never raises.

    tools:
      - class_name: rl_megatron.tools.calculator.CalculatorTool   # or "pkg.mod:Class", or "path/to/file.py:Class"
        config: {}                                                 # optional, passed to the constructor
        tool_schema:
          type: function
          function: {name: calculator, description: ..., parameters: {type: object, ...}}
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import os
import time

import jsonschema
import yaml

from rl_megatron.errors import ConfigError, one_line
from rl_megatron.plugins import import_module
from rl_megatron.tools.base import Tool, ToolOutcome
from rl_megatron.tools.calls import ToolCall


class ToolSet:
    """Tools by name, with their arguments' validators."""

    def __init__(self, tools: list[Tool]):
        self._tools: dict[str, Tool] = {}
        self._validators = {}
        self._slots: dict[str, tuple[asyncio.AbstractEventLoop, asyncio.Semaphore]] = {}  # per tool with a rate_limit
        for tool in tools:
            if tool.name in self._tools:
                raise ValueError(f"two tools are named {tool.name!r}; give each tool a unique function.name")
            self._tools[tool.name] = tool
            parameters = tool.schema["function"].get("parameters") or {}
            self._validators[tool.name] = jsonschema.validators.validator_for(parameters)(parameters)

    @classmethod
    def from_config_file(cls, path: str, key: str = "rollout.multi_turn.tool_config_path") -> ToolSet:
        """The tools a YAML or JSON tool config file lists; any problem is a ConfigError naming `key`."""
        where = f"{key}={path}"
        entries = _read_entries(path, where)
        tools: list[Tool] = []
        first_index: dict[str, int] = {}
        for index, entry in enumerate(entries):
            tool = _build(entry, f"{where}: tools[{index}]")
            if tool.name in first_index:
                raise ConfigError(f"{where}: tools[{index}] is named {tool.name!r} like tools[{first_index[tool.name]}]"
                                  ". Give each tool a unique tool_schema.function.name.")
            first_index[tool.name] = index
            tools.append(tool)
        return cls(tools)

    def schemas(self) -> list[dict]:
        """The tools' OpenAI function schemas, for the chat template's `tools=`."""
        return [tool.schema for tool in self._tools.values()]

    def names(self) -> list[str]:
        return list(self._tools)

    async def call(self, call: ToolCall, tools_kwargs: dict | None, timeout_s: float) -> ToolOutcome:
        """Run one call. Every failure (unknown tool, arguments against the schema, an exception, `timeout_s` of wall
        time passed) is an error outcome whose text tells the model what went wrong."""
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolOutcome.failure(f"Error: unknown tool {call.name!r}; available: {', '.join(self._tools)}")
        problem = jsonschema.exceptions.best_match(self._validators[call.name].iter_errors(call.arguments))
        if problem is not None:
            at = "".join(f"[{part!r}]" for part in problem.absolute_path)
            return ToolOutcome.failure(f"Error: invalid arguments for {call.name}{' at ' + at if at else ''}: "
                                       f"{problem.message}")
        state = (tools_kwargs or {}).get(call.name) or {}
        start = time.perf_counter()
        async with self._slot(tool):
            waited = time.perf_counter() - start
            try:
                outcome = await asyncio.wait_for(tool.execute(call.arguments, state), timeout_s)
            except TimeoutError:  # asyncio.TimeoutError is TimeoutError since 3.11
                outcome = ToolOutcome.failure(f"Error: {call.name} timed out after {timeout_s:g} s", timed_out=True)
            except Exception as err:  # a tool's bug or bad input must not stop the run: the model sees it, it counts
                outcome = ToolOutcome.failure(f"Error: {type(err).__name__}: {err}")
        if not isinstance(outcome, ToolOutcome):
            outcome = ToolOutcome.failure(f"Error: {call.name} returned a {type(outcome).__name__}, not a ToolOutcome")
        return dataclasses.replace(outcome, slot_wait_s=waited)

    def _slot(self, tool: Tool):
        """One of `tool`'s rate_limit slots in this event loop (each batch's rollout runs a loop of its own)."""
        if tool.rate_limit is None:
            return contextlib.nullcontext()
        loop = asyncio.get_running_loop()
        if tool.name not in self._slots or self._slots[tool.name][0] is not loop:
            self._slots[tool.name] = (loop, asyncio.Semaphore(tool.rate_limit))
        return self._slots[tool.name][1]


def _read_entries(path: str, where: str) -> list:
    if not os.path.isfile(path):
        raise ConfigError(f"{where}: file not found (relative paths start from {os.getcwd()}). Give a YAML or JSON "
                          "tool config file.")
    try:
        with open(path, encoding="utf-8") as file:
            document = yaml.safe_load(file)  # JSON is YAML too
    except (yaml.YAMLError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where}: not valid YAML or JSON ({one_line(err)}). Fix the file.") from None
    entries = document.get("tools") if isinstance(document, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where}: the file needs a non-empty `tools:` list of entries with class_name and "
                          "tool_schema (see configs/tools/python_calculator.yaml).")
    return entries


def _build(entry, where: str) -> Tool:
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is a {type(entry).__name__}; it must be a mapping with class_name and tool_schema.")
    tool_class = _tool_class(entry.get("class_name"), f"{where}.class_name")
    config = entry.get("config") or {}
    if not isinstance(config, dict):
        raise ConfigError(f"{where}.config is a {type(config).__name__}; give a mapping (or leave it out).")
    schema = _checked_schema(entry.get("tool_schema"), f"{where}.tool_schema")
    try:
        return tool_class(config, schema)
    except Exception as err:
        raise ConfigError(f"{where}: building {tool_class.__name__} failed: {type(err).__name__}: {err}. Fix "
                          f"{where}.config.") from None


def _tool_class(spec, where: str) -> type[Tool]:
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"{where} is missing; give the tool's class, e.g. rl_megatron.tools.calculator.CalculatorTool"
                          " or my_pkg.my_module:MyTool.")
    separator = ":" if ":" in spec else "."
    module_name, _, class_name = spec.strip().rpartition(separator)
    if not module_name or not class_name:
        raise ConfigError(f"{where}={spec!r} must be 'package.module.Class' or 'package.module:Class'.")
    module = import_module(module_name, f"{where}={spec!r}")
    tool_class = getattr(module, class_name, None)
    if not (isinstance(tool_class, type) and issubclass(tool_class, Tool)):
        found = "nothing" if tool_class is None else f"a {type(tool_class).__name__}"
        raise ConfigError(f"{where}={spec!r}: {class_name!r} in {module_name!r} is {found}, not a subclass of "
                          "rl_megatron.tools.base.Tool. Name a Tool subclass.")
    return tool_class


def _checked_schema(schema, where: str) -> dict:
    function = schema.get("function") if isinstance(schema, dict) else None
    if not isinstance(schema, dict) or schema.get("type") != "function" or not isinstance(function, dict):
        raise ConfigError(f"{where} must be an OpenAI function schema: {{type: function, function: {{name: ..., "
                          "description: ..., parameters: {type: object, properties: ...}}}}.")
    name = function.get("name")
    if not isinstance(name, str) or not name.strip():
        raise ConfigError(f"{where}.function.name is missing; give the name the model calls the tool by.")
    parameters = function.get("parameters")
    if parameters is not None:
        if not isinstance(parameters, dict):
            raise ConfigError(f"{where}.function.parameters is a {type(parameters).__name__}; give a JSON Schema "
                              "object, e.g. {type: object, properties: {x: {type: string}}, required: [x]}.")
        try:
            jsonschema.validators.validator_for(parameters).check_schema(parameters)
        except jsonschema.exceptions.SchemaError as err:
            at = "/".join(str(part) for part in err.absolute_path)
            raise ConfigError(f"{where}.function.parameters is not a valid JSON Schema{' at ' + at if at else ''}: "
                              f"{err.message}. Fix the schema.") from None
    return schema
