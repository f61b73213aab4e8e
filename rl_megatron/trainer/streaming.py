"""Streaming rollouts (trainer.async_mode=streaming): the engines never drain to a batch boundary, and the trainer
takes its next batch as soon as enough prompt groups are done, oldest first.

    admission (an event loop in a thread of its own)       the engines (`TurnScheduler`)          the trainer
    prompt -> admitted while the bound allows -> its rollout.n trajectories, continued      take(step): the oldest
              (AReaL's rule, `admissible`)       across every weight update -> scored       data.train_batch_size
                                                 -> [kept if it varies] -> the queue  ->    groups of the queue

A prompt is admitted only while the version lag it could reach stays within the bound (trainer.rollout_staleness,
AReaL's admission rule): the g-th group accepted would be trained at step g // B + 1 (B groups a step), by that step's
policy version, so it enters only once the engines hold a version within the bound of that one. A weight sync
interrupts every request in flight; each continues on the new weights, each token's version recorded (the partial
rollouts' interrupt-and-continue, `rl_megatron.rollout.serving`). The trainer does not wait for a slow group, except
at the last batch the bound lets it join: there it waits for it, as one-step-off waits for its slowest sample,
instead of discarding its generation (the engines meanwhile decode the groups admitted after it). A group that still
finishes past the bound (more groups at their last batch than a batch holds) is dropped from the queue
(async/dropped) and its place freed for a new prompt; so is a group that dynamic sampling filters out
(algorithm.filter_groups: its samples all scored alike).

A checkpoint pauses admission and saves the queue and the prompts drawn but unfinished (`StreamState`); a resumed
run trains on the queue's groups first and generates the unfinished prompts again from their start, with their
seeds, before drawing new ones. Admission resumes with the next batch taken.
"""
from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

from rl_megatron.batch import Prompt, Sample
from rl_megatron.checkpoint import CheckpointError
from rl_megatron.data.loader import PromptLoader
from rl_megatron.rollout.engine import request_seeds
from rl_megatron.rollout.engines import RolloutEngines
from rl_megatron.rollout.gate import EngineGate
from rl_megatron.trainer.dynamic_sampling import GroupFilter
from rl_megatron.trainer.metrics import Timer
from rl_megatron.trainer.rewards import Rewards
from rl_megatron.trainer.rollout_ahead import Rollout, synced


@dataclass
class StreamPrompt:
    """A prompt drawn for the stream, with its sampling seed (trainer.seed, the draw, its place in it) and the tag
    its requests' ids start with."""
    prompt: Prompt
    seed: int
    tag: str


@dataclass(eq=False)
class Group:
    """A prompt's rollout.n samples, scored: what the queue holds. `order`: when it was admitted (oldest first)."""
    order: int
    source: StreamPrompt
    samples: list[Sample]
    rewards: Rewards
    admitted_at: float
    finished_at: float

    def oldest_version(self) -> int:
        return min(sample.policy_version for sample in self.samples)


@dataclass
class StreamState:
    """What a checkpoint of a streaming run holds: the groups ready, the prompts drawn but unfinished (in flight or
    not yet admitted), oldest first, and the draws from the data loader so far (the next draw's seeds)."""
    ready: list[Group]
    unfinished: list[StreamPrompt]
    draws: int


@dataclass(frozen=True)
class StreamSettings:
    n: int  # rollout.n
    temperature: float
    batch_groups: int  # data.train_batch_size: the groups a step trains on
    bound: int  # trainer.rollout_staleness
    version_training: Callable[[int], int]  # step -> the policy version that trains its batch
    trained_steps: int  # steps before this run's first (a resumed run's checkpoint step)
    cap_groups: int  # with dynamic sampling: groups finished for one batch before on_cap applies (0: no cap)

    @classmethod
    def of(cls, cfg, trained_steps: int, version_training: Callable[[int], int]) -> StreamSettings:
        rounds = cfg.algorithm.filter_groups.max_num_gen_batches if cfg.algorithm.filter_groups.enable else 0
        return cls(cfg.rollout.n, cfg.rollout.temperature, cfg.data.train_batch_size, cfg.trainer.rollout_staleness,
                   version_training, trained_steps, rounds * cfg.data.gen_batch_size)


def admissible(accepted: int, batch_groups: int, engine_version: int, bound: int,
               version_training: Callable[[int], int]) -> bool:
    """AReaL's admission rule: whether one more group may start while the engines hold `engine_version`, `accepted`
    groups having been taken in so far (trained, queued or in flight): the step that would train it, if none before
    it is dropped, is trained by a version at most `bound` ahead of the engines'."""
    return version_training(accepted // batch_groups + 1) - engine_version <= bound


def oldest_first(ready: list[Group], count: int) -> tuple[list[Group], list[Group]]:
    """The `count` oldest groups of `ready` (by admission), and the rest, each in admission order."""
    ordered = sorted(ready, key=lambda group: group.order)
    return ordered[:count], ordered[count:]


def drawn_prompts(loader: PromptLoader, run_seed: int, draw: int) -> list[StreamPrompt]:
    """Draw `draw` (1, 2, ...) of the stream: the loader's next batch, each prompt seeded by (trainer.seed, the draw,
    its index) alone, so that a resumed run samples a prompt as the original did."""
    prompts = loader.next_batch()
    seeds = request_seeds(run_seed, "train", draw, len(prompts))
    return [StreamPrompt(prompt, seed, f"train/{draw}/{i}") for i, (prompt, seed) in enumerate(zip(prompts, seeds))]


class Streaming:
    """The trainer's source of batches in streaming mode (`take`, `syncing`, `on_engines`, `finished`, `restore`,
    `close`, as `rollout_ahead.InStep` and `Ahead`). The stream starts with the first batch taken."""

    def __init__(self, engines: RolloutEngines, settings: StreamSettings, gate: EngineGate, loader: PromptLoader,
                 score: Callable[[list[Sample], int, int], Rewards], group_filter: GroupFilter | None):
        self.engines, self.settings, self.gate, self.loader = engines, settings, gate, loader
        self.score, self.filter = score, group_filter
        self.changed = threading.Condition()  # guards what both threads read: below, to `error`
        self.ready: list[Group] = []
        self.filtered: list[Group] = []  # dropped by dynamic sampling since the last batch taken
        self.accepted = settings.trained_steps * settings.batch_groups  # groups taken in: trained, queued, in flight
        self.in_flight: dict[int, StreamPrompt] = {}
        self.admitted_versions: dict[int, int] = {}  # in flight: the engines' version when admitted (<= its tokens')
        self.pending: list[StreamPrompt] = []  # drawn, not yet admitted
        self.draws = 0
        self.paused = False
        self.closed = False
        self.error: BaseException | None = None
        self.admitted = 0  # groups admitted by this process (their order)
        self.thread: threading.Thread | None = None
        self.last_take = time.perf_counter()
        self.seen_interrupts = 0
        self.seen_idle_s = 0.0

    # -- the trainer's side ------------------------------------------------------------------------------------------

    def take(self, step: int, timer: Timer) -> Rollout:
        """The oldest data.train_batch_size groups ready (waiting for them: timing_s/wait_for_rollout), less those past
        the bound, and waiting for those in flight that this batch is the last to admit within it (`_batch_ready`);
        with dynamic sampling, once its cap is reached, the groups kept padded (as `GroupFilter.fill`)."""
        self._start()
        settings, dropped = self.settings, 0
        oldest_allowed = settings.version_training(step) - settings.bound
        next_allowed = settings.version_training(step + 1) - settings.bound
        with timer("wait_for_rollout"), self.changed:
            self.paused = False
            while True:
                if self.error is not None:
                    raise self.error
                fresh = [group for group in self.ready if group.oldest_version() >= oldest_allowed]
                stale = len(self.ready) - len(fresh)
                self.ready, self.accepted, dropped = fresh, self.accepted - stale, dropped + stale * settings.n
                if self._batch_ready(oldest_allowed, next_allowed) or self._cap_reached():
                    break
                self._wake_admission()
                self.changed.wait()
            taken, self.ready = oldest_first(self.ready, settings.batch_groups)
            padding = self._padding(taken) if len(taken) < settings.batch_groups else []
            metrics = self._filter_metrics(taken, padding)
            self.filtered = []
            stream_metrics, engines_idle_s = self._stream_metrics(dropped)
        self._wake_admission()
        groups = taken + padding
        samples = [sample for group in groups for sample in group.samples]
        rollout = Rollout(step, samples, Rewards.cat([group.rewards for group in groups]), metrics | stream_metrics)
        rollout.seconds = max(g.finished_at for g in groups) - min(g.admitted_at for g in groups)
        rollout.engines_waited_s = engines_idle_s
        return rollout

    def syncing(self, timer: Timer, version: int):
        """Around the weight sync installing `version`: every request in flight is interrupted and continues after it;
        the engines' new version lets more prompts in."""
        return synced(self.gate, timer, version, after=self._wake_admission)

    def on_engines(self, fn: Callable[[], dict]):
        """`fn` (a validation) with the engines to itself: admission paused, the groups in flight finished."""
        with self.changed:
            self.paused = True
            self._wake_admission()
            self.changed.wait_for(lambda: not self.in_flight or self.error is not None)
        try:
            return fn()
        finally:
            with self.changed:
                self.paused = False
            self._wake_admission()

    def finished(self) -> StreamState:
        """What a checkpoint saves: admission paused (until the next batch is taken) so that nothing more is drawn
        from the data loader, whose position is saved beside it."""
        with self.changed:
            self.paused = True
            unfinished = [self.in_flight[order] for order in sorted(self.in_flight)] + self.pending
            return StreamState(oldest_first(self.ready, len(self.ready))[0], unfinished, self.draws)

    def restore(self, state: StreamState | list) -> None:
        if isinstance(state, list):
            if state:
                raise CheckpointError("The checkpoint holds batches generated ahead by trainer.async_mode="
                                      "one_step_off; resume it in that mode (or from a checkpoint of a streaming run).")
            return
        self.ready, self.pending, self.draws = list(state.ready), list(state.unfinished), state.draws
        for order, group in enumerate(self.ready):  # older than anything this process admits
            group.order = order
        self.admitted = len(self.ready)
        self.accepted += len(self.ready)

    def close(self) -> None:
        """Stop admitting, cancel the trajectories in flight, end the engines' uses."""
        self.gate.close()
        with self.changed:
            self.closed = True
        if self.thread is not None:
            self._wake_admission()
            self.thread.join()

    # -- the stream's side (its event loop) --------------------------------------------------------------------------

    def _start(self) -> None:
        if self.thread is None:
            self.engines.group.prepare_generation()
            started: Future = Future()
            self.thread = threading.Thread(target=asyncio.run, args=(self._serve(started),), name="streaming",
                                           daemon=True)
            self.thread.start()
            started.result()

    async def _serve(self, started: Future) -> None:
        self.loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()
        self.scheduler = self.engines.agent_runner.scheduler()
        self.scheduler.open()
        groups: set[asyncio.Task] = set()
        started.set_result(None)
        try:
            while not self.closed:
                while (admission := self._admit()) is not None:
                    task = asyncio.ensure_future(self._run_group(*admission))
                    groups.add(task)
                    task.add_done_callback(groups.discard)
                await self.wake.wait()
                self.wake.clear()
        finally:
            for task in groups:
                task.cancel()
            await asyncio.gather(*groups, return_exceptions=True)
            await self.scheduler.close()

    def _admit(self) -> tuple[int, StreamPrompt] | None:
        """The next prompt to start (its admission order), if the bound lets one in: the unfinished prompts a
        checkpoint held first, then the loader's, drawn as needed. One step under the lock, so that a checkpoint's
        pause leaves the loader's position as saved."""
        with self.changed:
            if self.closed or self.paused or self.error or not admissible(
                    self.accepted, self.settings.batch_groups, self.engines.weight_version, self.settings.bound,
                    self.settings.version_training):
                return None
            if not self.pending:
                self.draws += 1
                self.pending = drawn_prompts(self.loader, self.engines.run_seed, self.draws)
            order, source = self.admitted, self.pending.pop(0)
            self.admitted += 1
            self.accepted += 1
            self.in_flight[order] = source
            self.admitted_versions[order] = self.engines.weight_version
        return order, source

    async def _run_group(self, order: int, source: StreamPrompt) -> None:
        settings, runner = self.settings, self.engines.agent_runner
        admitted_at = time.perf_counter()
        try:
            results = await asyncio.gather(*(self.scheduler.add(runner.trajectory(
                self.scheduler, source.prompt, source.seed, j, settings.temperature, f"{source.tag}/{j}",
                (order * settings.n + j) % self.engines.count)) for j in range(settings.n)))
            samples = self.engines.stamped([runner.checked(j, result, source.prompt) for j, result in
                                            enumerate(results)])
            # Scored with the prompt's seed for a step (a model judging it draws from seeds of that, as on resume)
            rewards = await asyncio.to_thread(self.score, samples, source.seed, 1)
        except asyncio.CancelledError:
            raise
        except BaseException as error:  # noqa: BLE001 - an engine's or the scorer's failure is the run's
            with self.changed:
                self.error = self.error or error
                self.changed.notify_all()
            return
        group = Group(order, source, samples, rewards, admitted_at, time.perf_counter())
        with self.changed:
            del self.in_flight[order], self.admitted_versions[order]
            if self.filter is None or self.filter.varies(rewards):
                self.ready.append(group)
            else:
                self.filtered.append(group)
                self.accepted -= 1  # its place goes to another prompt
            self.changed.notify_all()
        self.wake.set()

    def _wake_admission(self) -> None:
        if self.thread is not None:
            self.loop.call_soon_threadsafe(self.wake.set)

    # -- metrics and dynamic sampling (under `changed`) --------------------------------------------------------------

    def _batch_ready(self, oldest_allowed: int, next_allowed: int) -> bool:
        """Whether the batch is there to take: the data.train_batch_size oldest groups among those ready and those in
        flight at their last chance (admitted at a version the next batch may not train, and this one may) are all
        ready. A slow group is passed over until its last chance, and then waited for rather than dropped."""
        last_chance = [order for order, version in self.admitted_versions.items()
                       if oldest_allowed <= version < next_allowed]
        candidates = sorted([group.order for group in self.ready] + last_chance)[:self.settings.batch_groups]
        return len(candidates) == self.settings.batch_groups and not set(candidates) & set(last_chance)

    def _cap_reached(self) -> bool:
        finished = len(self.ready) + len(self.filtered)
        return bool(self.filter and self.settings.cap_groups and finished >= self.settings.cap_groups)

    def _padding(self, taken: list[Group]) -> list[Group]:
        """Dynamic sampling's cap reached: on_cap=stop fails the run; on_cap=train pads the groups kept with filtered
        ones (kept out of the loss) up to whole mini-batches."""
        if self.filter.on_cap == "stop":
            raise self.filter.cap_error(len(taken), len(taken) + len(self.filtered))
        padding = self.filtered[:self.filter.padded_size(len(taken)) - len(taken)]
        for group in padding:
            for sample in group.samples:
                sample.loss_mask = [0] * len(sample.response_ids)
        return padding

    def _filter_metrics(self, taken: list[Group], padding: list[Group]) -> dict[str, float]:
        if self.filter is None:
            return {}
        generated = Rewards.cat([group.rewards for group in taken + self.filtered])
        return {"filter/kept_groups": len(taken), "filter/prompts_used": len(taken) + len(self.filtered),
                "filter/generated_reward/mean": generated.scores.mean().item(),
                "filter/generated_acc/mean": generated.acc.mean().item(),
                "filter/reached_cap": float(len(taken) < self.settings.batch_groups),
                "filter/padded_groups": len(padding)}

    def _stream_metrics(self, dropped: int) -> tuple[dict[str, float], float]:
        """Since the last batch taken: the requests interrupted by weight updates, the engines' idle share (and their
        mean idle seconds), the samples dropped past the bound; the groups in flight and queued now."""
        now, engines = time.perf_counter(), self.engines.count
        interrupted, idle_s = self.scheduler.interrupted, self.scheduler.idle_seconds(now)
        since = now - self.last_take
        # Both readings end at `now` and start at the last batch's: the share is at most 1 but for float rounding.
        idle_share = min(1.0, (idle_s - self.seen_idle_s) / (engines * since))
        metrics = {"async/interrupted_requests": interrupted - self.seen_interrupts,
                   "async/engine_idle_share": idle_share, "async/inflight_groups": len(self.in_flight),
                   "async/queue_groups": len(self.ready), "async/dropped": dropped}
        self.last_take, self.seen_interrupts, self.seen_idle_s = now, interrupted, idle_s
        return metrics, idle_share * since
