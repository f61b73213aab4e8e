"""`python -m rl_megatron.bench multi_turn --json`: a batch of multi-turn trajectories with tool latency, scheduled
asynchronously (every trajectory's next turn joins the engine's running batch as soon as its tool returns) against
turn-synchronously (every trajectory's turn k decoded as one batch, then every tool, then turn k + 1).

One in-process vLLM engine (the bench's random-weight Qwen2), --batch trajectories of 1 to --turns turns each
(uniform: some answer at once, some keep calling tools), through the agent-loop runner and scheduler the trainer
uses. Each turn generates 8 to 64 tokens and is followed by a tool call lasting 0.02 to 1 s (both log-uniform,
fixed per trajectory and turn: the long tail of a code sandbox's or a search API's latency) whose reply adds 16
tokens. Both schedules sample from the same per-turn seeds (`same_tokens`: the
share of trajectories whose tokens came out identical; batch composition may still move a near-tie). The figure is
the asynchronous schedule's trajectories per second; the ratio, its speed-up over the turn-synchronous one. The
process is set up as a rollout worker's (`platform.setup`) before the engine starts.

With `--peer vllm`, the serving path's own speed: the asynchronous schedule again with tools that return at once
(`serving_tokens_per_s`: model tokens per second, the mean of --repeats runs), against vLLM alone generating the
same turns directly (the mean of as many runs), turn k of every trajectory in one `LLM.generate` call, each with the
tool replies before it and the same seed (`vllm_peer.py`).
As in a rollout worker, the engine's steps run with Megatron's CUDA-to-CPU function mode switched off
(`platform/cpu_compat.device_mode_off`).
"""
from __future__ import annotations

import asyncio
import math
import random
import time

from rl_megatron import platform
from rl_megatron.agents import AgentContext, AgentLoop, AgentRunner, Trajectory
from rl_megatron.agents.runner import turn_seed
from rl_megatron.batch import Prompt, Sample, SampleStatus
from rl_megatron.bench.vllm_alone import Conversation
from rl_megatron.bench.vllm_peer import compare_with_vllm
from rl_megatron.config.schema import RolloutConfig
from rl_megatron.rollout.vllm_engine import VLLMEngine

TURN_TOKENS = (8, 64)
TOOL_SECONDS = (0.02, 1.0)
REPLY_TOKENS = 16


class LatencyLoop(AgentLoop):
    """Turns of preset lengths, each followed by a tool of preset latency (per trajectory: `extra_info`)."""

    async def run(self, prompt: Prompt, generate) -> Sample:
        trajectory = Trajectory(prompt)
        for turn_tokens, tool_seconds in prompt.extra_info["turns"]:
            completion = await generate(trajectory.context(), turn_tokens)
            trajectory.add_turn(completion, "")
            await asyncio.sleep(tool_seconds)
            trajectory.add_context(prompt.ids[:REPLY_TOKENS], [])
        return trajectory.sample(SampleStatus.OK)


def prompts(count: int, turns: int, vocab: int, seed: int = 0) -> list[Prompt]:
    rng = random.Random(seed)

    def log_uniform(low, high):
        return math.exp(rng.uniform(math.log(low), math.log(high)))

    return [Prompt([rng.randrange(3, vocab) for _ in range(32)], "bench", None,
                   {"turns": [(round(log_uniform(*TURN_TOKENS)), log_uniform(*TOOL_SECONDS))
                              for _ in range(rng.randint(1, turns))]})
            for _ in range(count)]


def with_instant_tools(batch: list[Prompt]) -> list[Prompt]:
    return [Prompt(p.ids, p.data_source, p.ground_truth,
                   {"turns": [(tokens, 0.0) for tokens, _ in p.extra_info["turns"]]}) for p in batch]


def conversations(batch: list[Prompt]) -> list[Conversation]:
    """`LatencyLoop`'s turns of `batch` as the AgentRunner seeds them (prompt i: seed i, its only sample)."""
    return [Conversation(p.ids, [(tokens, turn_seed(i, 0, turn))
                                 for turn, (tokens, _) in enumerate(p.extra_info["turns"])], p.ids[:REPLY_TOKENS])
            for i, p in enumerate(batch)]


def run(args, model_dir: str) -> dict:
    turns = args.turns
    rollout = RolloutConfig(max_tokens=TURN_TOKENS[1], max_model_len=32 + turns * (TURN_TOKENS[1] + REPLY_TOKENS),
                            kv_cache_bytes=256 << 20)
    platform.setup()
    engine_dtype, engine_seed, temperature = "float32", 0, 1.0
    engine = VLLMEngine(model_dir, rollout, engine_dtype, seed=engine_seed)

    async def serve(index, requests):
        # In the event loop's thread: vLLM's CPU attention plans for the thread that built the engine. The tools'
        # latency is wall time (timers) that runs on meanwhile, as a remote tool's or a subprocess's would.
        return engine.serve(requests)

    batch = prompts(args.batch, turns, args.vocab)
    loop = LatencyLoop(AgentContext(None, rollout, None, None))
    seconds, tokens = {}, {}
    for schedule, synchronous in (("warmup", False), ("turn_synchronous", True), ("asynchronous", False)):
        runner = AgentRunner(loop, "bench", serve, engines=1, vocab_size=args.vocab, turn_synchronous=synchronous)
        start = time.perf_counter()
        samples = runner.run(batch[:4] if schedule == "warmup" else batch, list(range(len(batch))), 1, temperature,
                             schedule)
        seconds[schedule] = time.perf_counter() - start
        tokens[schedule] = [s.response_ids for s in samples]
    same = sum(a == b for a, b in zip(tokens["asynchronous"], tokens["turn_synchronous"])) / len(batch)
    generated = sum(s.model_tokens() for s in samples)
    tool_wait = sum(seconds for p in batch for _, seconds in p.extra_info["turns"])
    value = args.batch / seconds["asynchronous"]
    figures = {}
    if args.peer == "vllm":
        runner = AgentRunner(loop, "bench", serve, engines=1, vocab_size=args.vocab)
        start = time.perf_counter()
        for _ in range(args.repeats):  # as many as vLLM alone's, each side's mean: single runs varied by ±15 %
            served = runner.run(with_instant_tools(batch), list(range(len(batch))), 1, temperature, "serving")
        serving_s = (time.perf_counter() - start) / args.repeats
        served_tokens = sum(s.model_tokens() for s in served)
        figures = {"serving_s": serving_s, "serving_tokens_per_s": served_tokens / serving_s,
                   **compare_with_vllm(engine, model_dir, engine_dtype, engine_seed, temperature, conversations(batch),
                                       served_tokens / serving_s, [s.response_ids for s in served],
                                       repeats=args.repeats, threads=args.threads)}
    return {"bench": "multi_turn", "value": value, "unit": "trajectories/s",
            "ratio": seconds["turn_synchronous"] / seconds["asynchronous"],
            "limit_name": "turn-synchronous trajectories/s", "limit": args.batch / seconds["turn_synchronous"],
            "asynchronous_s": seconds["asynchronous"], "turn_synchronous_s": seconds["turn_synchronous"],
            "trajectories": args.batch, "turns": turns, "model_tokens": generated,
            "tool_seconds_total": tool_wait, "same_tokens": same, **figures}
