"""The value model's rank: `MegatronModel` (megatron_model.py) with a scalar value head; values of given sequences,
and clipped value-loss updates. The reward model's rank is the same model frozen, its head a classifier's score
(models/score_head.py)."""
from __future__ import annotations

import torch

from rl_megatron.algorithms import value_loss
from rl_megatron.batch import TokenOutputs, TrainBatch
from rl_megatron.config.schema import Config
from rl_megatron.models.activations import ActivationSettings
from rl_megatron.models.gpt import SafetensorsReader
from rl_megatron.models.pipeline_stages import StageLayers
from rl_megatron.models.score_head import load_score_head
from rl_megatron.roles import Role
from rl_megatron.sequences import MicroBatch
from rl_megatron.workers.megatron_model import Batching, MegatronModel


def _values(micro: MicroBatch, output: torch.Tensor) -> TokenOutputs:
    """The scalar head's output at each position."""
    return TokenOutputs(values=output.squeeze(-1).float())


class MegatronCritic(MegatronModel):
    """The value model: the policy's trunk (critic.model_path) with a new scalar head."""

    def __init__(self, cfg: Config, hf_config: dict, optimizer_steps: int = 0):
        critic = cfg.critic
        batching = Batching(critic.micro_batch_size, critic.max_tokens_per_micro_batch, cfg.actor.sequence_packing)
        super().__init__(cfg, hf_config, batching, optim=critic.optim, optimizer_steps=optimizer_steps,
                         value_head=True, weights_path=None if cfg.model.random_init else critic.model_path,
                         activations=ActivationSettings.of_role(cfg, Role.CRITIC),
                         stages=StageLayers.of_role(cfg, Role.CRITIC))

    def values(self, batch: TrainBatch) -> TokenOutputs | None:
        return self.infer(batch.select(), _values)

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """Clipped value-loss updates. `batch`: input_ids, response_mask, values (at rollout time), returns."""
        critic = self.cfg.critic

        def loss_of(samples, outputs, scale):
            loss, stats = value_loss(outputs.values, samples.values, samples.returns, samples.response_mask,
                                     cliprange_value=critic.cliprange_value, agg_mode=critic.loss_agg_mode,
                                     scale=scale)
            stats.losses["vf_loss"] = loss.detach()
            return loss, stats

        metrics = self.train(batch, critic.ppo_mini_batch_size * self.cfg.rollout.n, critic.ppo_epochs,
                             self.cfg.rollout.max_tokens, _values, loss_of)
        return {f"critic/{key}": value for key, value in metrics.items()}


class MegatronRewardModel(MegatronModel):
    """A reward model (reward_model.model.path, a sequence classifier of its own): frozen, its trunk loaded as any
    model's, its scalar head from the folder's score head."""

    def __init__(self, cfg: Config, hf_config: dict):
        section = cfg.reward_model
        batching = Batching(section.micro_batch_size, section.max_tokens_per_micro_batch, cfg.actor.sequence_packing)
        super().__init__(cfg, hf_config, batching, value_head=True, weights_path=section.model.path,
                         activations=ActivationSettings.of_role(cfg, Role.REWARD_MODEL),
                         stages=StageLayers.of_role(cfg, Role.REWARD_MODEL))
        reader = SafetensorsReader(section.model.path)
        for chunk in self.chunks:
            load_score_head(chunk, reader.get)

    def scores(self, batch: TrainBatch) -> TokenOutputs | None:
        """The head's output at every position of `batch`'s rows (`rewards.reward_model` reads each row's last)."""
        return self.infer(batch.select(), _values)
