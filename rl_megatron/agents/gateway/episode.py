"""One episode of a user's agent: the calls it makes to the gateway, turned into a sample whose tokens are exactly the
ones the engine read and sampled.

    call 1:  messages -> the chat template (as the data's prompts are rendered)   -> prompt ids   a new segment
    call k:  messages == what the episode holds (call k-1's messages + the answer it got) + new messages
                      -> the new messages as the template's deltas after the answer -> context ids (loss mask 0)
             anything else (the harness rewrote, trimmed or summarised its history, or changed its tools)
                      -> rendered afresh                                           -> a new segment (a prefix break)
    every call: the engine's tokens, log-probs, policy versions and routing, appended as sampled (loss mask 1)

The answer the harness sends back is compared as the gateway returned it (its content and calls), never
re-tokenised: the model's own tokens stay in the context as sampled, as in the in-process tool loop
(`agents/trajectory.py`, verl#6921). The episode is one sample (the rollout keeps rollout.n samples per prompt, a
group per prompt): its segments back to back, each attending to itself only (`Trajectory.sample`), so that the
model's tokens of every segment are trained, each in the context the engine read.

Everything here runs in the rollout's event loop (the gateway's HTTP thread hands each call over), one call of an
episode at a time.
"""
from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import secrets

from rl_megatron.agents.base import AgentContext, TurnGenerator
from rl_megatron.agents.harmony_deltas import HarmonyDeltas
from rl_megatron.agents.gateway.openai_api import (ApiError, ChatRequest, CompletionRequest, GenerationOptions,
                                                   chat_completion, openai_tool_calls, text_completion,
                                                   token_logprobs, usage)
from rl_megatron.agents.trajectory import Trajectory
from rl_megatron.agents.turns import ModelTurn, after_turn, read_turn
from rl_megatron.batch import AgentStats, Prompt, Sample, SampleStatus
from rl_megatron.data.loader import tokenize_prompts
from rl_megatron.rollout.completions import Completion


class EpisodeEnded(Exception):
    """A call for an episode that has ended (its agent returned, failed or timed out)."""


class Episode:
    def __init__(self, prompt: Prompt, generate: TurnGenerator, context: AgentContext, model: str,
                 max_model_len: int):
        self.id = secrets.token_urlsafe(16)  # the episode's URL is its only credential
        self.prompt, self.generate, self.context, self.model = prompt, generate, context, model
        self.max_model_len = max_model_len
        self.segments: list[Trajectory] = []
        self.status = SampleStatus.OK  # how the last turn ended, or TRUNCATED when a limit refused a call
        self.stats = AgentStats(segments=0)
        self.ended = False
        self.lock = asyncio.Lock()  # one call at a time: a harness's concurrent calls are served in turn
        self._known: list = []  # what the last segment holds: its calls' messages and answers, as compared
        self._tools: str | None = None  # the last call's tools (a change renders afresh: the system prompt changes)
        self._turn: ModelTurn | None = None  # the last turn, which the next deltas follow
        self._call_names: dict[str, str] = {}  # tool call id -> the function it called (harmony replies name it)
        self._text: str | None = None  # /v1/completions: the last segment's text (prompt + completions)

    # -- the calls ---------------------------------------------------------------------------------------------------

    async def chat(self, request: ChatRequest) -> dict:
        async with self.lock:
            self._check_open()
            segment = self._chat_context(request)
            completion, turn, text, prompt_tokens = await self._sample(segment, request.options)
            calls = []
            if request.use_tools:
                calls = [(f"call_{self.stats.calls}_{i}", call.name, call.arguments)
                         for i, call in enumerate(turn.calls.calls)]
            self._call_names |= {call_id: name for call_id, name, _ in calls}
            harmony = isinstance(self.context.deltas, HarmonyDeltas)
            content = _cut(turn.answer, request.options.stop) if request.use_tools or harmony else text
            message = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                message["tool_calls"] = openai_tool_calls(calls)
            if turn.thinking:
                message["reasoning_content"] = turn.thinking
            self._known = [_compared(m) for m in request.messages] + [_compared(message)]
            finish = "tool_calls" if calls else "length" if completion.status == SampleStatus.TRUNCATED else "stop"
            logprobs = (token_logprobs(self._pieces(completion.response_ids), completion.log_probs)
                        if request.options.logprobs else None)
            return chat_completion(f"chatcmpl-{self.id[:8]}-{self.stats.calls}", self.model, message, finish,
                                   usage(prompt_tokens, len(completion.response_ids)), logprobs)

    async def complete(self, request: CompletionRequest) -> dict:
        async with self.lock:
            self._check_open()
            segment = self._completion_context(request.prompt)
            completion, _, text, prompt_tokens = await self._sample(segment, request.options)
            if self._text is not None:
                self._text += text
            finish = "length" if completion.status == SampleStatus.TRUNCATED else "stop"
            pieces = self._pieces(completion.response_ids) if request.options.logprobs else None
            return text_completion(f"cmpl-{self.id[:8]}-{self.stats.calls}", self.model, text, finish,
                                   usage(prompt_tokens, len(completion.response_ids)), pieces, completion.log_probs if pieces is not None else None)

    def end(self) -> None:
        self.ended = True

    def sample(self, failed: str | None = None) -> Sample:
        """The episode's sample: its segments (an episode that made no call: an empty, aborted one)."""
        if not self.segments:
            return Sample.answering(self.prompt, [], [], status=SampleStatus.ABORTED,
                                    error=failed or "the agent made no call to the gateway", agent_stats=self.stats)
        # A last turn that called tools expected their replies: the episode ended before the model's answer, as the
        # built-in loop's trajectory does at its turn limit.
        called = self._turn is not None and self._turn.attempts() > 0 and self.status == SampleStatus.OK
        first, *later = self.segments
        sample = first.sample(SampleStatus.TRUNCATED if called else self.status, later)
        sample.agent_stats = self.stats
        return sample

    # -- how a call's context is built -------------------------------------------------------------------------------

    def _chat_context(self, request: ChatRequest) -> Trajectory:
        compared = [_compared(m) for m in request.messages]
        tools = json.dumps(request.tools, sort_keys=True) if request.tools else None
        known = len(self._known)
        if (self.segments and self._text is None and tools == self._tools and len(compared) > known
                and compared[:known] == self._known):
            new = request.messages[known:]
            try:
                ids = after_turn(self.context.deltas, self._turn, self._for_deltas(new))
            except ValueError:  # a message the deltas cannot write after the turn: rendered afresh below
                ids = None
            if ids is not None:
                segment = self.segments[-1]
                self._check_room(segment, len(ids))
                segment.add_context(ids, new)
                segment.tool_stats.tokens += len(ids)
                return segment
        self._tools, self._text = tools, None
        ids = list(_rendered(self.context.tokenizer, json.dumps(request.messages),
                             json.dumps(request.tools) if request.tools else None))  # in the order sent
        return self._new_segment(ids, request.messages)

    def _completion_context(self, prompt: str | list[int]) -> Trajectory:
        if isinstance(prompt, list):
            segment = self.segments[-1] if self.segments else None
            if segment is not None and prompt[:len(segment.context())] == segment.context() \
                    and len(prompt) > len(segment.context()):
                extra = prompt[len(segment.context()):]
                self._check_room(segment, len(extra))
                segment.add_context(extra, [])
                # Raw tokens past the chat history and the text: a later chat or text call starts a new segment.
                self._known, self._text = [], None
                return segment
            self._text = None
            return self._new_segment(list(prompt), None)
        if self._text is not None and prompt.startswith(self._text) and len(prompt) > len(self._text):
            segment = self.segments[-1]
            extra = self.context.tokenizer.encode(prompt[len(self._text):], add_special_tokens=False)
            self._check_room(segment, len(extra))
            segment.add_context(extra, [])
            self._text = prompt
            return segment
        segment = self._new_segment(tokenize_prompts([prompt], self.context.tokenizer, False)[0], None)
        self._text = prompt
        return segment

    def _new_segment(self, ids: list[int], messages: list[dict] | None) -> Trajectory:
        if len(ids) >= self.max_model_len:
            raise ApiError(f"the prompt is {len(ids)} tokens; the engine's context is {self.max_model_len} "
                           "(rollout.max_model_len)", "messages", "context_length_exceeded")
        if self.segments:
            self.stats.prefix_breaks += 1
        self.stats.segments += 1
        segment = Trajectory(Prompt(ids, self.prompt.data_source, self.prompt.ground_truth,
                                    dict(self.prompt.extra_info), messages))
        self.segments.append(segment)
        self._known, self._turn, self.status = [], None, SampleStatus.OK
        return segment

    def _check_room(self, segment: Trajectory, added: int) -> None:
        limit = self.context.rollout.multi_turn.max_response_length
        if len(segment.response_ids) + added >= limit:
            self.status = SampleStatus.TRUNCATED
            raise ApiError(f"the episode's response would pass rollout.multi_turn.max_response_length={limit} tokens",
                           "messages", "context_length_exceeded")

    def _for_deltas(self, messages: list[dict]) -> list[dict]:
        """Harmony: a tool reply names the function it answers (from its call's id, else the turn's order)."""
        if not isinstance(self.context.deltas, HarmonyDeltas):
            return messages
        order = iter(self._turn.reply_names if self._turn else [])
        return [dict(m, name=m.get("name") or self._call_names.get(m.get("tool_call_id")) or next(order, None))
                if m["role"] == "tool" else m for m in messages]

    # -- sampling ----------------------------------------------------------------------------------------------------

    async def _sample(self, segment: Trajectory, options: GenerationOptions
                      ) -> tuple[Completion, ModelTurn, str, int]:
        """One generation after `segment`'s context: the completion, the turn read, its text (cut at a stop string)
        and the prompt's tokens."""
        limits, rollout = self.context.rollout.multi_turn, self.context.rollout
        if segment.turns >= limits.max_assistant_turns:
            self.status = SampleStatus.TRUNCATED
            raise ApiError(f"the episode has made rollout.multi_turn.max_assistant_turns={limits.max_assistant_turns}"
                           " calls in this conversation", "messages", "max_turns_exceeded")
        context = segment.context()
        room = min(limits.max_response_length - len(segment.response_ids), self.max_model_len - len(context))
        if room <= 0:
            self.status = SampleStatus.TRUNCATED
            raise ApiError(f"the conversation is {len(context)} tokens, the engine's context "
                           f"{self.max_model_len} (rollout.max_model_len)", "messages", "context_length_exceeded")
        max_tokens = min(options.max_tokens or rollout.max_tokens, rollout.max_tokens, room)
        self.stats.calls += 1
        completion = await self.generate(context, max_tokens)
        completion, stopped = _stopped(completion, options.stop, self._pieces)
        turn = read_turn(self.context.tokenizer, self.context.deltas, completion)
        if stopped:  # the model did not end its turn: the template's end-of-turn token follows it
            turn = dataclasses.replace(turn, ended=False)
        segment.add_turn(completion, turn.text, **turn.fields)
        stats = segment.tool_stats
        stats.calls += turn.attempts()
        stats.errors += len(turn.calls.errors)
        for call in turn.calls.calls:
            stats.by_tool[call.name] = stats.by_tool.get(call.name, 0) + 1
        self._turn, self.status = turn, completion.status
        text = self.context.tokenizer.decode(completion.response_ids, skip_special_tokens=True)
        return completion, turn, _cut(text, options.stop), len(context)

    def _pieces(self, ids: list[int]) -> list[str]:
        return [self.context.tokenizer.decode([i]) for i in ids]

    def _check_open(self) -> None:
        if self.ended:
            raise EpisodeEnded(self.id)


@functools.lru_cache(maxsize=1024)
def _rendered(tokenizer, messages: str, tools: str | None) -> tuple[int, ...]:
    """A conversation (as JSON) rendered and encoded as the data's prompts are; cached: GRPO's rollout.n episodes of
    a row open with the same messages."""
    return tuple(tokenize_prompts([json.loads(messages)], tokenizer, True,
                                  None if tools is None else json.loads(tools))[0])


def _compared(message: dict) -> tuple:
    """A message as two calls of an episode compare it: role, text, the calls' names and arguments (ids and
    bookkeeping keys a client may add or drop are left out)."""
    calls = tuple((c["function"]["name"], json.dumps(_arguments(c["function"]["arguments"]), sort_keys=True))
                  for c in message.get("tool_calls") or [])
    return message["role"], message.get("content") or "", calls, message.get("tool_call_id")


def _arguments(arguments) -> dict:
    return json.loads(arguments) if isinstance(arguments, str) else arguments


def _cut(text: str, stop: list[str]) -> str:
    positions = [text.find(s) for s in stop if s in text]
    return text[:min(positions)] if positions else text


def _stopped(completion: Completion, stop: list[str], pieces) -> tuple[Completion, bool]:
    """`completion` up to the token that completes its first stop string (vLLM's rule: the tokens after it are
    dropped; those kept are exactly as sampled), and whether a stop string cut it."""
    if not stop:
        return completion, False
    written = ""
    for kept, piece in enumerate(pieces(completion.response_ids), start=1):
        written += piece
        if any(s in written for s in stop):
            break
    else:  # no stop string in the response
        return completion, False
    if kept == len(completion.response_ids):
        return completion, completion.status != SampleStatus.OK
    routing = completion.routed_experts
    if routing is not None:
        routing = routing[:routing.shape[0] - (len(completion.response_ids) - kept)]
    return Completion(completion.response_ids[:kept], completion.log_probs[:kept], SampleStatus.OK,
                      None if completion.versions is None else completion.versions[:kept], routing), True
