"""Where each step's samples come from: generated in the step (trainer.rollout_staleness=0, `InStep`), or by a
generation thread running ahead of the trainer by up to N policy versions (N > 0, `Ahead`).

    step k:  take batch k (waiting if it is not ready: timing_s/wait_for_rollout)
             start batches k + 1 .. k + N: each samples from the weights the engines hold when it starts
             train on batch k -> update k -> sync the weights into the engines: between two batches, or, with partial
             rollouts, in the middle of one (the gate, `rl_megatron.rollout.gate`)

A batch started at step k - N has started after update k - N - 1 was synced and is trained at step k, after update
k - 1: its samples are at most N versions old. N = 1 is verl's one-step-off policy: the engines generate batch k + 1
while the trainer trains on batch k. The bound is checked again on every sample taken (`drop_stale`): one past it
would be dropped from the loss and counted in async/dropped, never trained on.

A checkpoint waits for the batches already started and saves them with the trainer's state (`finished`), so that a
resumed run trains on the same samples and draws the same prompts next (`restore`).
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from rl_megatron.batch import Sample, SampleStatus, TrainBatch
from rl_megatron.checkpoint import CheckpointError
from rl_megatron.errors import ConfigError
from rl_megatron.rollout.gate import EngineGate
from rl_megatron.trainer.metrics import Timer
from rl_megatron.trainer.rewards import ModelScores, Rewards


def checked_samples(samples: list[Sample], prompts: int, n: int, function: str) -> list[Sample]:
    """What the run's rollout function (`function`, rollout.function) returned for `prompts` prompts x `n`, checked:
    a list of prompts x n `Sample`s (prompt-major order is its contract)."""
    expected = prompts * n
    if not isinstance(samples, list) or len(samples) != expected or not all(isinstance(s, Sample) for s in samples):
        got = f"{len(samples)} items" if isinstance(samples, list) else f"a {type(samples).__name__}"
        raise ConfigError(f"rollout.function={function!r} returned {got} for {prompts} prompts x n={n}; it must "
                          f"return a list of {expected} rl_megatron.batch.Sample, the n samples of each prompt "
                          "together, in prompt order.")
    return samples


@dataclass
class Rollout:
    """One step's samples, and when the engines generated them (perf_counter seconds); with dynamic sampling also
    their rewards (scored while generating, to filter) and the filter's metrics; with a judge, its scores."""
    step: int
    samples: list[Sample]
    rewards: Rewards | None = None  # None: scored in the step, while Megatron computes
    metrics: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0  # generating
    engines_waited_s: float = 0.0  # the engines' idle time before it started (waiting for the trainer)
    judged: ModelScores | None = None  # judge.enable: the judge's scores of the samples, in their order


@contextmanager
def synced(gate: EngineGate, timer: Timer, version: int, after: Callable[[], None] = lambda: None) -> Iterator[None]:
    """Around the weight sync installing `version`: wait until the engines are free (counted as waiting for the
    rollout), keep them; then `after()`."""
    with gate.sync(version) as waited:
        timer.seconds["wait_for_rollout"] = timer.seconds.get("wait_for_rollout", 0.0) + waited
        yield
    after()


def batches_ahead(saved) -> list[Rollout]:
    """The batches a checkpoint holds (`restore`'s argument), refused when a streaming run saved its queue there."""
    if not isinstance(saved, list):
        raise CheckpointError("The checkpoint holds the queue of a streaming run (trainer.async_mode=streaming); "
                              "resume it in that mode.")
    return saved


class InStep:
    """Synchronous RL: each step generates its own batch, with the weights of the step's start."""

    def __init__(self, produce: Callable[[int], Rollout]):
        self.produce = produce
        self.restored: dict[int, Rollout] = {}

    def take(self, step: int, timer: Timer) -> Rollout:
        if step in self.restored:  # generated ahead by the run that saved the checkpoint (another staleness)
            return self.restored.pop(step)
        with timer("gen"):
            rollout = self.produce(step)
        rollout.seconds = timer.seconds["gen"]
        return rollout

    def syncing(self, timer: Timer, version: int):
        return nullcontext()

    def on_engines(self, fn: Callable[[], dict]):
        return fn()

    def finished(self) -> list[Rollout]:
        return []

    def restore(self, rollouts: list[Rollout]) -> None:
        self.restored = {rollout.step: rollout for rollout in batches_ahead(rollouts)}

    def close(self) -> None:
        pass


class Ahead:
    """Asynchronous RL: `produce(step)` runs in a generation thread, up to `staleness` steps ahead of the trainer,
    never past `last_step`. Without partial rollouts a whole batch holds the gate (one policy version per batch);
    with them the turn scheduler takes it per engine and lets syncs in mid-batch. With a fixed sync point
    (`trained_version` given: the version that trains a step's batch), a batch holds that version's sync back from
    the moment it is started until its requests reach the point, so that it starts from the weights it would start
    from however fast the trainer is."""

    def __init__(self, produce: Callable[[int], Rollout], staleness: int, last_step: int, gate: EngineGate,
                 partial: bool, trained_version: Callable[[int], int] | None = None):
        self.produce, self.staleness, self.last_step = produce, staleness, last_step
        self.gate, self.partial, self.trained_version = gate, partial, trained_version
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="rollout")
        self.started: dict[int, Future] = {}
        self.engines_free_since: float | None = None  # when the last batch ended

    def take(self, step: int, timer: Timer) -> Rollout:
        self._start(step)
        with timer("wait_for_rollout"):
            rollout = self.started.pop(step).result()
        for ahead in range(step + 1, step + self.staleness + 1):
            self._start(ahead)
        return rollout

    def syncing(self, timer: Timer, version: int):
        return synced(self.gate, timer, version)

    def on_engines(self, fn: Callable[[], dict]):
        """`fn` (e.g. a validation) in the generation thread, between batches; its result."""
        return self.thread.submit(self._using_engines, fn).result()

    def finished(self) -> list[Rollout]:
        """Every batch started, once it is done (a checkpoint saves them)."""
        return [self.started[step].result() for step in sorted(self.started)]

    def restore(self, rollouts: list[Rollout]) -> None:
        for rollout in batches_ahead(rollouts):
            done = Future()
            done.set_result(rollout)
            self.started[rollout.step] = done

    def close(self) -> None:
        """Drop the batches not started; the one generating finishes first (or fails at once, if it waits at a
        fixed sync point for an update that will not come)."""
        self.gate.close()
        self.thread.shutdown(wait=True, cancel_futures=True)

    def _start(self, step: int) -> None:
        if step <= self.last_step and step not in self.started:
            if self.trained_version is not None:
                self.gate.hold(self.trained_version(step))
            self.started[step] = self.thread.submit(self._generate, step)

    def _generate(self, step: int) -> Rollout:
        def generate() -> Rollout:
            start = time.perf_counter()
            rollout = self.produce(step)
            end = time.perf_counter()
            rollout.seconds = end - start
            rollout.engines_waited_s = 0.0 if self.engines_free_since is None else start - self.engines_free_since
            self.engines_free_since = end
            return rollout

        try:
            return self._using_engines(generate)
        finally:  # a rollout function that never reached the sync point (or failed) lets the update in
            if self.trained_version is not None:
                self.gate.release(self.trained_version(step))

    def _using_engines(self, fn: Callable):
        with nullcontext() if self.partial else self.gate.use():
            return fn()


def drop_stale(samples: list[Sample], trainer_version: int, bound: int) -> dict[str, float]:
    """Keep samples older than `bound` policy versions out of the loss (their loss mask zeroed, marked ABORTED);
    the staleness metrics of the batch: of its samples (each as old as its oldest token), and the histogram of its
    trained tokens, `async/token_staleness/<lag>` the share sampled `lag` versions behind the trainer."""
    staleness = [trainer_version - sample.policy_version for sample in samples]
    dropped = 0
    for sample, age in zip(samples, staleness):
        if age > bound:
            sample.loss_mask = [0] * len(sample.response_ids)
            sample.status = SampleStatus.ABORTED
            sample.error = f"{age} policy versions old, past trainer.rollout_staleness={bound}"
            dropped += 1
    versions = [len(set(s.token_versions)) > 1 for s in samples if s.token_versions]
    return {"async/staleness/mean": sum(staleness) / len(staleness), "async/staleness/max": max(staleness),
            "async/dropped": dropped, "async/partial_samples": sum(versions) / len(samples),
            **token_staleness(samples, trainer_version, bound)}


def versions_of_tokens(sample: Sample) -> list[int]:
    """The policy version of each response token: its own with partial rollouts, else the sample's."""
    return sample.token_versions or [sample.policy_version] * len(sample.response_ids)


def token_staleness(samples: list[Sample], trainer_version: int, bound: int) -> dict[str, float]:
    """The shares of the batch's trained tokens sampled 0 .. `bound` versions behind the trainer (each lag logged,
    0 where none; none of them when no token is trained)."""
    counts = [0] * (bound + 1)
    for sample in samples:
        for version, kept in zip(versions_of_tokens(sample), sample.loss_mask):
            if kept:
                counts[trainer_version - version] += 1
    total = sum(counts)
    return {f"async/token_staleness/{lag}": count / total for lag, count in enumerate(counts)} if total else {}


def current_version_mismatch(samples: list[Sample], batch: TrainBatch, version: int) -> dict[str, float]:
    """The largest |trainer - engine| log-prob difference over the tokens that the trainer's current policy version
    sampled (after a partial rollout's in-flight update, or in a batch that is not behind): as small as in
    synchronous RL when the engines' weights, KV cache included, were exactly that version's. Absent when the batch
    has no such token."""
    current = torch.zeros_like(batch.response_mask)
    for row, sample in enumerate(samples):
        versions = versions_of_tokens(sample)
        start = len(sample.prompt_ids) - 1
        current[row, start:start + len(versions)] = torch.tensor(
            [float(v == version and kept) for v, kept in zip(versions, sample.loss_mask)])
    if not current.any():
        return {}
    diff = (batch.old_log_probs.float() - batch.rollout_log_probs.float()).abs()
    return {"async/current_version_max_abs_logprob_diff": diff[current.bool()].max().item(),
            "async/current_version_tokens": current.sum().item() / batch.response_mask.sum().item()}
