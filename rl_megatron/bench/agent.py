"""`python -m rl_megatron.bench agent --json`: a user's agent through the OpenAI-compatible gateway against the
in-process tool loop, on the same engine, rows, seeds and tokens.

The tool demo's task (rl_megatron/data/lookup.py: the first --batch rows, --n episodes each, the prompts rendered
with the `lookup` tool's schema as the data loader renders them) through the agent-loop runner twice, on one
in-process vLLM engine of a random-weight Qwen2 (by default 256 wide, 2 layers) with the tool demo's 29-token
tokenizer and chat template in Qwen2.5's tool format (rl_megatron/models/tiny.py):
  in_process             rollout.agent_loop=tool_agent with configs/tools/lookup.yaml (`ToolAgentLoop`);
  gateway                rollout.agent.function=examples/agents/lookup_openai.py:lookup_agent (`GatewayLoop`, its
                         calls timed: rl_megatron/bench/timed_agent.py): the agent calls the gateway over HTTP with
                         the official `openai` client and runs the tool itself, in the gateway's agent worker
                         processes (rollout.agent.num_workers, the default);
  gateway_in_controller  the same with rollout.agent.num_workers=0: the agents in the gateway's event loop.
The loops are built by `build_agent_loop`, as the trainer builds them, with every episode in flight at once
(rollout.agent.max_concurrency = the episodes), and run --repeats times each, alternately (the median time).

The workload: up to --max-tokens (default 32) tokens a model turn, rollout.ignore_eos off, so that the engine does
real work: the random model over 29 tokens ends a turn itself after ~19 tokens on average, and about half its turns
hold the one-token `lookup` call. At most 2 model turns an episode (rollout.multi_turn.max_assistant_turns=2, below
the example agent's 3 calls: its third call is refused after the second turn's tool replies are spliced, as the
in-process loop splices them; at 3 turns each, the agent would stop without sending the third turn's replies,
which the in-process loop keeps when they fit), and no cap on tool calls (the harness has none). The second figure,
`one_token`: the same rows at 1 token a turn (the demo's setting), where the engine's work is small and the HTTP
path's cost shows.

The engine runs in a thread of its own (built there: vLLM's CPU attention plans for the thread that built it), so
that the event loop (the scheduler, the gateway's episodes, the agents) runs on while it decodes, as the trainer's
controller does while its engines decode in their workers. Unlike there, the engine and the gateway share one
process (its GIL); the agent workers, and the engine, share the machine's cores with them.

Figures: episodes/s of each loop (the figure: the gateway's; the limit: the in-process loop's; `in_controller_*`:
the gateway's with its agents in the controller's event loop); the gateway's added
latency per call, median and p99: each call's time as the agent's client sees it (sent, answered and parsed) less
the time its generation took as the episode's `generate` handle waited for it (its queueing in the engine's batch
included); `lone_*`: the same with one episode at a time (no other call to queue behind); `same_tokens`: the share
of episodes whose response_ids, loss_mask and rollout_log_probs are identical between the loops;
`same_tokens_without_malformed_calls`: the same over the episodes whose in-process trajectory made no malformed call
(a malformed call reaches no OpenAI client, so the harness cannot answer it as the in-process loop does).
"""
from __future__ import annotations

import asyncio
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np
from rl_megatron import platform
from rl_megatron.agents import AgentLoop, AgentRunner, GatewayLoop, build_agent_loop
from rl_megatron.batch import Prompt, Sample
from rl_megatron.bench.timed_agent import SPEC, call_seconds
from rl_megatron.config.choices import SINGLE_TURN
from rl_megatron.config.schema import AgentConfig, MultiTurnConfig, RolloutConfig
from rl_megatron.data.loader import tokenize_prompts
from rl_megatron.data.lookup import lookup_rows
from rl_megatron.models.tiny import TOOLS
from rl_megatron.models.tokenizer import load_tokenizer
from rl_megatron.rollout.engine import request_seeds
from rl_megatron.rollout.vllm_engine import VLLMEngine
from rl_megatron.tools import ToolSet

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL_CONFIG = os.path.join(REPO, "configs", "tools", "lookup.yaml")
TURN_TOKENS = 32
MAX_TURNS = 2
TOOL_REPLY_TOKENS = 8  # rollout.multi_turn.max_tool_response_length, as the tool demo
MAX_PROMPT_TOKENS = 32  # data.max_prompt_length, as the tool demo
WARMUP_PROMPTS = 4
VOCAB = len(TOOLS.tokens)


@dataclass
class CallTimes:
    """One gateway episode's calls: the seconds of each generation as its `generate` handle waited for it, and of
    each answered call as the agent's client waited for it (in order: the example agent calls one at a time)."""
    engine: list[float] = field(default_factory=list)
    client: list[float] = field(default_factory=list)


class TimedGateway(AgentLoop):
    """`GatewayLoop` with each episode's calls timed on both sides (`CallTimes`): the engine's here, the client's
    where the agent ran (rl_megatron/bench/timed_agent.py, its metrics)."""

    def __init__(self, gateway: GatewayLoop):
        super().__init__(gateway.context)
        self.gateway, self.episodes = gateway, []

    async def run(self, prompt: Prompt, generate) -> Sample:
        times = CallTimes()
        self.episodes.append(times)

        async def timed(token_ids, max_tokens=None):
            start = time.perf_counter()
            completion = await generate(token_ids, max_tokens)
            times.engine.append(time.perf_counter() - start)
            return completion

        sample = await self.gateway.run(prompt, timed)
        if sample.agent_stats is not None:
            times.client = call_seconds(sample.agent_stats.metrics)
        return sample

    def close(self) -> None:
        self.gateway.close()


class EngineThread:
    """The engine, built and stepped in a thread of its own; `serve` is the runner's ServeFn."""

    def __init__(self, model_dir: str, rollout: RolloutConfig):
        self.pool = ThreadPoolExecutor(1, thread_name_prefix="rl_megatron-bench-engine")
        self.engine = self.pool.submit(VLLMEngine, model_dir, rollout, "float32", 0).result()

    async def serve(self, index: int, requests):
        return await asyncio.get_running_loop().run_in_executor(self.pool, self.engine.serve, requests)


def rollout_config(max_tokens: int, episodes: int, gateway: bool, workers: int | None = None) -> RolloutConfig:
    turns = MultiTurnConfig(tool_config_path=TOOL_CONFIG, max_assistant_turns=MAX_TURNS, max_tool_calls=10_000,
                            max_tool_response_length=TOOL_REPLY_TOKENS)
    turns.max_response_length = MAX_TURNS * (max_tokens + TOOL_REPLY_TOKENS)  # the config's default (preflight)
    agent = AgentConfig(function=SPEC if gateway else None, reward="scorer", max_concurrency=episodes)
    if workers is not None:
        agent.num_workers = workers
    return RolloutConfig(agent_loop=SINGLE_TURN if gateway else "tool_agent", agent=agent, multi_turn=turns,
                         max_tokens=max_tokens, max_model_len=MAX_PROMPT_TOKENS + turns.max_response_length,
                         kv_cache_bytes=256 << 20)


def lookup_prompts(tokenizer, count: int) -> list[Prompt]:
    """The first `count` rows of the lookup task, rendered as the data loader renders them (the tools' schemas)."""
    rows = lookup_rows()[:count]
    tools = ToolSet.from_config_file(TOOL_CONFIG).schemas()
    ids = tokenize_prompts([row["prompt"] for row in rows], tokenizer, True, tools)
    return [Prompt(row_ids, row["data_source"], row["ground_truth"], row["extra_info"], row["prompt"])
            for row, row_ids in zip(rows, ids)]


def same_sample(a: Sample, b: Sample) -> bool:
    return (a.response_ids == b.response_ids and a.loss_mask == b.loss_mask
            and a.rollout_log_probs == b.rollout_log_probs)


def agent_loop(engine: EngineThread, model_dir: str, tokenizer, max_tokens: int, episodes: int,
               gateway: bool, workers: int | None = None) -> AgentLoop:
    """The in-process tool loop, or the timed gateway loop (its agents in `workers` processes; None: the config's
    default), at `max_tokens` a turn, as the trainer builds them."""
    loop = build_agent_loop(rollout_config(max_tokens, episodes, gateway, workers), tokenizer,
                            engine.engine.stop_token_ids, model_dir)
    return TimedGateway(loop) if gateway else loop


def workload(engine: EngineThread, model_dir: str, tokenizer, prompts: list[Prompt], n: int, max_tokens: int,
             repeats: int, tag: str) -> dict:
    """Both loops over `prompts` at `max_tokens` per turn, `repeats` runs each (alternating; the median time):
    their figures."""
    episodes = len(prompts) * n
    seeds = request_seeds(0, "train", 0, len(prompts))
    built = {name: agent_loop(engine, model_dir, tokenizer, max_tokens, episodes, name != "in_process",
                              0 if name == "gateway_in_controller" else None)
             for name in ("in_process", "gateway", "gateway_in_controller")}
    runners = {name: AgentRunner(loop, name, engine.serve, engines=1, vocab_size=VOCAB)
               for name, loop in built.items()}
    seconds, samples = {name: [] for name in built}, {}
    try:
        for name, runner in runners.items():  # a warm-up: the gateway's server starts, the agent's client is made
            runner.run(prompts[:WARMUP_PROMPTS], seeds[:WARMUP_PROMPTS], 1, 1.0, f"{tag}-{name}-warmup")
        for name in ("gateway", "gateway_in_controller"):
            built[name].episodes.clear()
        for repeat in range(repeats):
            for name, runner in runners.items():
                start = time.perf_counter()
                samples[name] = runner.run(prompts, seeds, n, 1.0, f"{tag}-{name}-{repeat}")
                seconds[name].append(time.perf_counter() - start)
    finally:
        for loop in built.values():
            loop.close()
    timed = {name: float(np.median(times)) for name, times in seconds.items()}
    in_process, through_gateway = samples["in_process"], samples["gateway"]
    same = [same_sample(a, b) for a, b in zip(in_process, through_gateway)]
    clean = [s.tool_stats is not None and s.tool_stats.errors == 0 for s in in_process]  # lookup itself never fails
    stats = [s.agent_stats for s in through_gateway if s.agent_stats is not None]
    rate, in_process_rate = episodes / timed["gateway"], episodes / timed["in_process"]
    in_controller_rate = episodes / timed["gateway_in_controller"]
    return {"episodes_per_s": rate, "in_process_episodes_per_s": in_process_rate,
            "ratio_to_in_process": rate / in_process_rate, "gateway_s": timed["gateway"],
            "in_process_s": timed["in_process"], "agent_workers": built["gateway"].gateway.workers.count,
            "in_controller_episodes_per_s": in_controller_rate,
            "in_controller_ratio_to_in_process": in_controller_rate / in_process_rate,
            **latency(built["gateway"].episodes),
            **latency(built["gateway_in_controller"].episodes, "in_controller_"),
            "same_tokens": sum(same) / episodes,
            "same_tokens_without_malformed_calls": (sum(s for s, c in zip(same, clean) if c) / sum(clean)
                                                    if any(clean) else None),
            "episodes": episodes, "episodes_with_malformed_calls": episodes - sum(clean),
            "failed_episodes": episodes - len(stats) + sum(s.failed for s in stats),
            "prefix_breaks": sum(s.prefix_breaks for s in stats),
            "model_tokens": sum(s.model_tokens() for s in through_gateway), "max_tokens": max_tokens,
            "repeats": repeats}


def latency(episodes: list[CallTimes], prefix: str = "") -> dict:
    """The added latency of the calls of `episodes` (client seconds less engine seconds, call by call), in ms."""
    pairs = np.array([(client, engine_s) for times in episodes if len(times.client) == len(times.engine)
                      for client, engine_s in zip(times.client, times.engine)]).reshape(-1, 2) * 1e3
    added = pairs[:, 0] - pairs[:, 1]
    figures = {"added_latency_ms_median": float(np.median(added)),
               "added_latency_ms_p99": float(np.percentile(added, 99)),
               "client_ms_median": float(np.median(pairs[:, 0])), "engine_ms_median": float(np.median(pairs[:, 1])),
               "calls": len(pairs), "unpaired_episodes": sum(len(t.client) != len(t.engine) for t in episodes)}
    return {prefix + key: value for key, value in figures.items()}


def lone_calls(engine: EngineThread, model_dir: str, tokenizer, prompts: list[Prompt], max_tokens: int) -> dict:
    """The gateway's added latency with one episode at a time (rollout.agent.max_concurrency=1): a call with no
    other call to queue behind, the engine decoding it alone."""
    loop = agent_loop(engine, model_dir, tokenizer, max_tokens, 1, gateway=True)
    runner = AgentRunner(loop, "gateway", engine.serve, engines=1, vocab_size=VOCAB)
    seeds = request_seeds(0, "train", 0, len(prompts))
    try:
        runner.run(prompts[:1], seeds[:1], 1, 1.0, "agent-lone-warmup")
        loop.episodes.clear()
        runner.run(prompts, seeds, 1, 1.0, "agent-lone")
    finally:
        loop.close()
    return latency(loop.episodes, "lone_")


def run(args, model_dir: str) -> dict:
    if args.vocab != VOCAB:
        raise ValueError(f"--vocab {args.vocab}: the agent bench's model has the tool demo's {VOCAB} tokens")
    turn_tokens = args.max_tokens or TURN_TOKENS
    platform.setup()
    tokenizer = load_tokenizer(model_dir)
    engine = EngineThread(model_dir, rollout_config(turn_tokens, 1, False))
    prompts = lookup_prompts(tokenizer, args.batch)
    main = workload(engine, model_dir, tokenizer, prompts, args.n, turn_tokens, args.repeats, "agent")
    one_token = workload(engine, model_dir, tokenizer, prompts, args.n, 1, args.repeats, "agent-one-token")
    return {"bench": "agent", "value": main["episodes_per_s"], "unit": "episodes/s",
            "ratio": main["ratio_to_in_process"], "limit_name": "in-process tool loop episodes/s",
            "limit": main["in_process_episodes_per_s"], **main,
            **lone_calls(engine, model_dir, tokenizer, prompts, turn_tokens), "prompts": args.batch, "n": args.n,
            "one_token": one_token}
