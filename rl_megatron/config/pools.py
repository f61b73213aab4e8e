"""Which processes a config asks for: the worker pools (nodes of their own), the roles each hosts, and their
Megatron layouts. The launcher's plan and the trainer's workers both start from `worker_pools`."""
from __future__ import annotations

import dataclasses

from rl_megatron.config.choices import STREAMING
from rl_megatron.config.schema import Config
from rl_megatron.roles import Role


def uses_reference(cfg: Config) -> bool:
    """Whether a KL term (in the loss or in the reward) needs the reference policy."""
    return cfg.algorithm.use_kl_in_reward or cfg.actor.use_kl_loss


def uses_teacher(cfg: Config) -> bool:
    """Whether on-policy distillation needs the teacher's log-probs (teacher.model.path)."""
    return cfg.teacher.model.path is not None


def uses_judge_engines(cfg: Config) -> bool:
    """Whether a judge of its own (judge.model.path) needs engines of its own, beside the policy's."""
    return cfg.judge.enable and cfg.judge.model.path is not None


def uses_reward_model(cfg: Config) -> bool:
    """Whether a reward model scores the samples (reward_model.model.path)."""
    return cfg.reward_model.model.path is not None


def scored_while_generating(cfg: Config, dynamic_sampling: bool = True) -> list[str]:
    """The settings (as key=value) under which each prompt's group is scored as it generates, by the trainer's
    `score_now`, instead of in the step's passes after generation: streaming's groups and (with `dynamic_sampling`)
    dynamic sampling's rounds."""
    return [key for key, on in (("algorithm.filter_groups.enable=true",
                                 dynamic_sampling and cfg.algorithm.filter_groups.enable),
                                (f"trainer.async_mode={STREAMING}", cfg.trainer.async_mode == STREAMING)) if on]


def reference_in_actor(cfg: Config) -> bool:
    """With LoRA the reference policy is the actor with its adapters off (verl's ref_in_actor): no reference weights
    are held, loaded or offloaded anywhere."""
    return cfg.actor.lora.rank > 0


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
    reference, critic, teacher and reward model), then the separate ones: engines, reference, critic, teacher, reward
    model, a judge's engines. Roles in a pool: actor, rollout, ref, critic, teacher, reward model order."""
    a, r = cfg.actor, cfg.rollout
    engines_apart = r.placement == "separate"
    actor_roles = [Role.ACTOR] if engines_apart else [Role.ACTOR, Role.ROLLOUT]
    engine_pool = WorkerPool(Role.ROLLOUT, (Role.ROLLOUT,), r.nnodes, r.n_gpus_per_node, {})
    separate = [engine_pool] if engines_apart else []
    reference = uses_reference(cfg) and not reference_in_actor(cfg)
    for name, role, wanted in ((Role.REF, cfg.ref, reference), (Role.CRITIC, cfg.critic, cfg.critic.enable),
                               (Role.TEACHER, cfg.teacher, uses_teacher(cfg)),
                               (Role.REWARD_MODEL, cfg.reward_model, uses_reward_model(cfg))):
        wanted = wanted and not cfg.trainer.val_only  # validation generates and scores only
        if wanted and role.placement == "colocated":
            actor_roles.append(name)
        elif wanted:
            layout = {"tp": role.tensor_model_parallel_size, "pp": role.pipeline_model_parallel_size}
            separate.append(WorkerPool(name, (name,), role.nnodes, role.n_gpus_per_node, layout))
    if uses_judge_engines(cfg) and not cfg.trainer.val_only:
        judge = cfg.judge
        separate.append(WorkerPool(Role.JUDGE, (Role.JUDGE,), judge.nnodes, judge.n_gpus_per_node, {}))
    tp = a.tensor_model_parallel_size
    actor_layout = {"tp": tp, "pp": a.pipeline_model_parallel_size, "vpp": a.virtual_pipeline_model_parallel_size,
                    "cp": a.context_parallel_size, "ep": a.expert_model_parallel_size,
                    "etp": a.expert_tensor_parallel_size or tp}
    return [WorkerPool(Role.ACTOR, tuple(actor_roles), cfg.trainer.nnodes, cfg.trainer.n_gpus_per_node, actor_layout),
            *separate]


def threads_per_worker(cfg: Config, cpus: int) -> int:
    """Torch threads for each worker of the run: the cluster's CPUs shared evenly by every pool's workers."""
    return max(1, cpus // sum(pool.nnodes * pool.gpus_per_node for pool in worker_pools(cfg)))
