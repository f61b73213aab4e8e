"""The built-in tool-calling loop (rollout.agent_loop=tool_agent): the model answers, its tool calls run, their
replies come back as tool messages, and the model goes on, until it answers without a call or a limit ends the
trajectory. Calls in the Hermes format (`<tool_call>{"name": ..., "arguments": ...}</tool_call>`, as Qwen2.5/Qwen3
write them), or in gpt-oss's harmony format (messages to=functions.NAME; rl_megatron/tools/harmony.py), as
rollout.multi_turn.format says: a harmony turn's answer, the one the reward reads, is its final channel.

Limits (rollout.multi_turn): max_assistant_turns, max_tool_calls and max_response_length (every token after the
prompt: the model's, the tools' and the template's). A trajectory that would pass one ends with status TRUNCATED:
what it has so far stays, masked as usual, and is scored like any other sample (its last assistant message is its
answer), so a policy that never stops calling tools earns what an unfinished answer earns.
"""
from __future__ import annotations

import asyncio
import time

from rl_megatron.agents.base import AgentLoop, TurnGenerator, register_agent_loop
from rl_megatron.agents.harmony_deltas import HarmonyDeltas
from rl_megatron.agents.trajectory import Trajectory
from rl_megatron.agents.turns import after_turn, read_turn
from rl_megatron.batch import Prompt, Sample, SampleStatus
from rl_megatron.tools import ToolCall, ToolOutcome

TRUNCATION_NOTE = "\n...(truncated)"


@register_agent_loop("tool_agent")
class ToolAgentLoop(AgentLoop):
    async def run(self, prompt: Prompt, generate: TurnGenerator) -> Sample:
        rollout, limits = self.context.rollout, self.context.rollout.multi_turn
        trajectory = Trajectory(prompt)
        harmony = isinstance(self.context.deltas, HarmonyDeltas)  # rollout.multi_turn.format
        while True:
            room = limits.max_response_length - len(trajectory.response_ids)
            if trajectory.turns == limits.max_assistant_turns or room <= 0:
                return trajectory.sample(SampleStatus.TRUNCATED)
            completion = await generate(trajectory.context(), min(rollout.max_tokens, room))
            turn = read_turn(self.context.tokenizer, self.context.deltas, completion)
            trajectory.add_turn(completion, turn.text, **turn.fields)
            if turn.attempts() == 0 or completion.status == SampleStatus.ABORTED:
                return trajectory.sample(completion.status)
            if trajectory.tool_stats.calls + turn.attempts() > limits.max_tool_calls:
                return trajectory.sample(SampleStatus.TRUNCATED)
            replies = await self._replies(turn.calls.calls, turn.calls.errors, trajectory)
            if harmony:  # each reply comes from the function it answers
                replies = [dict(reply, name=name) for reply, name in zip(replies, turn.reply_names)]
            spliced = after_turn(self.context.deltas, turn, replies)
            if len(trajectory.response_ids) + len(spliced) >= limits.max_response_length:
                return trajectory.sample(SampleStatus.TRUNCATED)  # no room left for another turn
            trajectory.add_context(spliced, replies)
            trajectory.tool_stats.tokens += len(spliced)

    async def _replies(self, calls: list[ToolCall], malformed: list[str], trajectory: Trajectory) -> list[dict]:
        """The tool messages answering a turn's calls, in order (the calls run concurrently); malformed calls are
        answered with their error."""
        stats, limits = trajectory.tool_stats, self.context.rollout.multi_turn
        tools_kwargs = trajectory.prompt.extra_info.get("tools_kwargs") or {}
        start = time.perf_counter()
        outcomes = await asyncio.gather(*(self.context.tools.call(call, tools_kwargs, limits.tool_timeout_s)
                                          for call in calls))
        stats.seconds += time.perf_counter() - start
        outcomes += [ToolOutcome.failure(message) for message in malformed]
        stats.calls += len(outcomes)
        stats.errors += sum(outcome.error for outcome in outcomes)
        stats.timeouts += sum(outcome.timed_out for outcome in outcomes)
        stats.slot_wait_seconds += sum(outcome.slot_wait_s for outcome in outcomes)
        for call in calls:
            stats.by_tool[call.name] = stats.by_tool.get(call.name, 0) + 1
        return [{"role": "tool", "content": self._kept(outcome.text)} for outcome in outcomes]

    def _kept(self, text: str) -> str:
        """A tool's reply cut to rollout.multi_turn.max_tool_response_length tokens (marked as cut)."""
        tokenizer, limit = self.context.tokenizer, self.context.rollout.multi_turn.max_tool_response_length
        ids = tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True)  # as ChatDeltas encodes it
        return text if len(ids) <= limit else tokenizer.decode(ids[:limit]) + TRUNCATION_NOTE
