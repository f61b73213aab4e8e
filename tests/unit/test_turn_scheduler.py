"""The per-trajectory scheduler of agent loops (rl_megatron/rollout/serving.py), over a scripted engine: a
continuous batch that decodes one token per running request per step, `STEP_S` seconds a step."""
import asyncio
import time

import pytest

from rl_megatron.batch import SampleStatus
from rl_megatron.rollout.serving import TurnScheduler
from rl_megatron.rollout.completions import Completion, TurnRequest

from helpers.actor_calls import one_at_a_time

STEP_S = 0.01


class ScriptedEngines:
    """Each request decodes `max_tokens` tokens, token t being (seed + t) % 97: what it produces depends on its own
    request alone, as with vLLM's per-request seeds. Records what each serve call added."""

    def __init__(self, engines: int):
        self.running = [{} for _ in range(engines)]
        self.added: list[tuple[int, list[str]]] = []
        self.depths: list[int] = []  # per call: the engine's calls not yet returned when it ended

    @one_at_a_time
    async def serve(self, engine: int, requests: list[TurnRequest]) -> list[tuple[str, Completion]]:
        self.added.append((engine, [r.request_id for r in requests]))
        running = self.running[engine]
        for r in requests:
            running[r.request_id] = (r, [])
        finished = []
        while running and not finished:
            await asyncio.sleep(STEP_S)
            for request_id, (request, tokens) in list(running.items()):
                tokens.append((request.seed + len(tokens)) % 97)
                if len(tokens) == request.max_tokens:
                    del running[request_id]
                    finished.append((request_id, Completion(tokens, [0.0] * len(tokens), SampleStatus.OK)))
        self.depths.append(len(self.open_calls[engine]))  # this call and those made after it
        return finished


def turn_length(index: int, turn: int) -> int:
    return 1 + (5 * index + 3 * turn) % 12  # turns of 1 to 12 tokens: some trajectories wait while others decode


def agent(scheduler, index: int, engines: int, turns: int, tool_s: float):
    """A trajectory of `turns` model turns of uneven lengths, each followed by a tool call taking 1 to 10 x
    `tool_s`."""
    async def run():
        context = [index]
        for turn in range(turns):
            request = TurnRequest(f"{index}/{turn}", list(context), seed=100 * index + turn,
                                  max_tokens=turn_length(index, turn), temperature=1.0)
            completion = await scheduler.generate(index % engines, request)
            context += completion.response_ids
            await asyncio.sleep(tool_s * (1 + (3 * index + 7 * turn) % 10))  # tools of uneven latency
        return context
    return run


def run_batch(trajectories: int, engines: int, turns: int, tool_s: float, turn_synchronous: bool):
    fake = ScriptedEngines(engines)
    scheduler = TurnScheduler(fake.serve, engines, turn_synchronous)
    start = time.perf_counter()
    results = asyncio.run(scheduler.run([agent(scheduler, i, engines, turns, tool_s) for i in range(trajectories)]))
    return results, fake.added, time.perf_counter() - start


def expected(index: int, turns: int) -> list[int]:
    context = [index]
    for turn in range(turns):
        seed = 100 * index + turn
        context += [(seed + t) % 97 for t in range(turn_length(index, turn))]
    return context


@pytest.mark.parametrize("engines", [1, 2])
def test_every_trajectory_gets_its_own_tokens_whatever_the_schedule(engines):
    for synchronous in (False, True):
        results, _, _ = run_batch(8, engines, turns=3, tool_s=0.0, turn_synchronous=synchronous)
        assert results == [expected(i, 3) for i in range(8)]


def test_turn_synchronous_rounds_never_mix_turns():
    _, added, _ = run_batch(6, 1, turns=3, tool_s=0.0, turn_synchronous=True)
    rounds = [ids for _, ids in added if ids]
    assert [sorted({i.split("/")[1] for i in ids}) for ids in rounds] == [["0"], ["1"], ["2"]]
    assert all(len(ids) == 6 for ids in rounds)


def test_asynchronous_turns_overlap_tool_latency_and_beat_the_synchronous_baseline():
    _, added, async_s = run_batch(8, 1, turns=3, tool_s=0.01, turn_synchronous=False)
    _, _, sync_s = run_batch(8, 1, turns=3, tool_s=0.01, turn_synchronous=True)
    # A later turn joins a batch that is still decoding others' turns (continuous batching across turns).
    assert any(len({i.split("/")[1] for i in ids}) > 1 for _, ids in added)
    assert async_s < 0.9 * sync_s, (async_s, sync_s)


def test_a_failing_trajectory_is_its_result_and_the_others_finish():
    fake = ScriptedEngines(1)
    scheduler = TurnScheduler(fake.serve, 1)

    async def broken():
        await scheduler.generate(0, TurnRequest("b/0", [1], 1, 2, 1.0))
        raise RuntimeError("tool state lost")

    results = asyncio.run(scheduler.run([agent(scheduler, 0, 1, 2, 0.0), lambda: broken()]))
    assert results[0] == expected(0, 2)
    assert isinstance(results[1], RuntimeError)


def test_an_engine_failure_fails_the_batch():
    async def dead_engine(engine, requests):
        raise ConnectionError("engine worker died")

    scheduler = TurnScheduler(dead_engine, 1)
    with pytest.raises(ConnectionError, match="worker died"):
        asyncio.run(scheduler.run([agent(scheduler, i, 1, 2, 0.0) for i in range(3)]))


def test_the_engines_next_call_is_made_before_the_current_one_returns():
    # The engine starts its next decode burst at once instead of waiting for the controller's round trip; never
    # more than one call waits behind the running one.
    engines = ScriptedEngines(1)
    scheduler = TurnScheduler(engines.serve, 1)
    asyncio.run(scheduler.run([agent(scheduler, i, 1, turns=2, tool_s=0.0) for i in range(6)]))
    assert max(engines.depths) == 2 and engines.depths.count(2) > len(engines.depths) // 2


def test_turns_of_one_token_make_no_call_ahead():
    # A call decodes at least one step, so it ends every one-token turn it holds: a call made ahead would find nothing
    # to decode and cost a round trip.
    engines = ScriptedEngines(1)
    scheduler = TurnScheduler(engines.serve, 1)
    requests = [TurnRequest(f"r{i}", [i], seed=i, max_tokens=1, temperature=1.0) for i in range(4)]
    completions = asyncio.run(scheduler.run([lambda r=r: scheduler.generate(0, r) for r in requests]))
    assert [c.response_ids for c in completions] == [[i % 97] for i in range(4)]
    assert engines.depths and set(engines.depths) == {1}
