"""The worker: one Ray actor per device, hosting this device's share of the roles placed on its pool, all in one
Megatron layout (the pool's TP/PP/VPP/EP):

- "actor": the policy's Megatron shard and a vLLM engine (the hybrid engine: train and generate share the device
  in turn; after each update the new weights go from the shards into the engine through the resharding module).
  With rollout.placement=separate the engines run in `RolloutWorker`s instead, and rank 0 broadcasts the weights;
- "ref": the frozen reference policy (a copy of the initial actor when colocated with it; on GPU its weights wait
  in host memory between uses);
- "critic": the value model.

By default one pool hosts all three; `ref.placement` / `critic.placement` = separate gives a role its own pool.
"""
from __future__ import annotations

import os

import torch

from rl_megatron import platform
from rl_megatron.checkpoint.rng import restore_rng_state, save_rng_state
from rl_megatron.checkpoint.run import checkpointed_roles
from rl_megatron.config.schema import Config
from rl_megatron.resharding import Resharder, SyncStats, vllm_targets
from rl_megatron.resharding.broadcast import SENDER, BroadcastSender, weight_group
from rl_megatron.resharding.shared_params import unlink_shared_parameters
from rl_megatron.workers.distributed import init_distributed, owns_dp_output, rendezvous_address
from rl_megatron.workers.engine_host import EngineHost
from rl_megatron.workers.worker_group import dispatch

ROLES = ("actor", "ref", "critic")


def optimizer_steps(cfg: Config, mini_batch_prompts: int, epochs: int) -> int:
    """Optimizer steps of a whole run (the length of the LR schedule)."""
    return cfg.trainer.total_steps * cfg.data.train_batch_size // mini_batch_prompts * epochs


class HybridWorker(EngineHost):
    def __init__(self, rank: int, world_size: int, cfg: Config, hf_config: dict, roles: tuple[str, ...],
                 layout: dict, threads: int):
        self.rank, self.world_size = rank, world_size
        self.cfg, self.hf_config, self.roles, self.layout = cfg, hf_config, roles, layout
        self.actor = self.ref = self.critic = self.resharder = self.sender = None
        self._init_engine_host()
        # Before vLLM starts: its CPU worker turns torch.set_num_threads into a no-op afterwards.
        torch.set_num_threads(threads)

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def init(self, master_addr: str, master_port: int) -> None:
        from rl_megatron.workers.megatron_actor import MegatronActor, MegatronCritic

        cfg = self.cfg
        init_distributed(self.rank, self.world_size, master_addr, master_port, seed=cfg.trainer.seed, **self.layout)
        if "actor" in self.roles:
            self.actor = MegatronActor(cfg, self.hf_config, optimizer_steps(cfg, cfg.actor.ppo_mini_batch_size,
                                                                            cfg.actor.ppo_epochs))
        if "ref" in self.roles:  # the initial policy: copied when it is here, loaded from model.path otherwise
            self.ref = MegatronActor(cfg, self.hf_config, trainable=False, initial=self.actor)
        if "critic" in self.roles:
            self.critic = MegatronCritic(cfg, self.hf_config, optimizer_steps(cfg, cfg.critic.ppo_mini_batch_size,
                                                                               cfg.critic.ppo_epochs))
        if "rollout" in self.roles:
            self._start_engine()
            # The plan from the trainer's layout to the engines' is made (and checked) once, here.
            self.resharder = Resharder(*self.actor.weight_sources(), vllm_targets(self.engine.model()),
                                       bucket_bytes=cfg.resharding.bucket_mb << 20, channel=cfg.resharding.channel,
                                       verify=cfg.resharding.verify)
        # On GPU each phase gets the device memory the others' state would hold: the actor's (and a colocated
        # critic's) Megatron state waits in host memory while the engine generates, the frozen reference's weights
        # between its uses.
        self.offloaders = {}
        if platform.has_cuda():
            from rl_megatron.workers.offload import Offloader

            if self.engine is not None and cfg.actor.offload:
                self.offloaders.update({role: Offloader(model.model, model.optimizer)
                                        for role, model in (("actor", self.actor), ("critic", self.critic)) if model})
            if self.ref is not None and cfg.ref.param_offload:
                self.offloaders["ref"] = Offloader(self.ref.model)
                self.offloaders["ref"].to_host()

    def _for_generation(self) -> None:
        for state in self.offloaders.values():
            state.to_host()
        super()._for_generation()

    def _for_training(self, role: str, *state: str) -> None:
        """Before a Megatron phase of `role`: the engine sleeps, the role's `state` (params, grads, optimizer;
        all by default) comes back to the device."""
        if self.engine is not None:
            self.engine.sleep()
        if role in self.offloaders:
            self.offloaders[role].to_device(*state)

    def close(self) -> None:
        if self.resharder is not None:
            self.resharder.close()
            self.engine.close()
        if self.sender is not None:
            self.sender.close()
        unlink_shared_parameters()

    def mesh(self) -> dict:
        from megatron.core import parallel_state

        axes = {"dp": (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                       owns_dp_output())}
        if self.engine is not None:
            axes["rollout"] = self._rollout_axis()
        return axes

    @dispatch(axis="dp")
    def log_probs(self, batch):
        self._for_training("actor", "params")
        return self.actor.log_probs(batch)

    @dispatch(axis="dp")
    def update(self, batch):
        self._for_training("actor")
        return self.actor.update(batch)

    @dispatch(axis="dp")
    def ref_log_probs(self, batch):
        self._for_training("ref")
        out = self.ref.log_probs(batch)
        if "ref" in self.offloaders:  # back to host memory until its next use
            self.offloaders["ref"].to_host()
        return None if out is None else {"ref_log_probs": out["log_probs"]}

    @dispatch(axis="dp")
    def values(self, batch):
        self._for_training("critic", "params")
        return self.critic.values(batch)

    @dispatch(axis="dp")
    def update_critic(self, batch):
        self._for_training("critic")
        return self.critic.update(batch)

    @dispatch(axis=None)
    def join_weight_group(self, host: str, port: int, size: int) -> None:
        """Separate engines: rank 0 sends the weights to them (the other ranks take part in gathering each bucket)."""
        group = weight_group(host, port, SENDER, size) if self.rank == 0 else None
        self.sender = BroadcastSender(*self.actor.weight_sources(), group, self.cfg.resharding.bucket_mb << 20)

    @dispatch(axis=None)
    def sync_weights(self) -> SyncStats | None:
        """Write the policy's current weights into the engines: colocated, every worker sends and receives its part;
        separate, rank 0 gathers the weights a bucket at a time and broadcasts each to the engine workers."""
        if self.sender is not None:
            self.sender.send()
            return None
        # The sync needs the actor's weights and the engine's weights, nothing else.
        for role, state in self.offloaders.items():
            state.to_host(*(("grads", "optimizer") if role == "actor" else ()))
        if "actor" in self.offloaders:
            self.offloaders["actor"].to_device("params")
        self.engine.wake_up(("weights",))
        stats = self.resharder.sync()
        self.engine.weights_updated()
        return stats

    def _checkpointed(self) -> dict:
        """The models this worker saves, by folder name."""
        return {name: getattr(self, name) for name in checkpointed_roles(self.cfg) if getattr(self, name) is not None}

    def _rng_file(self, step_dir: str) -> str:
        return os.path.join(step_dir, "rng", f"{self.roles[0]}_rank{self.rank}.pt")

    def _each_checkpointed(self, step_dir: str, action) -> None:
        """action(model, its folder) for each model this worker checkpoints, with its state on the device."""
        for name, model in self._checkpointed().items():
            self._for_training(name)
            action(model, os.path.join(step_dir, name))
            if name == "ref" and "ref" in self.offloaders:
                self.offloaders["ref"].to_host()

    @dispatch(axis=None)
    def save_checkpoint(self, step_dir: str) -> None:
        """This worker's part of a checkpoint: its models' shards (collectives over the pool) and RNG states."""
        self._each_checkpointed(step_dir, lambda model, folder: model.save_checkpoint(folder))
        os.makedirs(os.path.dirname(self._rng_file(step_dir)), exist_ok=True)
        save_rng_state(self._rng_file(step_dir), {**self.layout, "world_size": self.world_size})

    @dispatch(axis=None)
    def load_checkpoint(self, step_dir: str) -> bool:
        """Load what `save_checkpoint` wrote (at any layout); True when the RNG states could be restored too."""
        self._each_checkpointed(step_dir, lambda model, folder: model.load_checkpoint(folder))
        return restore_rng_state(self._rng_file(step_dir), {**self.layout, "world_size": self.world_size})

    @dispatch(axis=None)
    def hf_state_dict(self):
        """The policy's full HF state dict (from rank 0 only; every rank takes part in the gather)."""
        state = self.actor.hf_state_dict()
        return state if self.rank == 0 else None
