"""Multi-turn rollouts: agent loops (one coroutine per trajectory) that call tools between the model's turns.

    base.py            the AgentLoop interface a user subclasses (rollout.agent_loop=pkg.module:Class)
    trajectory.py      token in, token out: the model's tokens kept as sampled, the template's deltas spliced between
    harmony_deltas.py  the same deltas for gpt-oss's harmony format (rollout.multi_turn.format)
    tool_agent.py      the built-in tool-calling loop (rollout.agent_loop=tool_agent)
    runner.py          a batch of prompts through a loop over the engines, each sample checked
"""
from __future__ import annotations

from rl_megatron.agents.base import AgentContext, AgentLoop, SingleTurnLoop, TurnGenerator
from rl_megatron.agents.harmony_deltas import HarmonyDeltas
from rl_megatron.agents.runner import AgentRunner
from rl_megatron.agents.tool_agent import ToolAgentLoop
from rl_megatron.agents.trajectory import ChatDeltas, Trajectory
from rl_megatron.config.choices import HARMONY, SINGLE_TURN
from rl_megatron.errors import ConfigError
from rl_megatron.plugins import load_callable
from rl_megatron.tools import ToolSet
from rl_megatron.tools.harmony import resolve_tool_format

AGENT_LOOPS = {"tool_agent": ToolAgentLoop}

__all__ = ["AGENT_LOOPS", "SINGLE_TURN", "AgentContext", "AgentLoop", "AgentRunner", "ChatDeltas", "HarmonyDeltas",
           "SingleTurnLoop", "ToolAgentLoop",
           "Trajectory", "TurnGenerator", "agent_loop_class", "build_agent_loop"]


def agent_loop_class(name: str) -> type[AgentLoop] | None:
    """The class rollout.agent_loop names (None for single_turn); ConfigError naming the key otherwise."""
    if name == SINGLE_TURN:
        return None
    if name in AGENT_LOOPS:
        return AGENT_LOOPS[name]
    if ":" not in name:
        raise ConfigError(f"rollout.agent_loop={name!r} is not a built-in loop ({SINGLE_TURN}, "
                          f"{', '.join(AGENT_LOOPS)}) nor 'package.module:Class' naming an AgentLoop subclass.")
    cls = load_callable(name, "rollout.agent_loop")
    if not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise ConfigError(f"rollout.agent_loop={name!r} is not a subclass of rl_megatron.agents.AgentLoop: subclass "
                          "it and implement `async def run(self, prompt, generate) -> Sample`.")
    return cls


def build_agent_loop(rollout, tokenizer, stop_ids: list[int]) -> AgentLoop | None:
    """`rollout` (the config's section)'s agent loop with its tools and the chat template's deltas (hermes or harmony,
    as rollout.multi_turn.format says; None for single_turn,
    unless rollout.partial_rollout: its samples then go through the turn scheduler, which can interrupt and continue
    them); ConfigError naming the key at fault, before any worker starts."""
    cls = agent_loop_class(rollout.agent_loop)
    if cls is None:
        return SingleTurnLoop(AgentContext(tokenizer, rollout, None, None)) if rollout.partial_rollout else None
    path = rollout.multi_turn.tool_config_path
    tools = ToolSet.from_config_file(path) if path else None
    if cls is ToolAgentLoop and tools is None:
        raise ConfigError("rollout.agent_loop=tool_agent needs tools: set rollout.multi_turn.tool_config_path to a "
                          "tool config file (e.g. configs/tools/python_calculator.yaml).")
    chat_format = resolve_tool_format(rollout.multi_turn.format, getattr(tokenizer, "chat_template", None))
    try:
        deltas = HarmonyDeltas(tokenizer, stop_ids) if chat_format == HARMONY else ChatDeltas(tokenizer, stop_ids)
    except ValueError as err:
        raise ConfigError(f"rollout.agent_loop={rollout.agent_loop}: {err}") from None
    return cls(AgentContext(tokenizer, rollout, tools, deltas))
