"""The plainest peer on the same work: Hugging Face transformers' training step and log-prob pass.

`bench train --peer transformers` and `bench log_probs --peer transformers` run it after the project's, in the same
process, on the same model shape, batch, micro-batches and loss: the model from the same config.json with fp32
weights (bf16 autocast on a GPU when the bench runs bfloat16, as TRL and plain PyTorch loops train), torch's SDPA
attention, AdamW (fused on a GPU), the actor's policy loss (`actor.policy_loss`, its clip ratios and aggregation) on
the response tokens, gradient clipping at `actor.optim.clip_grad`, one optimizer step per batch. Log-probs take the
sampling temperature, as the project's do. Random weights: the figures are speed, not quality.
"""
from __future__ import annotations

import gc
import weakref
from contextlib import nullcontext

import torch
import torch.nn.functional as F

from rl_megatron import platform
from rl_megatron.algorithms import POLICY_LOSSES, LossScale
from rl_megatron.batch import TrainBatch
from rl_megatron.config.schema import Config


def project_freed(model: weakref.ref) -> bool:
    """Collects what the project's run left (its model, optimizer state and gradient buffers, once the caller has
    dropped them) and returns the device's cached blocks, so that the peer runs on the whole device: at a 7B width the
    two models with their Adam states do not fit on one 80 GB GPU together. True when `model` was collected."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return model() is None


class TransformersPeer:
    """transformers' model and optimizer for `cfg`'s actor, on this process's device."""

    def __init__(self, cfg: Config, model_dir: str, dtype: str):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.cfg, self.device = cfg, platform.device()
        self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir), dtype=torch.float32,
                                                      attn_implementation="sdpa").to(self.device)
        optim = cfg.actor.optim
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=optim.lr, betas=tuple(optim.betas),
                                           eps=optim.eps, weight_decay=optim.weight_decay,
                                           fused=self.device.type == "cuda")
        on_gpu_bf16 = self.device.type == "cuda" and dtype == "bfloat16"
        self.autocast = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if on_gpu_bf16 else nullcontext

    def _token_log_probs(self, input_ids: torch.Tensor) -> torch.Tensor:
        """log p(token t + 1) at each position t under the sampling temperature (0 at the last), as the project
        lays them out."""
        with self.autocast():
            logits = self.model(input_ids).logits[:, :-1]
        log_probs = F.log_softmax(logits.float() / self.cfg.rollout.temperature, dim=-1)
        picked = log_probs.gather(-1, input_ids[:, 1:].unsqueeze(-1)).squeeze(-1)
        return F.pad(picked, (0, 1))

    def micro_batches(self, batch: TrainBatch) -> list[TrainBatch]:
        return [micro.to_device(self.device) for micro in batch.chunks(self.cfg.actor.micro_batch_size)]

    @torch.no_grad()
    def log_probs(self, batch: TrainBatch) -> torch.Tensor:
        return torch.cat([self._token_log_probs(micro.input_ids) for micro in self.micro_batches(batch)]).cpu()

    def update(self, batch: TrainBatch) -> None:
        """One optimizer step over `batch`, accumulated over its micro-batches."""
        actor = self.cfg.actor
        loss_fn = POLICY_LOSSES.bound(actor.policy_loss, self.cfg.extension_keys)
        scale = LossScale(tokens=max(batch.response_mask.sum().item(), 1.0), sequences=float(batch.rows()),
                          horizon=self.cfg.rollout.max_tokens)
        for micro in self.micro_batches(batch):
            loss, _ = loss_fn(self._token_log_probs(micro.input_ids), micro.old_log_probs, micro.advantages,
                              micro.response_mask, actor=actor, scale=scale, importance_weights=None)
            loss.backward()
        if actor.optim.clip_grad:
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), actor.optim.clip_grad, foreach=True)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
