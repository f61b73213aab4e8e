"""Multi-turn rollouts: agent loops (one coroutine per trajectory) that call tools between the model's turns.

    base.py            the AgentLoop interface a user subclasses (rollout.agent_loop=pkg.module:Class)
    trajectory.py      token in, token out: the model's tokens kept as sampled, the template's deltas spliced between
    harmony_deltas.py  the same deltas for gpt-oss's harmony format (rollout.multi_turn.format)
    tool_agent.py      the built-in tool-calling loop (rollout.agent_loop=tool_agent)
    turns.py           one model turn read (its text, its calls) and followed (the deltas): shared by every loop
    runner.py          a batch of prompts through a loop over the engines, each sample checked
    gateway/           an OpenAI-compatible endpoint per episode, for a user's own agent (rollout.agent.function)
"""
from __future__ import annotations

import os

from rl_megatron.agent_workers import AgentWorkers
from rl_megatron.agents.base import (AGENT_LOOPS, AgentContext, AgentLoop, SingleTurnLoop, TurnGenerator,
                                     register_agent_loop)
from rl_megatron.agents.gateway import GatewayLoop, GatewayServer, RunSampling
from rl_megatron.agents.harmony_deltas import HarmonyDeltas
from rl_megatron.agents.runner import AgentRunner
from rl_megatron.agents.tool_agent import ToolAgentLoop
from rl_megatron.agents.trajectory import ChatDeltas, Trajectory
from rl_megatron.config.choices import HARMONY, SINGLE_TURN
from rl_megatron.errors import ConfigError
from rl_megatron.plugins import load_callable
from rl_megatron.tools import ToolSet
from rl_megatron.tools.harmony import resolve_tool_format

__all__ = ["AGENT_LOOPS", "SINGLE_TURN", "AgentContext", "AgentLoop", "AgentRunner", "ChatDeltas", "GatewayLoop",
           "HarmonyDeltas", "SingleTurnLoop", "ToolAgentLoop",
           "Trajectory", "TurnGenerator", "agent_loop_class", "build_agent_loop", "register_agent_loop"]


def agent_loop_class(name: str) -> type[AgentLoop] | None:
    """The class rollout.agent_loop names, registered (None for single_turn) or as 'package.module:Class'; ConfigError
    naming the key otherwise."""
    cls = AGENT_LOOPS[name] if ":" not in name else load_callable(name, "rollout.agent_loop")
    if cls is not None and not (isinstance(cls, type) and issubclass(cls, AgentLoop)):
        raise ConfigError(f"rollout.agent_loop={name!r} is not a subclass of rl_megatron.agents.AgentLoop: subclass "
                          "it and implement `async def run(self, prompt, generate) -> Sample`.")
    return cls


def build_agent_loop(rollout, tokenizer, stop_ids: list[int], model_path: str = "policy") -> AgentLoop | None:
    """`rollout` (the config's section)'s agent loop with its tools and the chat template's deltas (hermes or harmony,
    as rollout.multi_turn.format says; None for single_turn,
    unless rollout.partial_rollout: its samples then go through the turn scheduler, which can interrupt and continue
    them); with rollout.agent.function, the gateway's loop over the user's agent (its server not yet started).
    ConfigError naming the key at fault, before any worker starts."""
    function = None
    if rollout.agent.function is not None:
        if rollout.agent_loop != SINGLE_TURN:
            raise ConfigError(f"rollout.agent.function={rollout.agent.function} runs your agent through the gateway, "
                              f"and rollout.agent_loop={rollout.agent_loop} is another agent loop: keep one (leave "
                              "rollout.agent_loop at single_turn with an agent function).")
        function = load_callable(rollout.agent.function, "rollout.agent.function")
        cls = GatewayLoop
    else:
        cls = agent_loop_class(rollout.agent_loop)
    if cls is None and not rollout.partial_rollout:
        return None
    if cls is None or issubclass(cls, SingleTurnLoop):  # one turn a trajectory: no tools, no chat template's deltas
        return (cls or SingleTurnLoop)(AgentContext(tokenizer, rollout, None, None))
    path = rollout.multi_turn.tool_config_path
    tools = ToolSet.from_config_file(path) if path else None
    if cls is ToolAgentLoop and tools is None:
        raise ConfigError("rollout.agent_loop=tool_agent needs tools: set rollout.multi_turn.tool_config_path to a "
                          "tool config file (e.g. configs/tools/python_calculator.yaml).")
    chat_format = resolve_tool_format(rollout.multi_turn.format, getattr(tokenizer, "chat_template", None))
    key = "rollout.agent.function" if function else "rollout.agent_loop"
    try:
        deltas = HarmonyDeltas(tokenizer, stop_ids) if chat_format == HARMONY else ChatDeltas(tokenizer, stop_ids)
    except ValueError as err:
        raise ConfigError(f"{key}={function and rollout.agent.function or rollout.agent_loop}: {err}") from None
    context = AgentContext(tokenizer, rollout, tools, deltas)
    if function is None:
        return cls(context)
    sampling = RunSampling(rollout.temperature, rollout.top_p, rollout.top_k, rollout.max_tokens)
    server = GatewayServer(rollout.agent.host, rollout.agent.port, os.path.basename(os.path.normpath(model_path)),
                           sampling)
    workers = AgentWorkers(rollout.agent.function, rollout.agent.num_workers) if rollout.agent.num_workers else None
    return GatewayLoop(context, function, server, rollout.max_model_len, workers)
