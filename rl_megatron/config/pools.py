"""Which processes a config asks for: the worker pools (nodes of their own), the roles each hosts, and their
Megatron layouts. The launcher's plan and the trainer's workers both start from `worker_pools`."""
from __future__ import annotations

import dataclasses

from rl_megatron.config.schema import Config
from rl_megatron.roles import Role


def uses_reference(cfg: Config) -> bool:
    """Whether a KL term (in the loss or in the reward) needs the reference policy."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def reference_in_actor(cfg: Config) -> bool:
    """With LoRA the reference policy is the actor with its adapters off (verl's ref_in_actor): no reference weights
    are held, loaded or offloaded anywhere."""
    return cfg.actor.lora.rank > 0


# vLLM's choices of max_lora_rank: an engine serves adapters of any rank up to the one it starts with.
VLLM_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def lora_merge_reason(cfg: Config) -> str | None:
    """Why a LoRA policy's engines receive its weights with the adapters merged; None when they load the adapters
    themselves, as a vLLM LoRA adapter, on the base weights they were given once (also None without LoRA)."""
    lora = cfg.actor.lora
    if not lora.rank:
        return None
    if lora.merge:
        return "actor.lora.merge=true"
    if "lm_head" in lora.target_modules:
        return "vLLM serves no LoRA adapter on lm_head (actor.lora.target_modules)"
    if lora.rank > VLLM_LORA_RANKS[-1]:
        return f"vLLM serves LoRA adapters up to rank {VLLM_LORA_RANKS[-1]} (actor.lora.rank={lora.rank})"
    if cfg.rollout.placement == "separate":
        return "engines in processes of their own receive merged weights (rollout.placement=separate)"
    return None


def engine_lora_rank(cfg: Config) -> int:
    """The max_lora_rank the engines start with: the smallest vLLM offers that holds actor.lora.rank; 0 when they
    load no adapters (no LoRA, or merged weights: `lora_merge_reason`)."""
    if not cfg.actor.lora.rank or lora_merge_reason(cfg):
        return 0
    return next(rank for rank in VLLM_LORA_RANKS if rank >= cfg.actor.lora.rank)


@dataclasses.dataclass(frozen=True)
class WorkerPool:
    """Processes on nodes of their own: the roles they host, how many (and the config section that says so), and the
    Megatron layout of their models (none for the engines' pool)."""

    name: Role  # its first role: the actor (with every role colocated with it), the engines, the ref or critic
    roles: tuple[Role, ...]
    nnodes: int
    gpus_per_node: int
    layout: dict  # tp, pp (and for the actor's pool vpp, cp, ep, etp)

    @property
    def world_size(self) -> int:
        """Its workers: one per device."""
        return self.nnodes * self.gpus_per_node

    @property
    def data_parallel_size(self) -> int:
        """What the model parallel sizes leave of the pool's devices (its Megatron roles' data parallelism)."""
        layout = self.layout
        return self.world_size // (layout["tp"] * layout["pp"] * layout.get("cp", 1))

    @property
    def nodes_key(self) -> str:
        return f"{self.name.devices_section}.nnodes"

    @property
    def gpus_key(self) -> str:
        return f"{self.name.devices_section}.n_gpus_per_node"


def worker_pools(cfg: Config) -> list[WorkerPool]:
    """The pools in node order: the actor's (with the engines unless rollout.placement=separate, and the colocated
    reference and critic), then the separate ones: engines, reference, critic. Roles in a pool: actor, rollout,
    ref, critic order."""
    a, r = cfg.actor, cfg.rollout
    engines_apart = r.placement == "separate"
    actor_roles = [Role.ACTOR] if engines_apart else [Role.ACTOR, Role.ROLLOUT]
    engine_pool = WorkerPool(Role.ROLLOUT, (Role.ROLLOUT,), r.nnodes, r.n_gpus_per_node, {})
    separate = [engine_pool] if engines_apart else []
    reference = uses_reference(cfg) and not reference_in_actor(cfg)
    for name, role, wanted in ((Role.REF, cfg.ref, reference), (Role.CRITIC, cfg.critic, cfg.critic.enable)):
        wanted = wanted and not cfg.trainer.val_only  # validation generates and scores only
        if wanted and role.placement == "colocated":
            actor_roles.append(name)
        elif wanted:
            layout = {"tp": role.tensor_model_parallel_size, "pp": role.pipeline_model_parallel_size}
            separate.append(WorkerPool(name, (name,), role.nnodes, role.n_gpus_per_node, layout))
    tp = a.tensor_model_parallel_size
    actor_layout = {"tp": tp, "pp": a.pipeline_model_parallel_size, "vpp": a.virtual_pipeline_model_parallel_size,
                    "cp": a.context_parallel_size, "ep": a.expert_model_parallel_size,
                    "etp": a.expert_tensor_parallel_size or tp}
    return [WorkerPool(Role.ACTOR, tuple(actor_roles), cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, actor_layout),
            *separate]
