"""A step's forward passes before its update, each over the whole batch and timed: the policy's old log-probs and
entropy (where the update cannot give them: `old_log_probs.py`), the reference's log-probs (KL terms), the teacher's
(on-policy distillation), the critic's values and a reward model's scores (`reward_model.py`). The same in every mode of the rollout (synchronous, a batch
generated ahead, streamed groups): the trainer's passes see the samples once they are its batch."""
from __future__ import annotations

from rl_megatron.batch import Sample, TrainBatch
from rl_megatron.config.pools import uses_reference
from rl_megatron.config.schema import Config
from rl_megatron.roles import Role
from rl_megatron.trainer.metrics import Timer
from rl_megatron.trainer.old_log_probs import old_log_probs_pass
from rl_megatron.trainer.reward_model import RewardModelScorer
from rl_megatron.trainer.rewards import ModelScores
from rl_megatron.workers.worker_group import WorkerGroup


def forward_passes(groups: dict[Role, WorkerGroup], cfg: Config, batch: TrainBatch, timer: Timer, old_pass: bool,
                   samples: list[Sample], reward_model: RewardModelScorer | None) -> ModelScores | None:
    """Into `batch`: the old log-probs and entropy (with `old_pass`), the reference's log-probs, the teacher's and
    the critic's values, of the roles the run has (`groups`: a colocated role maps to the actor's group). Returns the
    reward model's scores of `samples` (`batch`'s rows) where one scores them here, after generation."""
    actor = groups[Role.ACTOR]
    replay = cfg.actor.router_replay  # the routing the update replays: the engine's (R3), the actor's (R2)
    if old_pass:
        with timer("old_log_prob"):
            old_log_probs_pass(actor, batch, replay)
    if uses_reference(cfg):
        with timer("ref"):
            ref_batch = batch.select("routed_experts") if replay == "R3" else batch.select()
            # LoRA: the actor with its adapters off (config.pools.reference_in_actor)
            reference = groups[Role.REF].ref_log_probs if Role.REF in groups else actor.reference_log_probs
            batch.ref_log_probs = reference(ref_batch).log_probs
    if Role.TEACHER in groups:  # a model of its own: never the policy's routing
        with timer("teacher"):
            teacher = groups[Role.TEACHER].teacher_log_probs(batch.select())
            batch.teacher_log_probs = teacher.log_probs
            batch.teacher_top_log_probs, batch.teacher_top_ids = teacher.top_log_probs, teacher.top_ids
    if Role.CRITIC in groups:
        with timer("values"):
            batch.values = groups[Role.CRITIC].values(batch.select()).values
    if reward_model is None or reward_model.while_generating:  # else scored as the samples were generated
        return None
    with timer("reward_model"):  # its own rows: the conversations rendered for its tokenizer
        return reward_model.scores(groups[Role.REWARD_MODEL], samples)
