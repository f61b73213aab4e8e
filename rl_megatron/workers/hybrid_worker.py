"""The worker: one Ray actor per device, hosting this device's share of the roles placed on its pool, all in one
Megatron layout (the pool's TP/PP/VPP/EP):

- "actor": the policy's Megatron shard and a rollout engine (the hybrid engine: train and generate share the device
  in turn; after each update the new weights go from the shards into the engine through the resharding module).
  With rollout.placement=separate the engines run in `RolloutWorker`s instead, and rank 0 broadcasts the weights;
- "ref": the frozen reference policy (a copy of the initial actor when colocated with it; on GPU its weights wait
  in host memory between uses);
- "critic": the value model;
- "teacher": the frozen teacher of on-policy distillation, a model of its own (teacher.model.path's config and
  weights; on GPU its weights wait in host memory between uses);
- "reward_model": a frozen sequence classifier of its own scoring the samples (reward_model.model.path; likewise).

By default one pool hosts them all; `<role>.placement` = separate (ref, critic, teacher, reward_model) gives a role its
own pool.
"""
from __future__ import annotations

import os

import torch

from rl_megatron import platform
from rl_megatron.batch import PolicyUpdate, TokenOutputs, TrainBatch
from rl_megatron.checkpoint.rng import restore_rng_state, save_rng_state
from rl_megatron.checkpoint.run import checkpointed_roles
from rl_megatron.config.schema import Config
from rl_megatron.models.hf_config import role_model_config
from rl_megatron.platform.device_stats import DeviceStats, peak_flops, read_device_stats, reset_gpu_peak_memory
from rl_megatron.platform.startup import startup_done
from rl_megatron.plugins import import_user_modules
from rl_megatron.resharding import Resharder
from rl_megatron.resharding.broadcast import SENDER, BroadcastSender, weight_group
from rl_megatron.resharding.shared_params import unlink_shared_parameters
from rl_megatron.resharding.specs import zero_what_no_region_holds
from rl_megatron.roles import Role
from rl_megatron.rollout.engine import engine_lora_rank
from rl_megatron.workers.distributed import connect_store, init_distributed, owns_dp_output, rendezvous_address
from rl_megatron.workers.engine_host import EngineHost
from rl_megatron.workers.offload import Offloader
from rl_megatron.workers.phases import SYNC, Move, Phase, PhaseMachine, forward, load, save, train
from rl_megatron.workers.worker_group import dispatch


def optimizer_steps(cfg: Config, mini_batch_prompts: int, epochs: int) -> int:
    """Optimizer steps of a whole run (the length of the LR schedule)."""
    return cfg.trainer.total_steps * cfg.data.train_batch_size // mini_batch_prompts * epochs


class HybridWorker(EngineHost):
    def __init__(self, rank: int, world_size: int, cfg: Config, hf_config: dict, roles: tuple[Role, ...],
                 layout: dict, threads: int, logs: str):
        self.rank, self.world_size = rank, world_size
        self.cfg, self.hf_config, self.roles, self.layout = cfg, hf_config, roles, layout
        self.models = {}  # Role -> MegatronModel
        self.resharder = self.sender = self.adapters = None
        self._init_engine_host(logs)
        # Before vLLM starts: its CPU worker turns torch.set_num_threads into a no-op afterwards.
        torch.set_num_threads(threads)
        import_user_modules(cfg.trainer.imports)

    def rendezvous(self) -> tuple[str, int]:
        return rendezvous_address()

    def init(self, master_addr: str, master_port: int) -> None:
        # Megatron is imported here, in the worker: the controller names this class for Ray and never imports it.
        from rl_megatron.resharding.adapters import AdapterSync
        from rl_megatron.workers.megatron_actor import MegatronActor
        from rl_megatron.workers.megatron_critic import MegatronCritic, MegatronRewardModel

        cfg = self.cfg
        # Every worker measures at once (on CPU), before anything else runs in the group: what each gets while its
        # peers compute too, as in a step.
        self.peak_flops = peak_flops(cfg.model.dtype)
        init_distributed(self.rank, self.world_size, connect_store(master_addr, master_port), seed=cfg.trainer.seed,
                         **self.layout)
        if Role.ACTOR in self.roles:
            self.models[Role.ACTOR] = MegatronActor(cfg, self.hf_config, optimizer_steps(
                cfg, cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_epochs))
        if Role.REF in self.roles:  # the initial policy: copied when it is here, loaded from model.path otherwise
            self.models[Role.REF] = MegatronActor(cfg, self.hf_config, role=Role.REF,
                                                  initial=self.models.get(Role.ACTOR))
        if Role.TEACHER in self.roles:
            self.models[Role.TEACHER] = MegatronActor(cfg, role_model_config(cfg, Role.TEACHER, self.hf_config),
                                                      role=Role.TEACHER)
        if Role.REWARD_MODEL in self.roles:
            self.models[Role.REWARD_MODEL] = MegatronRewardModel(
                cfg, role_model_config(cfg, Role.REWARD_MODEL, self.hf_config))
        if Role.CRITIC in self.roles:
            self.models[Role.CRITIC] = MegatronCritic(cfg, self.hf_config, optimizer_steps(
                cfg, cfg.critic.ppo_mini_batch_size, cfg.critic.ppo_epochs))
        # On GPU each phase gets the device memory the others' state would hold: the actor's (and a colocated
        # critic's) Megatron state waits in host memory while the engine generates, the frozen models' (reference,
        # teacher, reward model) weights between their uses. All of it is in host memory before the engine starts (see
        # `PhaseMachine`).
        self.offloaders: dict[Role, Offloader] = {}
        if platform.has_cuda():
            if Role.ROLLOUT in self.roles and cfg.actor.offload:
                self.offloaders.update({role: Offloader(model.model, model.optimizer) for role, model in
                                        self.models.items() if role.trainable})
            self.offloaders.update({role: Offloader(model.model) for role, model in self.models.items()
                                    if not role.trainable and getattr(cfg, role.value).param_offload})
        for offloader in self.offloaders.values():
            offloader.to_host()
        if Role.ROLLOUT in self.roles:
            self._start_engine()
            # The plan from the trainer's layout to the engines' is made (and checked) once, here.
            self.resharder = Resharder(*self.models[Role.ACTOR].weight_sources(), self.engine.sync_targets(),
                                       bucket_bytes=cfg.resharding.bucket_mb << 20, channel=cfg.resharding.channel,
                                       verify=cfg.resharding.verify)
            if engine_lora_rank(cfg):  # the engines load the policy's adapters, on the base sent once
                actor = self.models[Role.ACTOR]
                self.adapters = AdapterSync(actor.chunks, cfg.actor.lora, cfg.model.path, self.engine,
                                            actor.chunks[0].config.params_dtype, verify=cfg.resharding.verify)
        self.phases = PhaseMachine(offloaded=tuple(self.offloaders), engine=self.engine is not None,
                                   engine_sleeps=self.engine is not None and self.engine.sleeps,
                                   adapters=self.adapters is not None)
        startup_done()

    def enter(self, phase: Phase) -> None:
        for move in self.phases.enter(phase):
            self._apply(move)

    def leave(self, phase: Phase) -> None:
        for move in self.phases.leave(phase):
            self._apply(move)

    def _apply(self, move: Move) -> None:
        if move.kind == "to_host":
            self.offloaders[move.role].to_host(*move.parts)
        elif move.kind == "to_device":
            self.offloaders[move.role].to_device(*move.parts)
        elif move.kind == "sleep":
            self.engine.sleep(move.level)
        elif move.kind == "wake":
            self.engine.wake_up(move.parts)
        elif move.kind == "zero_unheld":
            zero_what_no_region_holds(self.engine.sync_targets())
        elif move.kind == "sync":
            self._send_weights(move.parts)
        else:
            raise ValueError(f"unknown move {move}")

    def _send_weights(self, parts: tuple[str, ...]) -> None:
        """The policy's `parts` (`Move`) into the engines: colocated, every worker writes its part; separate, rank 0
        gathers the weights a bucket at a time and broadcasts each to the engine workers. A LoRA policy whose
        engines load its adapters: the frozen base at the first sync (and after a checkpoint is loaded), then the
        adapters alone (`PhaseMachine`)."""
        self.models[Role.ACTOR].merge_adapters()
        if self.sender is not None:
            self.sender.send()
            return
        if "weights" in parts:
            self.resharder.sync()
            self.engine.weights_updated()
        if "adapters" in parts:
            self.adapters.sync()

    def close(self) -> None:
        if self.resharder is not None:
            self.resharder.close()
            self.engine.release_process_groups()  # the process ends next
        if self.sender is not None:
            self.sender.close()
        if self.adapters is not None:
            self.adapters.close()
        unlink_shared_parameters()

    def mesh(self) -> dict:
        from megatron.core import parallel_state  # in the worker only (see `init`)

        axes = {"dp": (parallel_state.get_data_parallel_rank(), parallel_state.get_data_parallel_world_size(),
                       owns_dp_output())}
        if self.engine is not None:
            axes["rollout"] = self._rollout_axis()
        return axes

    @dispatch(axis="dp", phase=forward(Role.ACTOR))
    def log_probs(self, batch: TrainBatch) -> TokenOutputs | None:
        return self.models[Role.ACTOR].log_probs(batch)

    @dispatch(axis="dp", phase=train(Role.ACTOR))
    def update(self, batch: TrainBatch) -> PolicyUpdate:
        return self.models[Role.ACTOR].policy_update(batch)

    @dispatch(axis="dp", phase=forward(Role.REF))
    def ref_log_probs(self, batch: TrainBatch) -> TokenOutputs | None:
        return self.models[Role.REF].log_probs(batch)

    @dispatch(axis="dp", phase=forward(Role.TEACHER))
    def teacher_log_probs(self, batch: TrainBatch) -> TokenOutputs | None:
        return self.models[Role.TEACHER].log_probs(batch)

    @dispatch(axis="dp", phase=forward(Role.REWARD_MODEL))
    def reward_model_scores(self, batch: TrainBatch) -> TokenOutputs | None:
        return self.models[Role.REWARD_MODEL].scores(batch)

    @dispatch(axis="dp", phase=forward(Role.ACTOR))
    def reference_log_probs(self, batch: TrainBatch) -> TokenOutputs | None:
        """The reference's log-probs from a LoRA actor: its adapters off (config.pools.reference_in_actor)."""
        return self.models[Role.ACTOR].reference_log_probs(batch)

    @dispatch(axis="dp", phase=forward(Role.CRITIC))
    def values(self, batch: TrainBatch) -> TokenOutputs | None:
        return self.models[Role.CRITIC].values(batch)

    @dispatch(axis="dp", phase=train(Role.CRITIC))
    def update_critic(self, batch: TrainBatch) -> dict[str, float]:
        return self.models[Role.CRITIC].update(batch)

    @dispatch(axis=None)
    def reset_peak_memory(self) -> None:
        """A step starts: the GPU's peak memory is counted from here."""
        reset_gpu_peak_memory()

    @dispatch(axis=None)
    def device_stats(self) -> DeviceStats:
        """This device's peak FLOP/s and the memory the step used (see `platform.device_stats`)."""
        return read_device_stats(self.peak_flops)

    @dispatch(axis=None)
    def join_weight_group(self, host: str, port: int, size: int) -> None:
        """Separate engines: rank 0 sends the weights to them (the other ranks take part in gathering each bucket)."""
        group = weight_group(host, port, SENDER, size) if self.rank == 0 else None
        self.sender = BroadcastSender(*self.models[Role.ACTOR].weight_sources(), group,
                                      self.cfg.resharding.bucket_mb << 20)

    @dispatch(axis=None, phase=SYNC)
    def sync_weights(self) -> None:
        """Make the engines' weights the policy's (nothing to do when they are already)."""

    def _checkpointed(self) -> dict:
        """The models this worker saves."""
        return {role: self.models[role] for role in checkpointed_roles(self.cfg) if role in self.models}

    def _rng_file(self, step_dir: str) -> str:
        return os.path.join(step_dir, "rng", f"{self.roles[0]}_rank{self.rank}.pt")

    @dispatch(axis=None)
    def save_checkpoint(self, step_dir: str) -> None:
        """This worker's part of a checkpoint: its models' shards (collectives over the pool) and RNG states."""
        for role, model in self._checkpointed().items():
            self.enter(save(role))
            model.save_checkpoint(os.path.join(step_dir, role.value))
            self.leave(save(role))
        os.makedirs(os.path.dirname(self._rng_file(step_dir)), exist_ok=True)
        save_rng_state(self._rng_file(step_dir), {**self.layout, "world_size": self.world_size})

    @dispatch(axis=None)
    def load_checkpoint(self, step_dir: str) -> bool:
        """Load what `save_checkpoint` wrote (at any layout); True when the RNG states could be restored too."""
        for role, model in self._checkpointed().items():
            self.enter(load(role))  # like an update: the engine's weights go stale, its LoRA base too
            model.load_checkpoint(os.path.join(step_dir, role.value))
            self.leave(load(role))
        return restore_rng_state(self._rng_file(step_dir), {**self.layout, "world_size": self.world_size})

    @dispatch(axis=None, phase=forward(Role.ACTOR))
    def hf_state_dict(self):
        """The policy's full HF state dict (from rank 0 only; every rank takes part in the gather)."""
        state = self.models[Role.ACTOR].hf_state_dict()
        return state if self.rank == 0 else None
