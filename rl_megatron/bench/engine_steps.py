"""The engines' limit in `python -m rl_megatron.bench async` (its `engine` figures): what one decode step of the
runs' engine costs holding one sequence and holding a whole step's samples, and from that the samples/s of an
engine whose every decode step is full, which no rollout schedule exceeds.

A long tail costs what a decode step costs at one sequence: the batch's last samples decode alone. Where a step
costs about the same however many sequences it holds (a GPU decoding a small batch, bound by reading the
weights), that cost is the whole step's, and streaming (new prompts in as samples end) wins most. Where the step grows
with the sequences (a CPU, bound by arithmetic), a lone sample's steps are cheap and a full engine's are slow, so
streaming gains less, and a slow sample needs more trainer steps to finish: `full_step_s / one_step_s` says which
case the machine is (docs/async.md).

The engine is built in the bench's process after the runs, as their engine worker builds it: the demo's model and
rollout settings with the runs' overrides, the thread count of the runs' workers (`threads_per_worker`: the
machine's cores shared by the trainer's worker and the engine's), random weights. Every request decodes exactly the
timed steps (ignore_eos): `width` sequences of the demo's prompt length are prefilled, then `STEPS` decode steps
timed.
"""
from __future__ import annotations

import contextlib
import os
import time

import torch

from rl_megatron.config.load import load
from rl_megatron.config.pools import threads_per_worker
from rl_megatron.preflight.resolve import resolve
from rl_megatron.rollout.completions import TurnRequest
from rl_megatron.rollout.engine import engine_class

STEPS = 16  # timed decode steps at each width, after WARMUP
WARMUP = 2


def decode_step_s(engine, width: int, prompt_ids: list[int]) -> float:
    """The mean seconds of one decode step of `engine` holding `width` sequences (prefill excluded)."""
    requests = [TurnRequest(f"width{width}/{i}", prompt_ids, seed=i, max_tokens=STEPS + WARMUP + 2, temperature=1.0)
                for i in range(width)]
    engine.serve(requests, max_steps=1)  # their prefill (the first token)
    for _ in range(WARMUP):
        engine.serve([], max_steps=1)
    start = time.perf_counter()
    for _ in range(STEPS):
        engine.serve([], max_steps=1)
    seconds = (time.perf_counter() - start) / STEPS
    engine.interrupt()  # nothing left running for the next width
    return seconds


def engine_limit(repo: str, config: str, overrides: list[str], samples_per_step: int,
                 response_length_mean: float) -> dict:
    """The `engine` figures of the runs of `config` with `overrides` (its paths relative to `repo`, as the runs' own):
    the decode step at one sequence and at `samples_per_step`, their ratio, and the samples/s of an engine decoding
    only full steps for answers of `response_length_mean` tokens."""
    with contextlib.chdir(repo):
        cfg = resolve(load(config, [*overrides, "rollout.ignore_eos=true"]))
        # As many threads as each of the runs' workers had (a local cluster offers the machine's cores), set before
        # vLLM starts: it freezes the count.
        torch.set_num_threads(threads_per_worker(cfg, os.cpu_count() or 1))
        engine = engine_class(cfg.rollout.engine)(cfg.model.path, cfg.rollout, cfg.model.dtype, seed=cfg.trainer.seed)
    try:
        prompt_ids = [1 + i % 9 for i in range(cfg.data.max_prompt_length)]  # in the demo's vocabulary
        one, full = decode_step_s(engine, 1, prompt_ids), decode_step_s(engine, samples_per_step, prompt_ids)
    finally:
        engine.close()
    return {"one_step_s": one, "full_step_s": full, "width": samples_per_step, "full_vs_one": full / one,
            "full_samples_per_s": samples_per_step / (response_length_mean * full)}
