"""The rollout-engine side of a worker: the engine rollout.engine names (`rollout/engine.py::RolloutEngine`), or its
TP shard, and what the controller asks of it. Hosted by the actor's workers (`HybridWorker`,
rollout.placement=colocated) or by workers of its own (`RolloutWorker`, rollout.placement=separate). As the base of
both worker classes it also holds what every worker does alike: recording the steps the controller profiles
(`workers/profiling.py`)."""
from __future__ import annotations

import os

from rl_megatron.batch import Prompt, Sample
from rl_megatron.config.schema import Config
from rl_megatron.models.hf_config import engine_routing, moe_hf_overrides
from rl_megatron.platform.determinism import make_process_deterministic
from rl_megatron.platform.startup import defer_garbage_collection
from rl_megatron.resharding import engine_mismatches
from rl_megatron.roles import Role, roles_name
from rl_megatron.rollout.completions import Completion, TurnRequest
from rl_megatron.rollout.engine import RolloutEngine, engine_class, engine_lora_rank
from rl_megatron.workers.phases import GENERATE
from rl_megatron.workers.profiling import StepProfiler
from rl_megatron.workers.worker_group import dispatch
from rl_megatron.workers.run_logs import redirect_output, worker_log_path


class EngineHost:
    rank: int
    world_size: int
    cfg: Config
    hf_config: dict
    roles: tuple[Role, ...]

    def _init_engine_host(self, logs: str) -> None:
        """`logs`: the folder of the run's worker logs (the file is named by the worker's first role)."""
        defer_garbage_collection()  # until `init` is done (startup_done)
        redirect_output(worker_log_path(logs, self.roles[0], self.rank))
        self.engine_class: type[RolloutEngine] = engine_class(self.cfg.rollout.engine)
        self.engine_class.configure_process()  # before Megatron or the engine's library is imported in this worker
        if self.cfg.trainer.deterministic:  # before CUDA starts; this node's own environment is checked too
            make_process_deterministic(os.environ)
        trainer = self.cfg.trainer
        self.profiler = StepProfiler(trainer.profile_dir, f"{roles_name(self.roles)}_rank{self.rank}",
                                     records=self.rank in trainer.profile_ranks)
        self.engine: RolloutEngine | None = None
        # Engine e spans ranks e*TP .. e*TP+TP-1 (TP = rollout.tensor_parallel_size).
        self.engine_tp = self.cfg.rollout.tensor_parallel_size
        self.engine_index = self.rank // self.engine_tp

    def _start_engine(self) -> None:
        cfg = self.cfg
        # The shards of one engine must sample alike: they share a seed.
        self.engine = self.engine_class(cfg.model.path, cfg.rollout, cfg.model.dtype,
                                        seed=cfg.trainer.seed + self.engine_index,
                                        hf_overrides=moe_hf_overrides(cfg, self.hf_config),
                                        routing=engine_routing(cfg, self.hf_config), lora_rank=engine_lora_rank(cfg))

    def _rollout_axis(self) -> tuple[int, int, bool]:
        """(engine index, engines, whether this rank returns its engine's samples: the engine's first rank)."""
        return self.engine_index, self.world_size // self.engine_tp, self.rank % self.engine_tp == 0

    @dispatch(axis="rollout", phase=GENERATE)
    def generate(self, prompts: list[Prompt], seeds: list[int], *, n: int, temperature: float,
                 max_tokens: int | None = None) -> list[Sample]:
        """`n` samples per prompt, prompt-major; prompt i's are drawn from seeds[i] (see `RolloutEngine.generate`)."""
        completions = self.engine.generate([p.ids for p in prompts], n=n, temperature=temperature, seeds=seeds,
                                           max_tokens=max_tokens)
        return [Sample.answering(prompts[i // n], c.response_ids, c.log_probs, status=c.status,
                                 routed_experts=c.routed_experts)
                for i, c in enumerate(completions)]

    @dispatch(axis=None, phase=GENERATE)
    def prepare_generation(self) -> None:
        """Enter generation on every worker together (a weight sync is collective), before the controller drives
        engines one at a time with `serve`."""

    def serve(self, requests: list[TurnRequest], max_steps: int | None = None) -> list[tuple[str, Completion]]:
        """`RolloutEngine.serve`: called on one engine's shards at a time (`WorkerGroup.call_shard`)."""
        return self.engine.serve(requests, max_steps)

    def interrupt(self) -> list[tuple[str, Completion]]:
        """`RolloutEngine.interrupt`, on one engine's shards (partial rollouts, before a weight update)."""
        return self.engine.interrupt()

    def start_profile(self, step: int, phase: str) -> None:
        """Record `phase` of `step` from now (on trainer.profile_ranks; the others return at once)."""
        self.profiler.start(step, phase)

    def stop_profile(self, step: int, phase: str) -> str | None:
        """The path of the trace of `phase` of `step`, written now; None on a rank that does not record it."""
        return self.profiler.stop(step, phase)

    @dispatch(axis=None)
    def engine_mismatches(self, hf_state: dict) -> list[str]:
        """The HF tensors whose part in this worker's engine differs from `hf_state` (bit for bit)."""
        return engine_mismatches(self.engine.sync_targets(), hf_state)
