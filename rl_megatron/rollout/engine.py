"""The rollout engine as a seam: what the workers and the controller ask of an engine (`RolloutEngine`), the seeds it
samples with, and which class implements the engine `rollout.engine` names (`ENGINES`).

An engine (or one tensor-parallel shard of it) lives in each worker that hosts one (`workers/engine_host.py`). It
samples from exactly the policy being trained: it starts with placeholder weights, and the trainer writes its own
weights into the engine's parameters, in place, before any generation that follows an update (the phase machine,
`workers/phases.py`, decides when; the resharder writes `sync_targets`). vLLM implements it
(`rollout/vllm_engine.py::VLLMEngine`); another engine is a package with a class of these methods and a line in
`ENGINES`.
"""
from __future__ import annotations

import zlib
from typing import ClassVar, Protocol

import numpy as np
import torch

from rl_megatron.config.schema import Config, RolloutConfig
from rl_megatron.models.checks import MODEL_SOURCE
from rl_megatron.plugins import load_callable
from rl_megatron.registry import Registry
from rl_megatron.resharding.specs import Held
from rl_megatron.rollout.completions import Completion, TurnRequest

# rollout.engine -> the class implementing RolloutEngine, "package.module:Class": imported by the processes that use
# it (the workers hosting its engines, the driver for its `process_env`), never at config time.
# Each engine's class by dotted path: resolving a config imports no engine.
ENGINES: Registry[str] = Registry("rollout engine", "rollout.engine",
                                  "add yours to rl_megatron/rollout/engine.py::ENGINES")
ENGINES.add("vllm", "rl_megatron.rollout.vllm_engine:VLLMEngine")

SLEEP_LEVELS = (1, 2)  # 1: the weights wait in host memory; 2: they are dropped (the next sync rewrites them)
WAKE_TAGS = ("weights", "kv_cache")  # what a sleeping engine reallocates: its weights, then its KV cache


class RolloutEngine(Protocol):
    """One engine, or its shard on this rank: what `EngineHost`, `HybridWorker`, `RolloutWorker` and `AdapterSync`
    call. Built as `cls(model_path, cfg, dtype, seed, hf_overrides=..., load_format=..., routing=..., lora_rank=...)`
    (`__init__`), after `cls.configure_process()`. The shards of one engine get the same calls in the same order."""

    # The environment the driver gives every worker (nothing that depends on a device: each worker decides that in
    # `configure_process`), e.g. the engine's log level from the user's shell.
    process_env: ClassVar[dict[str, str]]
    # The adapter ranks an engine can start with (each serves adapters of any rank up to its own), ascending; ():
    # it serves none, and a LoRA policy's weights reach it merged.
    lora_ranks: ClassVar[tuple[int, ...]]
    adapters_on_output_layer: ClassVar[bool]  # whether it serves an adapter on lm_head
    # A module that imports the engine's library as a process hosting an engine would: the CPU fork server of
    # `workers.spawn` preloads it, so that the ranks it forks do not import it again.
    preload: ClassVar[str]
    sleeps: bool  # `sleep` frees device memory (GPU); False: sleep and wake_up do nothing, the phase machine skips them

    def __init__(self, model_path: str, cfg: RolloutConfig, dtype: str, seed: int, hf_overrides: dict | None = None,
                 load_format: str = "dummy", routing: bool = False, lora_rank: int = 0):
        """`seed`: the engine's own (its shards share it); `hf_overrides`: config.json fields to replace, as the
        trainer's model has them; `load_format`: "dummy" (every weight comes from the first sync, the parameters
        no sync writes zeroed) or "auto" (the folder's own weights); `routing`: each completion carries the experts
        of every position it fed (moe.engine_routing); `lora_rank`: serve the adapter `load_adapter` loads (0: none)."""

    @staticmethod
    def check_model(hf: dict, cuda: bool, source: str = MODEL_SOURCE) -> None:
        """Before anything starts: ConfigError, naming the field of `source` (config.json `hf`) and the fix, for a
        model the engine would fail on (`cuda`: whether its processes have CUDA)."""

    @staticmethod
    def configure_process() -> None:
        """This process's settings for the engine, by its own device, before the engine's library or Megatron is
        imported in it."""

    def generate(self, prompts: list[list[int]], n: int, temperature: float | None = None,
                 seeds: list[int] | None = None, max_tokens: int | None = None) -> list[Completion]:
        """`n` samples of each prompt (token ids), prompt-major (sample j of prompt i at i * n + j), at
        `temperature` (None: rollout.temperature), of up to `max_tokens` (None: rollout.max_tokens). With `seeds` (`request_seeds`), prompt i's samples depend on
        seeds[i] and j alone: not on earlier calls, the batch, or which engine runs them."""

    def serve(self, requests: list[TurnRequest], max_steps: int | None = None) -> list[tuple[str, Completion]]:
        """Continuous batching: add `requests` to those being decoded, then decode until at least one finishes (or
        none is left, or `max_steps` scheduler steps passed); the finished ones, by request id. Each request's
        samples depend on its own seed alone."""

    def interrupt(self) -> list[tuple[str, Completion]]:
        """Abort every request `serve` has not finished; what each sampled so far, status ABORTED, by request id."""

    def sleep(self, level: int = 2) -> None:
        """Free the engine's device memory (a level of `SLEEP_LEVELS`) while Megatron computes; the parameters keep
        their storage, so `sync_targets` stays valid. A no-op while any part is asleep, or where `sleeps` is False."""

    def wake_up(self, tags: tuple[str, ...] = WAKE_TAGS) -> None:
        """Reallocate what `sleep` freed (any of `WAKE_TAGS`): "weights" before a sync, "kv_cache" before generating;
        parts already awake are skipped."""

    def sync_targets(self) -> Held:
        """The parameters a weight sync writes in place on this rank, each with the HF regions it holds (none: a
        parameter no sync writes, kept zero). The resharder's plan is made from them once, at start."""

    def weights_updated(self) -> None:
        """After every write into `sync_targets`: drop what was computed with the old weights (cached KV) and remake
        what the engine derives from them."""

    def load_adapter(self, folder: str) -> None:
        """A LoRA policy's adapter (`lora_rank` > 0): the PEFT folder `folder` as the adapter of every request from
        now on, in place of the previous one. Called with no request running."""

    def adapter_mismatches(self, tensors: dict[str, torch.Tensor], scale: float) -> list[str]:
        """The adapter tensors (PEFT's names, unscaled; `scale`: alpha / r) that the loaded adapter does not hold bit
        for bit (resharding.verify)."""

    def release_process_groups(self) -> None:
        """Before the process ends: free what would outlive it (the shards' groups and their shared memory)."""

    def close(self) -> None:
        """Free the engine in a process that goes on (e.g. to start another)."""


def engine_class(name: str) -> type[RolloutEngine]:
    """The class implementing the engine `name` (rollout.engine), its module imported."""
    return load_callable(ENGINES[name], "rollout.engine")


def lora_merge_reason(cfg: Config) -> str | None:
    """Why a LoRA policy's engines receive its weights with the adapters merged; None when they load the adapters
    themselves, as an adapter of their own, on the base weights they were given once (also None without LoRA)."""
    lora, engine = cfg.actor.lora, engine_class(cfg.rollout.engine)
    if not lora.rank:
        return None
    if lora.merge:
        return "actor.lora.merge=true"
    if not engine.lora_ranks:
        return f"the {cfg.rollout.engine} engine serves no LoRA adapters (rollout.engine)"
    if "lm_head" in lora.target_modules and not engine.adapters_on_output_layer:
        return f"the {cfg.rollout.engine} engine serves no LoRA adapter on lm_head (actor.lora.target_modules)"
    if lora.rank > engine.lora_ranks[-1]:
        return (f"the {cfg.rollout.engine} engine serves LoRA adapters up to rank {engine.lora_ranks[-1]} "
                f"(actor.lora.rank={lora.rank})")
    if cfg.rollout.placement == "separate":
        return "engines in processes of their own receive merged weights (rollout.placement=separate)"
    return None


def engine_lora_rank(cfg: Config) -> int:
    """The adapter rank the engines start with: the smallest of the engine's `lora_ranks` that holds
    actor.lora.rank; 0 when they load no adapters (no LoRA, or merged weights: `lora_merge_reason`)."""
    if not cfg.actor.lora.rank or lora_merge_reason(cfg):
        return 0
    return next(rank for rank in engine_class(cfg.rollout.engine).lora_ranks if rank >= cfg.actor.lora.rank)


def request_seeds(run_seed: int, purpose: str, step: int, count: int) -> list[int]:
    """Sampling seeds of the `count` prompts of a step, a function of (trainer.seed, purpose, step) only: a resumed
    run draws the same samples. Below 2**32, so that an engine may seed sample j with seeds[i] + j (vLLM does)."""
    stream = np.random.SeedSequence([run_seed, zlib.crc32(purpose.encode()), step])
    return stream.generate_state(count, dtype=np.uint32).tolist()
