"""Where a step's old log-probs (the policy's, before its update) come from: a forward pass of their own, or the
update's own forward pass.

They are the PPO ratio's denominator, the rollout correction's numerator, the vLLM-vs-Megatron mismatch metrics' and
the in-reward KL penalty's input. When a batch trains on-policy in one optimizer step (one PPO epoch, one
mini-batch), every forward pass of the update runs on the weights a separate pass would use, so the update's forward,
detached, is that pass: the ratio is 1 in value (as TRL's num_iterations=1), the correction's weights and the
entropy come from the same forward, and the metrics read them after the update. The separate pass stays wherever the
policy moves before a token is trained, something reads the old log-probs before the update, or the update's
forward computes something else.
"""
from __future__ import annotations

from rl_megatron.batch import TrainBatch
from rl_megatron.config.pools import uses_teacher
from rl_megatron.config.schema import Config, RolloutCorrectionConfig
from rl_megatron.models.hf_config import carries_routing
from rl_megatron.workers.worker_group import WorkerGroup


def old_log_probs_from_update(cfg: Config, hf: dict) -> bool:
    """Whether the actor's update gives the old log-probs (and the entropy), with no forward pass of their own. Not
    with (each keeps the pass):

    - actor.ppo_epochs > 1, or actor.ppo_mini_batch_size below data.train_batch_size: the policy moves (an optimizer
      step) before the later epochs' and mini-batches' tokens are trained;
    - algorithm.use_kl_in_reward: the KL penalty enters the rewards, before the advantages and the update; so does
      a teacher (teacher.model.path): the distillation term of the advantages reads the old log-probs;
    - an actor whose passes carry MoE routing (`carries_routing`: actor.router_replay, or the engines' routing): R2
      replays in the update the routing the separate pass records, and R3 and the engines' routing alone measure
      moe/routing_agreement in that pass;
    - LoRA with actor.lora.dropout > 0: the update's forward drops adapter activations, the separate pass does not;
    - algorithm.rollout_correction.bypass_mode: the update's ratio is against the rollout's log-probs, so it is never
      on-policy in the sense above; the pass gives the metrics (the mismatch, the entropy, the current version's).

    The steps of the critic's warm-up (no actor update to take them from) run the pass whatever this says.
    `hf`: the model's config.json with the moe section's overrides (`models.hf_config.model_config`)."""
    actor = cfg.actor
    one_optimizer_step = actor.ppo_epochs == 1 and actor.ppo_mini_batch_size >= cfg.data.train_batch_size
    return (one_optimizer_step and not cfg.algorithm.use_kl_in_reward and not uses_teacher(cfg)
            and not carries_routing(cfg, hf, trainable=True) and not (actor.lora.rank and actor.lora.dropout)
            and not cfg.algorithm.rollout_correction.bypass_mode)


def old_log_probs_pass(actor: WorkerGroup, batch: TrainBatch, router_replay: str) -> None:
    """The old log-probs and entropy by a forward pass of their own, into `batch`; under R2 with the routing it
    records, which the update replays."""
    old = actor.log_probs(batch.select("routed_experts"))
    batch.old_log_probs, batch.entropy = old.log_probs, old.entropy
    if router_replay != "R3":
        batch.routed_experts = old.routed_experts  # R2's record; None otherwise


def update_actor(actor: WorkerGroup, batch: TrainBatch, correction: RolloutCorrectionConfig) -> dict[str, float]:
    """The actor's update of `batch`; its metrics. A batch without old log-probs gets them, and the entropy, from
    the update's forward pass (which weighs the tokens by the rollout correction from there too). In bypass mode
    the PPO ratio's denominator is the rollout's log-probs instead of the old ones."""
    fields = ["old_log_probs", "advantages", "ref_log_probs", "importance_weights", "routed_experts",
              "teacher_top_log_probs", "teacher_top_ids"]
    from_update = batch.old_log_probs is None
    if from_update and correction.level is not None:
        fields.append("rollout_log_probs")
    selected = batch.select(*fields)
    if correction.bypass_mode:
        selected.old_log_probs = batch.rollout_log_probs
    result = actor.update(selected)
    if from_update:
        batch.old_log_probs, batch.entropy = result.log_probs, result.entropy
    return result.metrics
