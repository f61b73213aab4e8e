"""The rollout-engine side of a worker: a vLLM engine (or its TP shard) and what the controller asks of it. Hosted
by the actor's workers (`HybridWorker`, rollout.placement=colocated) or by workers of its own (`RolloutWorker`,
rollout.placement=separate)."""
from __future__ import annotations

from rl_megatron.config.schema import Config
from rl_megatron.resharding import engine_mismatches
from rl_megatron.workers.worker_group import dispatch


class EngineHost:
    rank: int
    world_size: int
    cfg: Config
    hf_config: dict

    def _init_engine_host(self) -> None:
        self.engine = None
        # Engine e spans ranks e*TP .. e*TP+TP-1 (TP = rollout.tensor_parallel_size).
        self.engine_tp = self.cfg.rollout.tensor_parallel_size
        self.engine_index = self.rank // self.engine_tp

    def _start_engine(self) -> None:
        from rl_megatron.config import moe_hf_overrides
        from rl_megatron.rollout.vllm_engine import VLLMEngine

        cfg = self.cfg
        # The shards of one engine must sample alike: they share a seed.
        self.engine = VLLMEngine(cfg.model.path, cfg.rollout, cfg.model.dtype,
                                 seed=cfg.trainer.seed + self.engine_index, eos_token_id=self.hf_config["eos_token_id"],
                                 hf_overrides=moe_hf_overrides(cfg, self.hf_config))

    def _rollout_axis(self) -> tuple[int, int, bool]:
        """(engine index, engines, whether this rank returns its engine's samples: the engine's first rank)."""
        return self.engine_index, self.world_size // self.engine_tp, self.rank % self.engine_tp == 0

    def _for_generation(self) -> None:
        self.engine.wake_up()

    @dispatch(axis="rollout")
    def generate(self, prompts: list[list[int]], seeds: list[int]):
        """rollout.n samples per prompt; prompt i's are drawn from seeds[i] (see `VLLMEngine.generate`)."""
        self._for_generation()
        return self.engine.generate(prompts, n=self.cfg.rollout.n, seeds=seeds)

    @dispatch(axis="rollout")
    def generate_for_validation(self, prompts: list[list[int]], seeds: list[int]):
        """rollout.val_n answers per prompt: greedy for one, sampled at rollout.temperature for more (pass@k)."""
        self._for_generation()
        n = self.cfg.rollout.val_n
        return self.engine.generate(prompts, n=n, temperature=0.0 if n == 1 else self.cfg.rollout.temperature,
                                    seeds=seeds)

    @dispatch(axis=None)
    def engine_mismatches(self, hf_state: dict) -> list[str]:
        """The HF tensors whose part in this worker's engine differs from `hf_state` (bit for bit)."""
        return engine_mismatches(self.engine.model(), hf_state)
