"""Streaming rollouts' controller side (rl_megatron/trainer/streaming.py) over scripted engines: AReaL's admission
rule, the queue handing out the oldest groups, weight syncs interrupting requests in flight, a slow group waited for
at its last batch within the bound, groups past it dropped and replaced, dynamic sampling per group, and the
checkpoint of the queue and the unfinished prompts. The real engines run it in tests/e2e/test_async.py."""
import asyncio
import threading
import time

import numpy as np
import pytest
import torch

from rl_megatron.agents import AgentRunner, SingleTurnLoop
from rl_megatron.agents.base import AgentContext
from rl_megatron.batch import Prompt, SampleStatus
from rl_megatron.checkpoint.run import load_rollouts_ahead, save_rollouts_ahead
from rl_megatron.config.schema import RolloutConfig
from rl_megatron.errors import ConfigError
from rl_megatron.rollout.completions import Completion, TurnRequest
from rl_megatron.rollout.engines import RolloutEngines
from rl_megatron.rollout.gate import EngineGate
from rl_megatron.trainer.dynamic_sampling import GroupFilter
from rl_megatron.trainer.metrics import Timer
from rl_megatron.trainer.rewards import Rewards
from rl_megatron.trainer.streaming import StreamSettings, Streaming, admissible, oldest_first

from helpers.actor_calls import one_at_a_time

PROMPT_TOKENS = 2  # a prompt is [answer length, 0]


class ScriptedEngines:
    """Engines decoding one token per request every 2 ms, token t of a request (seed + t) % 97, each request's answer
    as long as its prompt's first id says: the worker group `RolloutEngines` drives (serve, interrupt)."""

    def __init__(self, engines: int, routing: bool = False):
        self.routing = routing  # each completion with the experts of every position it fed: 1 in a request's first
        # part, 2 in a continuation (R3's engine routing)
        self.meshes = [{"rollout": (0, engines)}]
        self.running = [dict() for _ in range(engines)]
        self.requests: list[TurnRequest] = []

    def prepare_generation(self) -> None:
        pass

    async def call_shard(self, name: str, axis: str, engine: int, *args):
        return await getattr(self, name)(engine, *args)

    @one_at_a_time
    async def serve(self, engine: int, requests: list[TurnRequest], max_steps: int | None):
        self.requests += requests
        running = self.running[engine]
        for request in requests:
            running[request.request_id] = (request, [])
        finished, steps = [], 0
        while running and not finished and steps < (max_steps or 1 << 30):
            await asyncio.sleep(0.002)
            steps += 1
            for request_id, (request, tokens) in list(running.items()):
                tokens.append((request.seed + len(tokens)) % 97)
                answered = len(request.token_ids) - PROMPT_TOKENS + len(tokens) == request.token_ids[0]
                if answered or len(tokens) == request.max_tokens:
                    del running[request_id]
                    status = SampleStatus.OK if answered else SampleStatus.TRUNCATED
                    finished.append((request_id, self._completion(request, tokens, status)))
        return finished

    def _completion(self, request: TurnRequest, tokens: list[int], status: SampleStatus) -> Completion:
        routing = (np.full((len(request.token_ids) + len(tokens) - 1, 1, 1), 2 if "+" in request.request_id else 1)
                   if self.routing else None)
        return Completion(list(tokens), [-0.5] * len(tokens), status, routed_experts=routing)

    @one_at_a_time
    async def interrupt(self, engine: int):
        running = self.running[engine]
        cut = [(rid, self._completion(request, tokens, SampleStatus.ABORTED))
               for rid, (request, tokens) in running.items()]
        running.clear()
        return cut


class Prompts:
    """A loader's `next_batch`: prompts answered in `lengths[i]` tokens, cycling."""

    def __init__(self, lengths: list[int], batch: int, truths=None):
        self.lengths, self.batch, self.drawn = lengths, batch, 0
        self.truths = truths or ["vary"] * len(lengths)

    def next_batch(self) -> list[Prompt]:
        picked = [(self.drawn + i) % len(self.lengths) for i in range(self.batch)]
        self.drawn += self.batch
        return [Prompt([self.lengths[i], 0], "t", self.truths[i]) for i in picked]


def score(samples, step: int, round_: int) -> Rewards:
    """1 for every other sample of a prompt whose ground truth is "vary", else 0 (all alike)."""
    scores = torch.tensor([float(s.ground_truth == "vary" and i % 2) for i, s in enumerate(samples)])
    return Rewards(scores, scores.clone(), None, {})


def stream(lengths, batch_groups=2, n=2, bound=1, engines=1, max_tokens=64, group_filter=None, cap_groups=0,
           trained_steps=0, truths=None, routing=False):
    scripted, gate = ScriptedEngines(engines, routing), EngineGate()
    rollout_engines = RolloutEngines(scripted, run_seed=7, gate=gate)
    context = AgentContext(None, RolloutConfig(max_tokens=max_tokens), None, None)
    rollout_engines.agent_runner = AgentRunner(SingleTurnLoop(context), "single_turn", rollout_engines.serve,
                                               engines, 4096, pausing=rollout_engines.pausing())
    settings = StreamSettings(n, 1.0, batch_groups, bound, lambda step: max(0, step - 1), trained_steps, cap_groups)
    streaming = Streaming(rollout_engines, settings, gate, Prompts(lengths, batch_groups, truths), score,
                          group_filter)
    return streaming, rollout_engines, scripted


def update(streaming: Streaming, engines: RolloutEngines) -> None:
    """A trainer's weight sync: the engines get the next policy version."""
    with streaming.syncing(Timer(), engines.weight_version + 1):
        engines.weight_version += 1


def wait_for(condition, timeout=10.0):
    end = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.005)


def test_a_group_is_admitted_while_the_step_that_trains_it_is_within_the_bound():
    def trained_by(step):
        return step - 1

    # B = 2 groups a step, bound 1: with the engines at version 0, groups 0-3 (steps 1-2, versions 0-1) enter.
    assert [admissible(g, 2, 0, 1, trained_by) for g in range(6)] == [True] * 4 + [False] * 2
    assert [admissible(g, 2, 1, 1, trained_by) for g in range(7)] == [True] * 6 + [False]
    assert [admissible(g, 2, 0, 0, trained_by) for g in range(3)] == [True, True, False]
    # A critic's warm-up trains no actor: its steps are all trained by version 0.
    assert admissible(7, 2, 0, 1, lambda step: max(0, step - 3))


def test_the_queue_hands_out_the_oldest_groups_first():
    class G:
        def __init__(self, order):
            self.order = order

    taken, rest = oldest_first([G(3), G(0), G(2), G(1)], 2)
    assert [g.order for g in taken] == [0, 1] and [g.order for g in rest] == [2, 3]


def test_prompts_stream_in_up_to_the_bound_and_batches_take_the_oldest_groups_ready():
    """Group 0 is the longest: batch 1 does not wait for it (groups 1 and 2), batch 2 starts with it; without an
    update no more than (bound + 1) x B groups enter; an update lets B more in."""
    streaming, engines, scripted = stream([40, 3, 3, 3, 3, 3])
    try:
        rollout = streaming.take(1, Timer())
        assert [s.prompt_ids[0] for s in rollout.samples] == [3, 3, 3, 3]
        assert rollout.rewards.scores.tolist() == [0, 1, 0, 1] and rollout.metrics["async/inflight_groups"] >= 1
        wait_for(lambda: len(streaming.ready) == 2)
        time.sleep(0.05)
        assert streaming.accepted == 4 and not streaming.in_flight  # the bound: steps 1 and 2's groups only
        update(streaming, engines)
        wait_for(lambda: len(streaming.ready) == 4)
        assert streaming.accepted == 6
        rollout = streaming.take(2, Timer())
        assert [len(s.response_ids) for s in rollout.samples] == [40, 40, 3, 3]
        assert rollout.metrics["async/queue_groups"] == 2 and rollout.metrics["async/dropped"] == 0
        assert 0 <= rollout.metrics["async/engine_idle_share"] <= 1
        assert all(s.policy_version == 0 for s in rollout.samples)
    finally:
        streaming.close()
    # Each prompt's samples draw from its own seed (trainer.seed, the draw, its index) and the sample's index.
    ids = [r.request_id for r in scripted.requests]
    assert ids[:4] == ["train/1/0/0/0", "train/1/0/1/0", "train/1/1/0/0", "train/1/1/1/0"]


def test_a_weight_sync_interrupts_the_requests_in_flight_which_continue_on_the_new_weights():
    """... each token keeping the version that sampled it and (R3) the experts the engine routed it through."""
    streaming, engines, _ = stream([400, 400], batch_groups=1, n=1, engines=1, max_tokens=600, routing=True)
    try:
        streaming._start()
        wait_for(lambda: any(
            tokens for _, tokens in streaming.engines.group.running[0].values()))
        update(streaming, engines)
        rollout = streaming.take(1, Timer())
        [sample] = rollout.samples
        assert len(sample.response_ids) == 400 and sample.token_versions[0] == 0 and sample.token_versions[-1] == 1
        assert sample.policy_version == 0 and rollout.metrics["async/interrupted_requests"] >= 1
        first_part = sample.token_versions.count(0)
        routing = sample.routed_experts[:, 0, 0].tolist()
        assert len(routing) == PROMPT_TOKENS + 400 - 1
        assert routing == [1] * (PROMPT_TOKENS + first_part - 1) + [2] * (400 - first_part)
    finally:
        streaming.close()


def test_a_slow_group_is_passed_over_until_its_last_batch_within_the_bound_which_waits_for_it():
    """Group 0 (version 0, long) is still decoding at step 1: batch 1 takes group 1 without it. Batch 2 (trained by
    version 1) is the last that may train a version-0 group at bound 1, so it waits for group 0 rather than drop it."""
    streaming, engines, _ = stream([1000, 2, 2, 2, 2, 2, 2, 2], batch_groups=1, n=1, bound=1, max_tokens=1024)
    try:
        first = streaming.take(1, Timer())
        assert first.samples[0].prompt_ids[0] == 2 and 0 in streaming.in_flight
        update(streaming, engines)
        second = streaming.take(2, Timer())
        assert [len(s.response_ids) for s in second.samples] == [1000] and second.metrics["async/dropped"] == 0
        assert second.samples[0].policy_version == 0  # one version behind the trainer: within the bound
    finally:
        streaming.close()


def test_a_group_that_still_finishes_past_the_bound_is_dropped_and_its_place_refilled():
    """Two slow groups at their last batch (version 0 at bound 2, step 3) where a batch holds one: batch 3 waits for
    the older; the other's first tokens are too old for batch 4, so it is dropped when it finishes and a fresh
    prompt takes its place."""
    streaming, engines, _ = stream([1000, 1000, 2, 2, 2, 2, 2, 2], batch_groups=1, n=1, bound=2, max_tokens=1024)
    try:
        assert streaming.take(1, Timer()).samples[0].prompt_ids[0] == 2  # group 2: groups 0 and 1 are slow
        update(streaming, engines)
        assert streaming.take(2, Timer()).samples[0].policy_version == 1  # group 3, admitted at version 1
        update(streaming, engines)
        third = streaming.take(3, Timer())
        assert [len(s.response_ids) for s in third.samples] == [1000] and third.metrics["async/dropped"] == 0
        update(streaming, engines)
        wait_for(lambda: 1 not in streaming.in_flight)
        fourth = streaming.take(4, Timer())
        assert fourth.metrics["async/dropped"] == 1 and fourth.samples[0].prompt_ids[0] == 2
        assert all(s.policy_version >= 2 for s in fourth.samples)
    finally:
        streaming.close()


def test_dynamic_sampling_keeps_the_groups_that_vary_and_its_cap_pads_or_stops():
    kept = GroupFilter(2, 2, 1, "score", 0, "train")
    streaming, _, _ = stream([3, 3, 3, 3], group_filter=kept, truths=["same", "vary", "same", "vary"])
    try:
        rollout = streaming.take(1, Timer())
        assert [s.ground_truth for s in rollout.samples] == ["vary"] * 4
        assert rollout.metrics["filter/kept_groups"] == 2 and rollout.metrics["filter/prompts_used"] >= 3
    finally:
        streaming.close()
    capped = GroupFilter(2, 2, 1, "score", 1, "train")
    streaming, _, _ = stream([3, 3], group_filter=capped, cap_groups=2, truths=["same", "same"])
    try:
        rollout = streaming.take(1, Timer())  # nothing varies: one mini-batch of padding, out of the loss
        assert rollout.metrics["filter/reached_cap"] == 1 and rollout.metrics["filter/padded_groups"] == 1
        assert all(not any(s.loss_mask) for s in rollout.samples) and len(rollout.samples) == 2
    finally:
        streaming.close()
    streaming, _, _ = stream([3, 3], group_filter=GroupFilter(2, 2, 1, "score", 1, "stop"), cap_groups=2,
                             truths=["same", "same"])
    try:
        with pytest.raises(ConfigError, match="max_num_gen_batches=1"):
            streaming.take(1, Timer())
    finally:
        streaming.close()


def test_a_checkpoint_holds_the_queue_and_the_unfinished_prompts_which_a_new_stream_runs_first(tmp_path):
    streaming, engines, _ = stream([3, 3, 1000, 3], max_tokens=1024)
    try:
        streaming.take(1, Timer())
        update(streaming, engines)
        wait_for(lambda: len(streaming.ready) >= 1 and streaming.in_flight)
        state = streaming.finished()
        drawn = streaming.loader.drawn
        time.sleep(0.05)
        assert streaming.loader.drawn == drawn  # paused: the loader's position is the one saved
    finally:
        streaming.close()
    save_rollouts_ahead(str(tmp_path), state)
    saved = load_rollouts_ahead(str(tmp_path))
    assert [g.order for g in saved.ready] == [g.order for g in state.ready] and saved.draws == state.draws
    unfinished = [p.tag for p in saved.unfinished]
    assert "train/2/0" in unfinished  # the long prompt, in flight when saved

    resumed, engines, scripted = stream([3, 3, 1000, 3], max_tokens=1024, trained_steps=1)
    engines.weight_version = 1  # the checkpoint's policy
    resumed.restore(saved)
    try:
        first = resumed.take(2, Timer())
        update(resumed, engines)
        assert [s.prompt_ids for s in first.samples[:2]] == [saved.ready[0].samples[0].prompt_ids] * 2
        wait_for(lambda: len(scripted.requests) >= 2 * len(unfinished))
        started = sorted({r.request_id.rsplit("/", 2)[0] for r in scripted.requests[:2 * len(unfinished)]})
        assert started == sorted(unfinished)  # generated again from their start, before any new draw
    finally:
        resumed.close()


def test_validation_gets_the_engines_to_itself():
    streaming, _, _ = stream([30, 30, 30, 30])
    try:
        streaming.take(1, Timer())
        seen = []
        streaming.on_engines(lambda: seen.append(dict(streaming.in_flight)))
        assert seen == [{}]
    finally:
        streaming.close()


def test_closing_a_stream_ends_every_use_of_the_engines():
    streaming, engines, _ = stream([500, 500], max_tokens=600)
    streaming._start()
    wait_for(lambda: streaming.in_flight)
    streaming.close()
    assert not streaming.thread.is_alive()
    synced = threading.Event()

    def sync():
        with engines.gate.sync(1):
            synced.set()

    threading.Thread(target=sync, daemon=True).start()
    assert synced.wait(5)
