"""One rank's shard of the policy: Megatron GPTModel + DDP + optimizer, and the two things RL asks of it:
token log-probs of given sequences, and PPO-clip updates. Batches here are this data-parallel rank's slice.

Sequences are right-padded, so plain causal attention needs no mask and position ids are 0..S-1.
Position t of `response_mask` / `*log_probs` refers to the token at t + 1 (the label predicted at t).
"""
from __future__ import annotations

from functools import partial

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from rl_megatron import platform
from rl_megatron.algorithms import ppo_clip_policy_loss
from rl_megatron.config.schema import Config
from rl_megatron.models.gpt import build_gpt_chunks, load_hf_weights, weight_table
from rl_megatron.models.logprobs import entropy, prepare_logits, token_log_probs
from rl_megatron.resharding import export_hf_state_dict, megatron_sources, share_parameters
from rl_megatron.workers.distributed import owns_dp_output

Batch = dict[str, torch.Tensor]


def micro_batches(batch: Batch, size: int) -> list[Batch]:
    count = next(iter(batch.values())).shape[0]
    return [{k: v[i:i + size] for k, v in batch.items()} for i in range(0, count, size)]


def labels_of(input_ids: torch.Tensor, pad_id: int) -> torch.Tensor:
    return torch.cat([input_ids[:, 1:], input_ids.new_full((input_ids.shape[0], 1), pad_id)], dim=1)


def pad_sequences(batch: Batch, multiple: int, pad_id: int) -> Batch:
    """Per-token ([B, S]) tensors right-padded to a length that is a multiple of `multiple`: pad tokens, and zeros
    in masks and log-probs, so that the padding joins no loss."""
    extra = -batch["input_ids"].shape[1] % multiple
    return {key: F.pad(value, (0, extra), value=pad_id if key == "input_ids" else 0) if value.dim() == 2 else value
            for key, value in batch.items()}


class MegatronActor:
    def __init__(self, cfg: Config, hf_config: dict, optimizer_steps: int):
        self.cfg, self.hf_config = cfg, hf_config
        self.pad_id = hf_config.get("pad_token_id") or 0
        # This rank's model chunks in virtual-pipeline order: one per virtual stage, one without interleaving.
        self.chunks = [chunk.to(platform.device()) for chunk in build_gpt_chunks(
            hf_config, cfg.model.dtype, cfg.model.make_vocab_size_divisible_by)]
        if not cfg.model.random_init:
            for chunk in self.chunks:
                load_hf_weights(chunk, hf_config, cfg.model.path)
        self.table = weight_table(self.chunks[0], hf_config)
        if not platform.has_cuda():  # peers on this machine read the shards in place at each weight sync
            share_parameters(self.chunks)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=platform.has_cuda())
        self.model = [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in self.chunks]
        # The schedules read the first chunk's config.
        self.chunks[0].config.finalize_model_grads_func = finalize_model_grads
        optim = cfg.actor.optim
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.clip_grad,
            bf16=cfg.model.dtype == "bfloat16", params_dtype=self.chunks[0].config.params_dtype,
            use_distributed_optimizer=platform.has_cuda()), self.model)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(optimizer_steps, optim.lr_warmup_steps + 1), lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=1, wd_incr_style="constant")
        self.dp_size = parallel_state.get_data_parallel_world_size()
        # Sequence parallelism (MoE at TP > 1) splits every sequence over the TP ranks.
        self.sequence_multiple = (parallel_state.get_tensor_model_parallel_world_size()
                                  if self.chunks[0].config.sequence_parallel else 1)

    def _forward(self, micro: Batch, model):
        ids = micro["input_ids"]
        positions = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0).expand_as(ids)
        return model(ids, positions, None)

    def _run(self, batch: Batch, loss_func, forward_only: bool) -> list:
        device = platform.device()
        size = self.cfg.actor.micro_batch_size
        batch = pad_sequences(batch, self.sequence_multiple, self.pad_id)
        micros = [{k: v.to(device) for k, v in m.items()} for m in micro_batches(batch, size)]
        for micro in micros:
            micro["labels"] = labels_of(micro["input_ids"], self.pad_id)

        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            return self._forward(micro, model), partial(loss_func, micro)

        # Every chunk runs every micro-batch, so each chunk reads the micro-batches through its own iterator.
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(micros) for _ in self.model], model=self.model,
            num_microbatches=len(micros), seq_length=batch["input_ids"].shape[1], micro_batch_size=size,
            forward_only=forward_only)

    @torch.no_grad()
    def log_probs(self, batch: Batch) -> Batch | None:
        """log p(token) and the policy's entropy at every position, under the sampling temperature."""
        temperature, vocab = self.cfg.rollout.temperature, self.hf_config["vocab_size"]

        def loss_func(micro, output):
            logits = prepare_logits(output, temperature, vocab)
            ent = entropy(logits)
            log_probs = token_log_probs(logits, micro["labels"])  # overwrites logits (Megatron works in place)
            return output.new_zeros(()), {"log_probs": log_probs.cpu(), "entropy": ent.cpu()}

        for chunk in self.model:
            chunk.eval()
        outputs = self._run(batch, loss_func, forward_only=True)
        if not owns_dp_output():
            return None
        length = batch["input_ids"].shape[1]  # without the sequence-parallel padding
        return {key: torch.cat([o[key] for o in outputs])[:, :length] for key in ("log_probs", "entropy")}

    def update(self, batch: Batch) -> dict[str, float]:
        """PPO-clip updates over this step's samples: `ppo_epochs` passes of mini-batches, one optimizer step each.
        The loss is the token-mean over each global mini-batch, whatever the micro-batch and DP sizes."""
        actor = self.cfg.actor
        mini_size = actor.ppo_mini_batch_size * self.cfg.rollout.n // self.dp_size
        temperature, vocab = self.cfg.rollout.temperature, self.hf_config["vocab_size"]
        totals: dict[str, float] = {}
        grad_norms = []
        for chunk in self.model:
            chunk.train()
        for _ in range(actor.ppo_epochs):
            for mini in micro_batches(batch, mini_size):
                tokens = mini["response_mask"].sum().reshape(1)
                dist.all_reduce(tokens, group=parallel_state.get_data_parallel_group())
                normalizer = tokens.clamp(min=1).item()

                def loss_func(micro, output):
                    logits = prepare_logits(output, temperature, vocab)
                    log_probs = token_log_probs(logits, micro["labels"])
                    loss, stats = ppo_clip_policy_loss(
                        log_probs, micro["old_log_probs"], micro["advantages"], micro["response_mask"],
                        actor.clip_ratio_low, actor.clip_ratio_high, normalizer)
                    # The schedule divides by the number of micro-batches and DDP averages over DP ranks:
                    # undo both so the gradient is that of the mini-batch's token-mean.
                    num_micro = mini_size // actor.micro_batch_size
                    return loss * num_micro * self.dp_size, stats

                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                for stats in self._run(mini, loss_func, forward_only=False):
                    for key, value in stats.items():
                        totals[key] = totals.get(key, 0.0) + float(value)
                _, grad_norm, _ = self.optimizer.step()
                self.scheduler.step(increment=1)
                grad_norms.append(grad_norm or 0.0)
        return self._update_metrics(totals, grad_norms)

    def _update_metrics(self, totals: dict[str, float], grad_norms: list[float]) -> dict[str, float]:
        keys = ("pg_loss_sum", "pg_clipfrac_sum", "ppo_kl_sum", "tokens")
        sums = torch.tensor([totals.get(k, 0.0) for k in keys], dtype=torch.float64)
        if owns_dp_output():
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        loss_sum, clip_sum, kl_sum, tokens = sums.tolist()
        tokens = max(tokens, 1.0)
        return {"actor/pg_loss": loss_sum / tokens, "actor/pg_clipfrac": clip_sum / tokens,
                "actor/ppo_kl": kl_sum / tokens, "actor/grad_norm": sum(grad_norms) / len(grad_norms),
                "actor/lr": self.optimizer.param_groups[0]["lr"]}

    def weight_sources(self):
        """This rank's shards as resharding sources (and any mismatch with the weight table)."""
        return megatron_sources(self.chunks, self.table, parallel_state.get_tensor_model_parallel_rank(),
                                parallel_state.get_tensor_model_parallel_world_size())

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return export_hf_state_dict(self.chunks, self.table)
