"""The roles a worker can host, and what each one needs. A leaf module: config, workers, checkpoints and the
launch planner all name roles through it."""
from __future__ import annotations

import enum


class Role(str, enum.Enum):
    """A role's value is its name in configs, logs and checkpoint folders."""
    ACTOR = "actor"  # the policy's Megatron shard, trained by PPO
    ROLLOUT = "rollout"  # a vLLM engine (or its TP shard) sampling from the policy
    REF = "ref"  # the frozen reference policy (KL)
    CRITIC = "critic"  # the value model (GAE)
    TEACHER = "teacher"  # a frozen model of its own (teacher.model.path) whose log-probs the policy distills
    REWARD_MODEL = "reward_model"  # a frozen sequence classifier of its own (reward_model.model.path) scoring samples
    JUDGE = "judge"  # a vLLM engine of its own model (judge.model.path) writing verdicts on the samples

    @property
    def devices_section(self) -> str:
        """The config section whose nnodes x n_gpus_per_node are its pool's devices (the actor's: trainer's)."""
        return "trainer" if self is Role.ACTOR else self.value

    @property
    def has_model(self) -> bool:
        """It holds a Megatron model (and saves it in checkpoints)."""
        return self not in (Role.ROLLOUT, Role.JUDGE)

    @property
    def trainable(self) -> bool:
        return self in (Role.ACTOR, Role.CRITIC)

    @property
    def frozen(self) -> bool:
        """It holds a model it only runs forward passes over, whose section has <role>.param_offload."""
        return self in FROZEN_ROLES

    @property
    def own_model(self) -> bool:
        """Its model is not the policy's (any family and size: the teacher's), so it shares neither the actor's
        pipeline split nor its MoE routing."""
        return self in (Role.TEACHER, Role.REWARD_MODEL)

    @property
    def value_head(self) -> bool:
        """Its output layer is one scalar per position (the critic's values, the reward model's score head)."""
        return self in (Role.CRITIC, Role.REWARD_MODEL)

    def __str__(self) -> str:
        return self.value


# The roles of frozen models, in the order pools and plans list them.
FROZEN_ROLES = (Role.REF, Role.TEACHER, Role.REWARD_MODEL)


def roles_name(roles: tuple[Role, ...]) -> str:
    """E.g. "actor+rollout+ref": what reports and file names call the workers hosting `roles`."""
    return "+".join(map(str, roles))
