"""The policy on one rank (`MegatronActor`): token log-probs of given sequences and PPO updates, with MoE routing
replay and its metrics; frozen, the reference policy (a copy of the initial actor, or loaded from model.path) or the
teacher of on-policy distillation (a model of its own, from teacher.model.path). The shard, its passes and its
training pieces: `MegatronModel` (megatron_model.py); the value model: megatron_critic.py.
"""
from __future__ import annotations

import dataclasses
from contextlib import nullcontext
from functools import partial

import torch

from rl_megatron import platform
from rl_megatron.algorithms import (POLICY_LOSSES, aggregate_loss, kl_divergence, rollout_correction_weights,
                                    top_k_kl)
from rl_megatron.batch import PolicyUpdate, TokenOutputs, TrainBatch
from rl_megatron.config.schema import Config
from rl_megatron.models.activations import ActivationSettings
from rl_megatron.models.pipeline_stages import StageLayers
from rl_megatron.models.gpt import weight_table
from rl_megatron.models.hf_config import carries_routing
from rl_megatron.models.logprobs import OutputPositions, token_log_probs_and_entropy, top_k_log_probs
from rl_megatron.models.lora import MergedWeights, adapters_disabled
from rl_megatron.models.router_metrics import RouterMetrics
from rl_megatron.models.router_replay import Pass, RoutingReplay
from rl_megatron.resharding import export_hf_state_dict, megatron_sources, share_parameters
from rl_megatron.roles import Role
from rl_megatron.rollout.engine import lora_merge_reason
from rl_megatron.sequences import MicroBatch
from rl_megatron.workers.distributed import owns_dp_output
from rl_megatron.workers.megatron_model import Batching, MegatronModel


class MegatronActor(MegatronModel):
    """The policy (`role` actor), or frozen: the reference policy (ref), the teacher (teacher: `hf_config` is then
    teacher.model.path's, where its weights come from)."""

    def __init__(self, cfg: Config, hf_config: dict, optimizer_steps: int = 0, *, role: Role = Role.ACTOR,
                 initial: MegatronActor | None = None, distributed_optimizer: bool | None = None):
        trainable = role.trainable
        if role is Role.TEACHER:  # a model of its own
            weights, checkpoint = cfg.teacher.model.path, None
        else:  # the policy's initial weights
            weights, checkpoint = None if cfg.model.random_init else cfg.model.path, cfg.model.checkpoint
        section = getattr(cfg, role.value)
        batching = Batching(section.micro_batch_size, section.max_tokens_per_micro_batch, cfg.actor.sequence_packing)
        train_here = trainable and not cfg.trainer.val_only  # no optimizer state for a validation-only run
        super().__init__(cfg, hf_config, batching, optim=cfg.actor.optim if train_here else None,
                         optimizer_steps=optimizer_steps, weights_path=weights, checkpoint=checkpoint,
                         initial=initial, activations=ActivationSettings.of_role(cfg, role),
                         stages=StageLayers.of_role(cfg, role), distributed_optimizer=distributed_optimizer,
                         lora=cfg.actor.lora if trainable and cfg.actor.lora.rank else None)
        self.table = weight_table(self.chunks[0], hf_config)
        # A teacher distilled from by its top-k (algorithm.distillation.top_k) gives its k likeliest tokens.
        self.top_k = cfg.algorithm.distillation.top_k if role is Role.TEACHER else None
        self.fused_log_probs = platform.on_with_cuda(cfg.actor.fused_log_probs)
        # MoE: the routers' load and losses in each update (moe/* metrics).
        moe = trainable and self.chunks[0].config.num_moe_experts
        self.router_metrics = RouterMetrics(self.chunks) if moe else None
        # Routing replay (actor.router_replay; the reference replays under R3 only; the teacher's experts are not the
        # policy's), and the policy's routing agreement with the engine's wherever the engines return it.
        replays = trainable or (cfg.actor.router_replay == "R3" and not role.own_model)
        self.replay_mode = cfg.actor.router_replay if replays else "disabled"
        if not role.own_model and carries_routing(cfg, hf_config, trainable):
            self.routing_replay = RoutingReplay(self.chunks)
        # LoRA: the engines receive the weights with the adapters merged, kept apart from the frozen base, where
        # they do not load the adapters themselves (`lora_merge_reason`).
        merges = trainable and lora_merge_reason(cfg) is not None
        self.merged = MergedWeights(self.chunks) if merges else None
        if trainable and not platform.has_cuda() and not self.distributed_optimizer:
            # The rollout engines on this machine read the policy's shards in place at each weight sync (not with
            # the distributed optimizer: moving the parameters out of DDP's buffer would cut them off from it).
            share_parameters([*self.chunks, *([self.merged] if self.merged else [])])
        last = self.chunks[-1]
        if last.post_process and not last.config.sequence_parallel and self.context_size == 1:
            self.output_positions = OutputPositions(last.output_layer)

    def _token_outputs(self, micro: MicroBatch, output: torch.Tensor, with_entropy: bool,
                       top_k: int | None = None) -> TokenOutputs:
        """log p(token) (and the policy's entropy) under the sampling temperature, at the positions the pass reads
        (zero elsewhere), in the model's layout. Distilling from a teacher's top-k: the teacher (`top_k`) gives its k
        likeliest tokens and their log-probs; the policy, given those (`teacher_top_ids`), its log-probs of them."""
        temperature, vocab = self.cfg.rollout.temperature, self.hf_config["vocab_size"]
        labels = micro.labels
        teacher_ids = micro.samples.teacher_top_ids
        teacher_ids = None if teacher_ids is None else micro.model_layout(teacher_ids)
        reads = micro.read_positions
        if reads is not None:  # output: [1, n, V/TP] at those positions only
            labels = labels.flatten()[reads[0]]
            teacher_ids = None if teacher_ids is None else teacher_ids.flatten(0, 1)[reads[0]]
        log_probs, ent, top_log_probs = token_log_probs_and_entropy(output, labels, temperature, vocab, with_entropy,
                                                                    teacher_ids, self.fused_log_probs)
        top_ids = None
        if top_k is not None:
            top_log_probs, top_ids = top_k_log_probs(output.reshape(*labels.shape, output.shape[-1]), top_k,
                                                     temperature, vocab, self.fused_log_probs)
        outputs = TokenOutputs(log_probs=log_probs, entropy=ent, top_log_probs=top_log_probs, top_ids=top_ids)
        if reads is None:
            return outputs

        def spread(value: torch.Tensor) -> torch.Tensor:  # [n, ...] at the read positions -> [rows, tokens, ...]
            layout = value.new_zeros(micro.input_ids.numel(), *value.shape[1:])
            return layout.index_copy(0, reads[0], value).view(*micro.input_ids.shape, *value.shape[1:])
        return TokenOutputs(**{name: spread(value) for name, value in outputs.tensors().items()})

    def log_probs(self, batch: TrainBatch) -> TokenOutputs | None:
        """log p(token) and the policy's entropy under the sampling temperature, where `response_mask` is set (the
        tokens the losses and metrics read; 0 elsewhere: the prompt's outputs are never computed). With R2, also
        each token's experts (`routed_experts`), which the update replays; with R3, through the experts of
        `batch.routed_experts` (the engine's). The policy counts its routing's agreement with the batch's."""
        tokens_of = partial(self._token_outputs, with_entropy=True, top_k=self.top_k)
        batch = batch.select("routed_experts")
        if self.routing_replay is None:
            return self.infer(batch, tokens_of)
        if self.replay_mode == "R3":
            with self.routing_replay.running(Pass.REPLAY, measure=self.router_metrics is not None):
                return self.infer(batch, tokens_of)

        def with_routing(micros: list[MicroBatch], outputs: list[TokenOutputs]) -> list[TokenOutputs]:
            routing = self.routing_replay.recorded(micros)  # every stage's layers (outputs: the last stage's)
            return [dataclasses.replace(out, routed_experts=record) for out, record in zip(outputs, routing)]

        with self.routing_replay.running(Pass.RECORD, measure=True):
            return self.infer(batch, tokens_of, with_routing if self.replay_mode == "R2" else None)

    def reference_log_probs(self, batch: TrainBatch) -> TokenOutputs | None:
        """A LoRA actor's reference policy: its frozen base, the adapters off (verl's ref_in_actor)."""
        with adapters_disabled(self.chunks):
            return self.infer(batch.select(), partial(self._token_outputs, with_entropy=False))

    def update(self, batch: TrainBatch) -> dict[str, float]:
        """`policy_update`'s metrics."""
        return self.policy_update(batch).metrics

    def policy_update(self, batch: TrainBatch) -> PolicyUpdate:
        """PPO updates over this step's samples. `batch`: input_ids, response_mask, old_log_probs, advantages
        (per token); ref_log_probs with actor.use_kl_loss; importance_weights with algorithm.rollout_correction.

        Without old_log_probs the batch trains on-policy in one optimizer step (`trainer/old_log_probs.py`): the
        update's own forward pass, detached, gives them, and from them and rollout_log_probs the correction's
        weights; they come back with the entropy from the ranks that own outputs."""
        actor, correction = self.cfg.actor, self.cfg.algorithm.rollout_correction
        policy_loss = POLICY_LOSSES.bound(actor.policy_loss, self.cfg.extension_keys)
        on_policy = batch.old_log_probs is None
        kept = [] if on_policy else None

        def loss_of(samples, outputs, scale):
            mask, log_probs = samples.response_mask, outputs.log_probs
            old, weights = samples.old_log_probs, samples.importance_weights
            if on_policy:  # the weights before any optimizer step: a pass of their own would compute these values
                old = log_probs.detach()
                if correction.level is not None:
                    weights = rollout_correction_weights(old, samples.rollout_log_probs, mask, correction.level,
                                                         correction.mode, correction.threshold)
            loss, stats = policy_loss(log_probs, old, samples.advantages, mask, actor=actor, scale=scale,
                                      importance_weights=weights)
            stats.losses["pg_loss"] = loss.detach()
            if actor.entropy_coeff:  # a loss term only then (on-policy it is computed for its metric too)
                entropy_term = aggregate_loss(outputs.entropy, mask, actor.loss_agg_mode, scale)
                loss = loss - actor.entropy_coeff * entropy_term
                stats.losses["entropy_loss"] = entropy_term.detach()
            if samples.teacher_top_ids is not None:  # on-policy distillation from the teacher's top-k
                distill = self.cfg.algorithm.distillation
                distill_term = aggregate_loss(top_k_kl(samples.teacher_top_log_probs, outputs.top_log_probs), mask,
                                              actor.loss_agg_mode, scale)
                loss = loss + distill.coef * distill_term
                stats.losses["distill_loss"] = distill_term.detach()
            if actor.use_kl_loss:
                kl_term = aggregate_loss(kl_divergence(log_probs, samples.ref_log_probs, actor.kl_loss_type), mask,
                                         actor.loss_agg_mode, scale)
                loss = loss + actor.kl_loss_coef * kl_term
                stats.losses["kl_loss"] = kl_term.detach()
            return loss, stats

        tokens_of = partial(self._token_outputs, with_entropy=bool(actor.entropy_coeff) or on_policy)
        replaying = (self.routing_replay.running(Pass.REPLAY) if self.replay_mode != "disabled"
                     else nullcontext())
        with self.router_metrics.recording() if self.router_metrics else nullcontext(), replaying:
            metrics = self.train(batch, actor.ppo_mini_batch_size * self.cfg.rollout.n, actor.ppo_epochs,
                                 self.cfg.rollout.max_tokens, tokens_of, loss_of, kept)
        metrics = ({f"actor/{key}": value for key, value in metrics.items()}
                   | {"perf/padding_ratio": self.padding_ratio()}
                   | (self.router_metrics.metrics() if self.router_metrics else {})
                   | (self.routing_replay.agreement_metrics() if self.routing_replay else {}))
        if not on_policy or not owns_dp_output():
            return PolicyUpdate(metrics)
        if not kept:  # no token to learn from, no forward pass: zeros, which no metric reads (the mask is 0 there)
            return PolicyUpdate(metrics, torch.zeros_like(batch.response_mask), torch.zeros_like(batch.response_mask))
        old = self.on_host([rows for rows, _ in kept], [outputs for _, outputs in kept], batch)
        return PolicyUpdate(metrics, old.log_probs, old.entropy)

    def weight_sources(self):
        """This rank's shards as resharding sources (and any mismatch with the weight table): with LoRA, the merged
        weights in place of the adapted layers' (`merge_adapters` brings them up to date)."""
        return megatron_sources(self.chunks, self.table, self.merged.substitutes() if self.merged else None)

    def merge_adapters(self) -> None:
        """Before a weight sync: the merged weights of the adapters as trained so far (nothing without LoRA, or
        where the engines load the adapters themselves)."""
        if self.merged is not None:
            self.merged.refresh()

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return export_hf_state_dict(self.chunks, self.table)
