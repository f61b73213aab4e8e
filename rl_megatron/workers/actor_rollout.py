"""The hybrid actor+rollout worker: one Ray actor per device holding one Megatron shard of the policy and one
vLLM engine. Train and generate share the device in turn; after each update the new weights go from the
Megatron shards into the engine (`sync_weights`, through the resharding module).
"""
from __future__ import annotations

import ray
import torch

from rl_megatron.config.schema import Config
from rl_megatron.resharding import Resharder, SyncStats, engine_mismatches, vllm_targets
from rl_megatron.resharding.shared_params import unlink_shared_parameters
from rl_megatron.workers.distributed import free_port, init_distributed, owns_dp_output
from rl_megatron.workers.worker_group import dispatch


class ActorRolloutWorker:
    def __init__(self, rank: int, world_size: int, cfg: Config, hf_config: dict, optimizer_steps: int,
                 threads: int):
        self.rank, self.world_size = rank, world_size
        self.cfg, self.hf_config, self.optimizer_steps = cfg, hf_config, optimizer_steps
        # Engine e spans ranks e*TP .. e*TP+TP-1 (TP = rollout.tensor_parallel_size).
        self.engine_tp = cfg.rollout.tensor_parallel_size
        self.engine_index = rank // self.engine_tp
        # Before vLLM starts: its CPU worker turns torch.set_num_threads into a no-op afterwards.
        torch.set_num_threads(threads)

    def rendezvous(self) -> tuple[str, int]:
        return ray.util.get_node_ip_address(), free_port()

    def init(self, master_addr: str, master_port: int) -> None:
        from rl_megatron.rollout.vllm_engine import VLLMEngine
        from rl_megatron.workers.megatron_actor import MegatronActor

        cfg = self.cfg
        init_distributed(self.rank, self.world_size, master_addr, master_port,
                         cfg.actor.tensor_model_parallel_size, cfg.actor.pipeline_model_parallel_size, cfg.trainer.seed,
                         vpp=cfg.actor.virtual_pipeline_model_parallel_size, ep=cfg.actor.expert_model_parallel_size)
        self.actor = MegatronActor(cfg, self.hf_config, self.optimizer_steps)
        # The shards of one engine must sample alike: they share a seed.
        self.engine = VLLMEngine(cfg.model.path, cfg.rollout, cfg.model.dtype,
                                 seed=cfg.trainer.seed + self.engine_index, eos_token_id=self.hf_config["eos_token_id"])
        # The plan from the trainer's layout to the engines' is made (and checked) once, here.
        self.resharder = Resharder(*self.actor.weight_sources(), vllm_targets(self.engine.model()),
                                   bucket_bytes=cfg.resharding.bucket_mb << 20, channel=cfg.resharding.channel,
                                   verify=cfg.resharding.verify)

    def close(self) -> None:
        self.resharder.close()
        self.engine.close()
        unlink_shared_parameters()

    def mesh(self) -> dict:
        from megatron.core import parallel_state

        return {
            "dp": (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                   owns_dp_output()),
            # An engine's first rank returns its samples.
            "rollout": (self.engine_index, self.world_size // self.engine_tp, self.rank % self.engine_tp == 0),
        }

    @dispatch(axis="rollout")
    def generate(self, prompts: list[list[int]]):
        return self.engine.generate(prompts, n=self.cfg.rollout.n)

    @dispatch(axis="rollout")
    def generate_greedy(self, prompts: list[list[int]]):
        """One greedy answer per prompt (validation, tests)."""
        return self.engine.generate(prompts, n=1, temperature=0.0)

    @dispatch(axis="dp")
    def log_probs(self, batch):
        return self.actor.log_probs(batch)

    @dispatch(axis="dp")
    def update(self, batch):
        return self.actor.update(batch)

    @dispatch(axis=None)
    def sync_weights(self) -> SyncStats:
        """Write the policy's current weights into the engines (every worker sends and receives its part)."""
        stats = self.resharder.sync()
        self.engine.weights_updated()
        return stats

    @dispatch(axis=None)
    def hf_state_dict(self):
        """The policy's full HF state dict (from rank 0 only; every rank takes part in the gather)."""
        state = self.actor.hf_state_dict()
        return state if self.rank == 0 else None

    @dispatch(axis=None)
    def engine_mismatches(self, hf_state: dict) -> list[str]:
        """The HF tensors whose part in this worker's engine differs from `hf_state` (bit for bit)."""
        return engine_mismatches(self.engine.model(), hf_state)
