"""The value model's rank: `MegatronModel` (megatron_model.py) with a scalar value head; values of given sequences,
and clipped value-loss updates."""
from __future__ import annotations

import torch

from rl_megatron.algorithms import value_loss
from rl_megatron.batch import TokenOutputs, TrainBatch
from rl_megatron.config.schema import Config
from rl_megatron.models.activations import ActivationSettings
from rl_megatron.models.pipeline_stages import StageLayers
from rl_megatron.roles import Role
from rl_megatron.sequences import MicroBatch
from rl_megatron.workers.megatron_model import Batching, MegatronModel


class MegatronCritic(MegatronModel):
    """The value model: the policy's trunk (critic.model_path) with a new scalar head."""

    def __init__(self, cfg: Config, hf_config: dict, optimizer_steps: int = 0):
        critic = cfg.critic
        batching = Batching(critic.micro_batch_size, critic.max_tokens_per_micro_batch, cfg.actor.sequence_packing)
        super().__init__(cfg, hf_config, batching, optim=critic.optim, optimizer_steps=optimizer_steps,
                         value_head=True, weights_path=None if cfg.model.random_init else critic.model_path,
                         activations=ActivationSettings.of_role(cfg, Role.CRITIC),
                         stages=StageLayers.of_role(cfg, Role.CRITIC))

    @staticmethod
    def _token_outputs(micro: MicroBatch, output: torch.Tensor) -> TokenOutputs:
        return TokenOutputs(values=output.squeeze(-1).float())

    def values(self, batch: TrainBatch) -> TokenOutputs | None:
        return self.infer(batch.select(), self._token_outputs)

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
                             self.cfg.rollout.max_tokens, self._token_outputs, loss_of)
        return {f"critic/{key}": value for key, value in metrics.items()}
