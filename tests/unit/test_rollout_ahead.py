"""Asynchronous RL's controller side, without engines: the gate between rollouts and weight syncs
(rl_megatron/rollout/gate.py), the generation thread running ahead of the trainer with its staleness bound
(rl_megatron/trainer/rollout_ahead.py), and partial rollouts in the turn scheduler (interrupt, sync, continue)."""
import asyncio
import threading
import time

import numpy as np
import pytest

from rl_megatron.batch import Sample, SampleStatus
from rl_megatron.checkpoint.run import load_rollouts_ahead, save_rollouts_ahead
from rl_megatron.rollout.completions import Completion, TurnRequest
from rl_megatron.rollout.gate import EngineGate, GateClosed
from rl_megatron.rollout.serving import Pausing, TurnScheduler, continuation_seed
from rl_megatron.trainer.metrics import Timer
from rl_megatron.trainer.rollout_ahead import Ahead, InStep, Rollout, drop_stale

from helpers.actor_calls import one_at_a_time


def sample(version: int, tokens: int = 2, versions=None) -> Sample:
    return Sample([1], [2] * tokens, [0.0] * tokens, "t", None, policy_version=version, token_versions=versions)


# -- the gate -----------------------------------------------------------------------------------------------------

def test_a_sync_waits_for_the_rollouts_using_the_engines_and_holds_new_ones_back():
    gate, events = EngineGate(), []
    gate.enter()

    def sync():
        with gate.sync() as waited:
            events.append(("synced", round(waited, 1)))
            time.sleep(0.2)
        events.append(("released",))

    syncing = threading.Thread(target=sync)
    syncing.start()
    time.sleep(0.3)
    assert gate.sync_waiting and events == []  # the rollout still uses the engines
    gate.leave()
    time.sleep(0.05)
    assert events == [("synced", 0.3)]
    start = time.perf_counter()
    with gate.use():  # a new use waits for the sync to finish
        assert events[-1] == ("released",)
    assert time.perf_counter() - start > 0.1
    syncing.join()


# -- rollouts ahead of the trainer -----------------------------------------------------------------------------------

class FakeRun:
    """A trainer loop over `Ahead` with scripted timings: generating a batch takes `gen_s`, training `train_s`; the
    engines hold `version`, bumped by each sync. Records when each batch was generated and trained."""

    def __init__(self, staleness: int, gen_s: float, train_s: float, steps: int):
        self.version, self.gen_s, self.train_s, self.steps = 0, gen_s, train_s, steps
        self.gate = EngineGate()
        self.ahead = Ahead(self.produce, staleness, steps, self.gate, partial=False)
        self.generated: dict[int, tuple[float, float]] = {}

    def produce(self, step: int) -> Rollout:
        start, version = time.perf_counter(), self.version
        time.sleep(self.gen_s)
        self.generated[step] = (start, time.perf_counter())
        return Rollout(step, [sample(version)])

    def run(self) -> list[tuple[dict, dict]]:
        trained = []
        for step in range(1, self.steps + 1):
            timer = Timer()
            rollout = self.ahead.take(step, timer)
            metrics = drop_stale(rollout.samples, trainer_version=step - 1, bound=self.ahead.staleness)
            time.sleep(self.train_s)
            with self.ahead.syncing(timer, step):
                self.version = step
            trained.append((metrics, timer.seconds))
        self.ahead.close()
        return trained


@pytest.mark.parametrize("staleness", [1, 2])
def test_batches_are_never_older_than_the_bound_and_one_step_off_reaches_it(staleness):
    trained = FakeRun(staleness, gen_s=0.05, train_s=0.05, steps=6).run()
    ages = [metrics["async/staleness/max"] for metrics, _ in trained]
    assert max(ages) <= staleness and not any(m["async/dropped"] for m, _ in trained)
    assert ages[0] == 0 and ages[-1] >= 1  # the first batch is on-policy; later ones lag


def test_one_step_off_generates_the_next_batch_while_the_trainer_trains():
    run = FakeRun(1, gen_s=0.2, train_s=0.2, steps=4)
    start = time.perf_counter()
    run.run()
    elapsed = time.perf_counter() - start
    # Synchronous: 4 x (0.2 + 0.2) = 1.6 s; overlapped: 0.2 + 4 x 0.2 (+ the sync waits) ~ 1.0 s.
    assert elapsed < 1.3
    assert run.generated[3][0] < run.generated[2][1] + 0.25  # batch 3 starts right after batch 2's sync


def test_a_sync_waits_for_the_batch_generating_and_counts_it_as_waiting_for_the_rollout():
    trained = FakeRun(1, gen_s=0.3, train_s=0.05, steps=3).run()
    _, seconds = trained[1]
    assert seconds["wait_for_rollout"] > 0.15  # training took 0.05 s of the next batch's 0.3 s


def test_finished_batches_restore_into_a_new_pipeline_as_they_were():
    run = FakeRun(2, gen_s=0.01, train_s=0.0, steps=5)
    run.ahead.take(1, Timer())
    pending = run.ahead.finished()
    assert [r.step for r in pending] == [2, 3]
    run.ahead.close()
    resumed = Ahead(lambda step: pytest.fail("restored batches are not generated again"), 2, 3, EngineGate(), False)
    resumed.restore(pending)
    assert resumed.take(2, Timer()).samples == pending[0].samples
    in_step = InStep(lambda step: Rollout(step, [sample(9)]))  # a synchronous run resuming an asynchronous checkpoint
    in_step.restore(pending)
    assert in_step.take(2, Timer()) is pending[0] and in_step.take(4, Timer()).samples[0].policy_version == 9


def test_drop_stale_keeps_samples_past_the_bound_out_of_the_loss():
    samples = [sample(5), sample(4), sample(2), sample(4, versions=[4, 5])]
    metrics = drop_stale(samples, trainer_version=5, bound=2)
    # Trained tokens (two a sample, the third sample's dropped): 3 sampled by version 5, 3 by version 4.
    assert metrics == {"async/staleness/mean": (0 + 1 + 3 + 1) / 4, "async/staleness/max": 3, "async/dropped": 1,
                       "async/partial_samples": 0.25, "async/token_staleness/0": 0.5,
                       "async/token_staleness/1": 0.5, "async/token_staleness/2": 0.0}
    assert samples[2].loss_mask == [0, 0] and samples[2].status == SampleStatus.ABORTED
    assert "trainer.rollout_staleness=2" in samples[2].error
    assert samples[1].loss_mask == [1, 1]


def test_a_sample_is_as_old_as_its_oldest_token():
    assert sample(7, versions=[4, 3]).policy_version == 3
    with pytest.raises(ValueError, match="token versions"):
        sample(0, tokens=2, versions=[1])


# -- partial rollouts in the turn scheduler ---------------------------------------------------------------------------

class PausableEngine:
    """One engine decoding one token per request per step (token t of a request: (seed + t) % 97, log-prob -t),
    `max_steps` steps per serve call at most, interruptible: what `VLLMEngine.serve` / `interrupt` do."""

    def __init__(self):
        self.running: dict[str, tuple[TurnRequest, list[int]]] = {}
        self.requests: list[TurnRequest] = []

    @one_at_a_time
    async def serve(self, engine: int, requests: list[TurnRequest]) -> list[tuple[str, Completion]]:
        self.requests += requests
        for r in requests:
            self.running[r.request_id] = (r, [])
        finished, steps = [], 0
        while self.running and not finished and steps < 3:
            await asyncio.sleep(0.01)
            steps += 1
            for request_id, (request, tokens) in list(self.running.items()):
                tokens.append((request.seed + len(tokens)) % 97)
                if len(tokens) == request.max_tokens:
                    del self.running[request_id]
                    finished.append((request_id, self._completion(tokens, SampleStatus.TRUNCATED)))
        return finished

    @one_at_a_time
    async def interrupt(self, engine: int) -> list[tuple[str, Completion]]:
        assert self.open_calls[engine] == ["interrupt"], "a serve call was made around the interrupt"
        cut = [(rid, self._completion(tokens, SampleStatus.ABORTED)) for rid, (_, tokens) in self.running.items()]
        self.running = {}
        return cut

    @staticmethod
    def _completion(tokens, status):
        return Completion(list(tokens), [-float(t) for t in range(len(tokens))], status)


def test_a_weight_update_mid_request_continues_it_with_the_new_version_and_keeps_the_old_tokens():
    engine, gate, version = PausableEngine(), EngineGate(), [0]
    scheduler = TurnScheduler(engine.serve, 1, pausing=Pausing(gate, engine.interrupt, lambda: version[0]))
    request = TurnRequest("r", [7], seed=10, max_tokens=20, temperature=1.0)

    def update_weights():
        time.sleep(0.06)  # a few tokens in
        with gate.sync():
            version[0] = 1

    updating = threading.Thread(target=update_weights)
    updating.start()
    [completion] = asyncio.run(scheduler.run([lambda: scheduler.generate(0, request)]))
    updating.join()
    first, second = engine.requests
    cut = len(second.token_ids) - 1  # the tokens sampled before the update
    assert 0 < cut < 20 and second.token_ids == [7] + completion.response_ids[:cut]
    assert second.max_tokens == 20 - cut and second.seed == continuation_seed(10, 1) and second.request_id == "r+1"
    assert completion.response_ids[:cut] == [(10 + t) % 97 for t in range(cut)]  # kept as sampled
    assert completion.response_ids[cut:] == [(second.seed + t) % 97 for t in range(20 - cut)]
    assert completion.log_probs == [-float(t) for t in range(cut)] + [-float(t) for t in range(20 - cut)]
    assert completion.versions == [0] * cut + [1] * (20 - cut)
    assert completion.status == SampleStatus.TRUNCATED


def test_interrupted_requests_continue_in_the_order_the_engine_took_them():
    # An engine holding more requests than it decodes at once (vLLM's max_num_seqs) takes them first come first
    # served: the continuations keep the oldest first, so a streaming batch's last groups are not decoded last.
    engine, gate, version = PausableEngine(), EngineGate(), [0]
    scheduler = TurnScheduler(engine.serve, 1, pausing=Pausing(gate, engine.interrupt, lambda: version[0]))
    requests = [TurnRequest(f"r{i}", [i], seed=i, max_tokens=40, temperature=1.0) for i in range(4)]

    def update_weights():
        time.sleep(0.06)
        with gate.sync():
            version[0] = 1

    updating = threading.Thread(target=update_weights)
    updating.start()
    completions = asyncio.run(scheduler.run([lambda r=r: scheduler.generate(0, r) for r in requests]))
    updating.join()
    assert [r.request_id for r in engine.requests] == ["r0", "r1", "r2", "r3", "r0+1", "r1+1", "r2+1", "r3+1"]
    assert all(len(c.response_ids) == 40 and c.versions[0] == 0 and c.versions[-1] == 1 for c in completions)


def test_without_a_sync_waiting_partial_rollouts_change_nothing():
    engine, gate = PausableEngine(), EngineGate()
    scheduler = TurnScheduler(engine.serve, 1, pausing=Pausing(gate, engine.interrupt, lambda: 4))
    requests = [TurnRequest(f"r{i}", [i], seed=i, max_tokens=5 + i, temperature=1.0) for i in range(3)]
    completions = asyncio.run(scheduler.run([lambda r=r: scheduler.generate(0, r) for r in requests]))
    assert [c.response_ids for c in completions] == [[(i + t) % 97 for t in range(5 + i)] for i in range(3)]
    assert all(c.versions == [4] * len(c.response_ids) for c in completions)
    with gate.sync() as waited:  # every use of the engines ended with the batch
        assert waited < 0.05


class FinishingAtInterrupt(PausableEngine):
    """An engine whose request has sampled all its tokens when a sync interrupts it (it finished between the
    scheduler's last step and the interrupt): the continuation is not needed, the trajectory ends there."""

    @one_at_a_time
    async def serve(self, engine: int, requests: list[TurnRequest]) -> list[tuple[str, Completion]]:
        self.requests += requests
        for r in requests:
            self.running[r.request_id] = (r, [(r.seed + t) % 97 for t in range(r.max_tokens)])
        await asyncio.sleep(0.02)
        return []


def test_a_batch_that_ends_while_its_engine_waits_for_a_sync_leaves_no_use_of_the_engines():
    # The multi-turn tool demo one-step-off with partial rollouts hung at its first sync: the batch ended while a
    # driver waited to enter the gate, and the use it then got was never ended.
    engine, gate, version = FinishingAtInterrupt(), EngineGate(), [0]
    scheduler = TurnScheduler(engine.serve, 1, pausing=Pausing(gate, engine.interrupt, lambda: version[0]))
    request = TurnRequest("r", [7], seed=10, max_tokens=2, temperature=1.0)

    def update_weights():
        time.sleep(0.05)
        with gate.sync():
            time.sleep(0.2)  # the batch ends meanwhile: its driver waits for this sync to enter
            version[0] = 1

    updating = threading.Thread(target=update_weights)
    updating.start()
    [completion] = asyncio.run(scheduler.run([lambda: scheduler.generate(0, request)]))
    updating.join()
    assert completion.response_ids == [10, 11] and completion.versions == [0, 0]
    next_sync = threading.Thread(target=lambda: gate.sync().__enter__(), daemon=True)
    next_sync.start()
    next_sync.join(timeout=5)
    assert not next_sync.is_alive(), "a use of the engines outlived its batch: the next weight sync waits forever"


def test_partial_rollouts_have_no_turn_synchronous_mode():
    with pytest.raises(ValueError, match="turn-synchronous"):
        TurnScheduler(PausableEngine().serve, 1, turn_synchronous=True,
                      pausing=Pausing(EngineGate(), PausableEngine().interrupt, lambda: 0))


# -- a fixed sync point (rollout.partial_rollout_sync_at_tokens) -------------------------------------------------------

SYNC_AT = 7


def run_with_fixed_sync_point(update_after_s: float, engines: int = 2):
    """Three requests of 20 tokens an engine at version 0, in a batch trained with version 1 (whose sync it holds
    back from its start, as `Ahead` does); the trainer's update to version 1 comes `update_after_s` seconds after
    the batch is started. The completions and what the engines were asked."""
    fleet, gate, version = [PausableEngine() for _ in range(engines)], EngineGate(), [0]
    scheduler = TurnScheduler(lambda e, requests: fleet[e].serve(e, requests), engines,
                              pausing=Pausing(gate, lambda e: fleet[e].interrupt(e), lambda: version[0], SYNC_AT, 1))
    gate.hold(1)

    def update_weights():
        time.sleep(update_after_s)
        with gate.sync(1):
            version[0] = 1

    requests = [TurnRequest(f"r{i}", [i], seed=i, max_tokens=20, temperature=1.0) for i in range(3 * engines)]
    updating = threading.Thread(target=update_weights)
    updating.start()
    completions = asyncio.run(scheduler.run([lambda i=i: scheduler.generate(i % engines, requests[i])
                                             for i in range(len(requests))]))
    updating.join()
    return completions, [request for engine in fleet for request in engine.requests]


@pytest.mark.parametrize("update_after_s", [0.0, 0.02, 0.2])
def test_a_fixed_sync_point_lands_the_update_at_the_same_token_however_late_it_comes(update_after_s):
    """An update ready before the engines start, or before the requests reach the point, waits for them there;
    one ready later finds them waiting: either way every request has SYNC_AT tokens of version 0, then the rest of
    version 1."""
    completions, asked = run_with_fixed_sync_point(update_after_s)
    for i, completion in enumerate(completions):
        assert completion.versions == [0] * SYNC_AT + [1] * (20 - SYNC_AT)
        assert completion.response_ids == ([(i + t) % 97 for t in range(SYNC_AT)]
                                           + [(continuation_seed(i, 1) + t) % 97 for t in range(20 - SYNC_AT)])
        assert completion.status == SampleStatus.TRUNCATED
    assert sorted((r.request_id, r.max_tokens) for r in asked) == sorted(
        [(f"r{i}", SYNC_AT) for i in range(6)] + [(f"r{i}+1", 20 - SYNC_AT) for i in range(6)])


def test_a_fixed_sync_point_waits_for_nothing_when_the_engines_hold_the_awaited_version():
    engine, gate = PausableEngine(), EngineGate()
    for awaited in (0, None):  # already there (the first batch), or nothing awaited (validation)
        scheduler = TurnScheduler(engine.serve, 1, pausing=Pausing(gate, engine.interrupt, lambda: 0, SYNC_AT,
                                                                   awaited))
        request = TurnRequest(f"r{awaited}", [1], seed=3, max_tokens=20, temperature=1.0)
        [completion] = asyncio.run(scheduler.run([lambda: scheduler.generate(0, request)]))
        assert completion.versions == [0] * 20 and engine.requests[-1].max_tokens == 20


def test_a_request_that_ends_before_the_sync_point_is_not_held():
    engine, gate = PausableEngine(), EngineGate()
    scheduler = TurnScheduler(engine.serve, 1, pausing=Pausing(gate, engine.interrupt, lambda: 0, SYNC_AT, 1))
    short = TurnRequest("short", [1], seed=3, max_tokens=SYNC_AT - 2, temperature=1.0)
    [completion] = asyncio.run(scheduler.run([lambda: scheduler.generate(0, short)]))
    assert completion.versions == [0] * (SYNC_AT - 2) and [r.request_id for r in engine.requests] == ["short"]


def test_a_batch_waiting_at_the_sync_point_fails_at_once_when_the_run_ends():
    engine, gate = PausableEngine(), EngineGate()
    scheduler = TurnScheduler(engine.serve, 1, pausing=Pausing(gate, engine.interrupt, lambda: 0, SYNC_AT, 1))
    request = TurnRequest("r", [1], seed=3, max_tokens=20, temperature=1.0)
    gate.hold(1)
    threading.Timer(0.1, gate.close).start()  # Ahead.close: no update will come
    with pytest.raises(GateClosed):
        asyncio.run(scheduler.run([lambda: scheduler.generate(0, request)]))


def test_a_batch_with_a_fixed_sync_point_holds_its_update_back_from_its_start():
    """`Ahead` holds the sync of the version that trains a batch from the moment the batch is started (in the
    trainer's thread), so the batch starts from the weights before it however fast the trainer syncs; a rollout
    that never reaches the point (here: no turn scheduler at all) releases it when it ends."""
    gate, events = EngineGate(), []

    def produce(step: int) -> Rollout:
        time.sleep(0.05)
        events.append(("generated", step))
        return Rollout(step, [sample(0)])

    ahead = Ahead(produce, 1, 3, gate, partial=True, trained_version=lambda step: step - 1)
    ahead.take(1, Timer())  # starts batch 2, trained with version 1
    with ahead.syncing(Timer(), 1):
        events.append(("synced", 1))
    ahead.close()
    assert events == [("generated", 1), ("generated", 2), ("synced", 1)]


def test_rollouts_pickle_for_checkpoints(tmp_path):
    routed = sample(1, versions=[1, 2])
    routed.routed_experts = np.arange(8, dtype=np.int16).reshape(2, 2, 2)  # the engines' routing (R3) too
    rollouts = [Rollout(3, [routed], seconds=0.5, engines_waited_s=0.1)]
    save_rollouts_ahead(str(tmp_path), rollouts)
    assert load_rollouts_ahead(str(tmp_path)) == rollouts
    assert np.array_equal(load_rollouts_ahead(str(tmp_path))[0].samples[0].routed_experts, routed.routed_experts)
    assert load_rollouts_ahead(str(tmp_path / "none")) == []
