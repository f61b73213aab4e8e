"""One rank's Megatron shard of a model (`MegatronModel`): its chunks built from the HF config (weights loaded or
random), and with an optimizer its training pieces (DDP, Megatron's optimizer, the LR schedule); the passes every
role runs over its micro-batches (Megatron's pipeline schedule), checkpoints, and the resharding sources. The roles:
`MegatronActor` (megatron_actor.py, the policy and the frozen reference) and `MegatronCritic` (megatron_critic.py).

Batches (`TrainBatch`) here are this data-parallel rank's slice. Every pass cuts it into micro-batches (a sample
count, or a token budget) whose samples are packed into one row or right-padded to the micro-batch's longest
(`rl_megatron.sequences`); per-token outputs come back per sample, so the losses and what a pass returns do not
depend on the grouping. Position t of `response_mask` / `*log_probs` / `values` refers to the token at t + 1 (the
label predicted at t; the value of the state before that token).
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist
import torch.distributed.nn as dist_nn
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.pipeline_parallel import get_forward_backward_func

from rl_megatron import platform
from rl_megatron.algorithms import LossScale, LossStats, megatron_loss_factor
from rl_megatron.batch import TokenOutputs, TrainBatch
from rl_megatron.checkpoint import load_checkpoint_into, save_model_checkpoint
from rl_megatron.config.schema import Config, LoraConfig, OptimConfig
from rl_megatron.models.activations import ActivationSettings
from rl_megatron.models.pipeline_stages import StageLayers
from rl_megatron.models.gpt import build_gpt_chunks, layer_offset, load_hf_weights, weight_table
from rl_megatron.models.lora import add_adapters, freeze_base
from rl_megatron.models.logprobs import OutputPositions
from rl_megatron.models.packed_attention import packed_seq_params
from rl_megatron.models.router_replay import RoutingReplay
from rl_megatron.platform.cpu_compat import device_mode_off
from rl_megatron.sequences import (MicroBatch, context_chunks, fixed_bins, micro_batch, outputs_to_host, round_up,
                                   scatter_rows, split_to_count, token_budget_bins)
from rl_megatron.workers.distributed import owns_dp_output

# tokens_of(micro-batch, model output) -> per-token outputs in the model's layout (rows x tokens)
TokensOf = Callable[[MicroBatch, torch.Tensor], TokenOutputs]
# finish(the pass's micro-batches, their outputs on this rank) -> the outputs, completed (on every rank after a pass)
Finish = Callable[[list[MicroBatch], list[TokenOutputs]], list[TokenOutputs]]
# loss_of(the micro-batch's samples, their per-token outputs, the mini-batch's LossScale) -> (loss, detached stats)
LossOf = Callable[[TrainBatch, TokenOutputs, LossScale], tuple[torch.Tensor, LossStats]]


@dataclass(frozen=True)
class Batching:
    """How a role cuts its samples into micro-batches."""
    micro_batch_size: int  # samples per micro-batch, without a token budget
    max_tokens: int | None  # the token budget of a micro-batch (None: micro_batch_size samples each)
    packing: bool  # samples share one row (else one right-padded row each)


class MegatronModel:
    """This rank's model chunks, and with `optim` the training pieces (DDP, Megatron optimizer, LR schedule).

    Weights: copied from `initial` (a model of the same layout in this process), else loaded from `checkpoint` (a
    Megatron checkpoint) or `weights_path` (an HF folder), else Megatron's random init from trainer.seed.
    `activations`: the role's sequence parallelism and recomputation; `stages`: the layers of its first / last
    pipeline stage. `distributed_optimizer`: Megatron's distributed optimizer, whose fp32 shards view the
    parameters in DDP's contiguous buffer (default: on CUDA; the offload tests choose it on CPU too). `lora`: the
    model's frozen weights get trainable LoRA adapters (models/lora.py), the only parameters DDP and the optimizer
    hold."""

    def __init__(self, cfg: Config, hf_config: dict, batching: Batching, *, activations: ActivationSettings,
                 stages: StageLayers, optim: OptimConfig | None = None, optimizer_steps: int = 0,
                 value_head: bool = False, weights_path: str | None = None, checkpoint: str | None = None,
                 initial: MegatronModel | None = None, distributed_optimizer: bool | None = None,
                 lora: LoraConfig | None = None):
        self.cfg, self.hf_config, self.batching = cfg, hf_config, batching
        self.distributed_optimizer = platform.on_with_cuda(distributed_optimizer)
        # One chunk per virtual pipeline stage (one without interleaving), in that order.
        self.chunks = [chunk.to(platform.device()) for chunk in build_gpt_chunks(
            hf_config, cfg.model.dtype, cfg.model.make_vocab_size_divisible_by,
            value_head_seed=cfg.trainer.seed if value_head else None, moe=cfg.moe,
            weights_follow=initial is not None or checkpoint is not None or weights_path is not None,
            activations=activations, stages=stages, deterministic=cfg.trainer.deterministic)]
        with torch.no_grad():
            if initial is not None:  # by name: the source may hold adapters this model has not
                for chunk, source in zip(self.chunks, initial.chunks):
                    values = dict(source.named_parameters())
                    for name, param in chunk.named_parameters():
                        param.copy_(values[name])
            elif checkpoint is not None:
                load_checkpoint_into(self.chunks, checkpoint, hf_config)
            elif weights_path is not None:
                for chunk in self.chunks:
                    load_hf_weights(chunk, hf_config, weights_path)
        self.lora = dataclasses.asdict(lora) if lora is not None else None  # what checkpoints record
        if lora is not None:
            for chunk in self.chunks:
                add_adapters(chunk, weight_table(chunk, hf_config), lora, layer_offset(chunk), cfg.trainer.seed)
            freeze_base(self.chunks)
        self.dp_size = parallel_state.get_data_parallel_world_size()
        # Sequence parallelism (by default at TP > 1) splits every sequence over the TP ranks.
        config = self.chunks[0].config
        self.sequence_multiple = (parallel_state.get_tensor_model_parallel_world_size()
                                  if config.sequence_parallel else 1)
        # Peers that cannot exchange shapes run every micro-batch of a pass in one shape: pipeline stages without
        # Megatron's variable_seq_lengths, and the all-gather dispatcher's expert-parallel peers (other DP ranks).
        pp = parallel_state.get_pipeline_model_parallel_world_size()
        allgather_peers = (config.num_moe_experts and config.moe_token_dispatcher_type == "allgather"
                           and parallel_state.get_expert_model_parallel_world_size() > 1)
        self.one_shape = bool((pp > 1 and not config.variable_seq_lengths) or allgather_peers)
        self.interleaved = len(self.chunks) > 1
        # Context parallelism cuts every packed span into 2 x CP chunks (each a multiple of the SP split).
        self.context_size = parallel_state.get_context_parallel_world_size()
        self.span_multiple = 2 * self.context_size * self.sequence_multiple if self.context_size > 1 else 1
        self.token_counts = [0, 0]  # real and computed tokens of the passes since the last update (padding ratio)
        self.output_positions: OutputPositions | None = None  # set where passes read the response tokens only
        self.routing_replay: RoutingReplay | None = None  # the actor's, with actor.router_replay
        self.model = self.chunks
        self.optimizer = self.scheduler = None
        if optim is None:
            for chunk in self.chunks:
                chunk.requires_grad_(False)
            return
        if cfg.moe.freeze_router:  # before DDP and the optimizer, which take only the parameters that need gradients
            for chunk in self.chunks:
                for name, param in chunk.named_parameters():
                    if ".mlp.router." in name:
                        param.requires_grad_(False)
        ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True,
                                                   use_distributed_optimizer=self.distributed_optimizer)
        self.model = [DistributedDataParallel(chunk.config, ddp_config, chunk) for chunk in self.chunks]
        self.chunks[0].config.finalize_model_grads_func = finalize_model_grads  # the schedules read chunk 0's config
        self.optimizer = get_megatron_optimizer(OptimizerConfig(
            optimizer="adam", lr=optim.lr, min_lr=optim.min_lr, weight_decay=optim.weight_decay,
            adam_beta1=optim.betas[0], adam_beta2=optim.betas[1], adam_eps=optim.eps, clip_grad=optim.clip_grad,
            bf16=cfg.model.dtype == "bfloat16", params_dtype=self.chunks[0].config.params_dtype,
            use_distributed_optimizer=self.distributed_optimizer), self.model)
        self.fused_adam = platform.on_with_cuda(optim.fused)
        use_fused_adam(self.optimizer, self.fused_adam)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0 if optim.lr_warmup_steps else optim.lr, max_lr=optim.lr,
            min_lr=optim.min_lr, lr_warmup_steps=optim.lr_warmup_steps,
            lr_decay_steps=max(optimizer_steps, optim.lr_warmup_steps + 1), lr_decay_style=optim.lr_decay_style,
            start_wd=optim.weight_decay, end_wd=optim.weight_decay, wd_incr_steps=1, wd_incr_style="constant",
            # A resumed run follows the schedule its config gives now; the checkpoint brings the step count.
            override_opt_param_scheduler=True, use_checkpoint_opt_param_scheduler=False)

    def save_checkpoint(self, ckpt_dir: str) -> None:
        """Weights, and when trainable the optimizer state and LR schedule (a collective over the model's ranks)."""
        save_model_checkpoint(self.chunks, ckpt_dir, self.hf_config, self.cfg.model.path, optimizer=self.optimizer,
                              scheduler=self.scheduler, lora=self.lora)

    def load_checkpoint(self, ckpt_dir: str) -> None:
        """The inverse of `save_checkpoint`, at any layout (a collective over the model's ranks)."""
        load_checkpoint_into(self.chunks, ckpt_dir, self.hf_config, optimizer=self.optimizer,
                             scheduler=self.scheduler, lora=self.lora)
        if self.optimizer is not None:  # the checkpoint's param groups carry the kernel of the run that saved it
            use_fused_adam(self.optimizer, self.fused_adam)

    def micro_batches(self, batch: TrainBatch) -> list[MicroBatch]:
        """`batch` in micro-batches: a count every data-parallel rank agrees on (the pipeline's stages and the
        expert-parallel peers run as many), a multiple of PP with interleaving (Megatron's schedule runs them in
        groups of PP), each a token budget's worth or micro_batch_size samples."""
        lengths = batch.sequence_lengths()
        if self.batching.max_tokens is None:
            bins = fixed_bins(len(lengths), self.batching.micro_batch_size)
        else:
            bins = token_budget_bins(lengths, self.batching.max_tokens)
        count = self._dp_max(len(bins))
        if self.interleaved:
            count = round_up(count, parallel_state.get_pipeline_model_parallel_world_size())
        micros = [micro_batch(batch, rows, self.batching.packing, self.sequence_multiple, self.span_multiple)
                  for rows in split_to_count(bins, lengths, count)]
        if self.one_shape:
            rows = self._dp_max(max(m.input_ids.shape[0] for m in micros))
            tokens = self._dp_max(max(m.input_ids.shape[1] for m in micros))
            micros = [m.padded_to(rows, tokens) for m in micros]
        self.token_counts[0] += sum(lengths)
        self.token_counts[1] += sum(m.computed_tokens() for m in micros)
        if self.context_size > 1:
            rank = parallel_state.get_context_parallel_rank()
            micros = [m.context_shard(rank, self.context_size) for m in micros]
        if self.output_positions is not None:
            micros = [m.reading_responses() for m in micros]
        return micros

    def _per_sample(self, micro: MicroBatch, outputs: TokenOutputs) -> TokenOutputs:
        """Per-token outputs in the model's layout -> per sample; under context parallelism each rank's share of the
        row first gathered from the CP group (differentiable: each rank's loss then sees the whole row, and its
        gradient reaches each rank's own positions, as NeMo-RL gathers its CP log-probs)."""
        if micro.context_index is not None:
            order = torch.argsort(torch.cat([context_chunks(micro.cu_seqlens, rank, self.context_size)
                                             for rank in range(self.context_size)])).to(micro.input_ids.device)
            group = parallel_state.get_context_parallel_group()
            outputs = TokenOutputs(**{name: torch.cat(dist_nn.all_gather(value.contiguous(), group=group), dim=1
                                                      )[:, order] for name, value in outputs.tensors().items()})
        return micro.unpack_outputs(outputs)

    def _dp_max(self, value: int) -> int:
        total = torch.tensor([value], dtype=torch.long)
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=parallel_state.get_data_parallel_group())
        return int(total.item())

    def _forward(self, micro: MicroBatch, model):
        packed = None if micro.cu_seqlens is None else packed_seq_params(micro.cu_seqlens, micro.input_ids.device)
        input_ids, position_ids = micro.model_inputs()
        if self.output_positions is not None:
            self.output_positions.index = micro.read_positions[1]
        if self.routing_replay is None:
            return model(input_ids, position_ids, None, packed_seq_params=packed)
        chunk = self.model.index(model)
        self.routing_replay.before_forward(chunk, micro)
        output = model(input_ids, position_ids, None, packed_seq_params=packed)
        self.routing_replay.after_forward(chunk, micro)
        return output

    def run(self, micros: list[MicroBatch], loss_func, forward_only: bool) -> list:
        """Megatron's pipeline schedule over `micros`; loss_func(micro, output) -> (loss, stats) runs on the last
        stage. Returns the stats of each micro-batch there, in order."""
        micros = [micro.to_device(platform.device()) for micro in micros]

        def forward_step(data_iterator, model):
            micro = next(data_iterator)
            # The model's layers and the losses have no CUDA literals: on a CPU, they run without the CUDA-to-CPU
            # mode's Python hook on every op (a third of a tiny model's update time). The schedule around them,
            # the backward and the optimizer step keep it.
            with device_mode_off():
                output = self._forward(micro, model)
            return output, partial(_without_device_mode, loss_func, micro)

        for chunk in self.model:
            chunk.train(not forward_only)
        # Every chunk runs every micro-batch, so each chunk reads the micro-batches through its own iterator. The
        # shapes given are the (common) shape where stages cannot exchange shapes, else Megatron exchanges them.
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=[iter(micros) for _ in self.model], model=self.model,
            num_microbatches=len(micros), seq_length=max(m.input_ids.shape[1] for m in micros),
            micro_batch_size=max(m.input_ids.shape[0] for m in micros), forward_only=forward_only)

    @torch.no_grad()
    def infer(self, batch: TrainBatch, tokens_of: TokensOf, finish: Finish | None = None) -> TokenOutputs | None:
        """Per-token outputs of a forward pass, from the ranks that own them (None elsewhere); `finish`, called on
        every rank after the pass, may add to each micro-batch's outputs."""
        micros = self.micro_batches(batch)
        outputs = self.run(micros, lambda micro, output: (output.new_zeros(()),
                                                          self._per_sample(micro, tokens_of(micro, output))),
                           forward_only=True)
        if finish is not None:
            outputs = finish(micros, outputs)
        if not owns_dp_output():
            return None
        return self.on_host([m.rows for m in micros], outputs, batch)

    @staticmethod
    def on_host(rows: list[list[int]], outputs: list[TokenOutputs], batch: TrainBatch) -> TokenOutputs:
        """Micro-batches' per-sample outputs (each micro-batch's rows of `batch` and their outputs) as [B, S] tensors
        in `batch`'s row order, on the host."""
        return scatter_rows(list(zip(rows, outputs_to_host(outputs))), batch.rows(), batch.input_ids.shape[1])

    def train(self, batch: TrainBatch, mini_batch_samples: int, epochs: int, horizon: int, tokens_of: TokensOf,
              loss_of: LossOf, kept: list[tuple[list[int], TokenOutputs]] | None = None) -> dict[str, float]:
        """`epochs` passes over `batch` in mini-batches of `mini_batch_samples` (over all DP ranks), one optimizer
        step each. `loss_of` normalises by the mini-batch's global `LossScale` (with `horizon`, the generation budget
        Dr.GRPO divides by), so the gradient is the same whatever the micro-batch, DP and CP sizes.

        `kept`: each micro-batch's rows and per-token outputs, detached, are added to it (on the last pipeline
        stage): the outputs of the weights before the update, so only in one epoch of one mini-batch.

        Returns each stat of the losses (see `LossStats`), added over micro-batches and ranks: token sums divided by
        the response tokens, losses averaged over optimizer steps."""
        mini_size = mini_batch_samples // self.dp_size
        if kept is not None and (epochs != 1 or mini_size < batch.rows()):
            raise ValueError(f"an update's outputs are the policy's before it only in one optimizer step; this one "
                             f"takes {epochs} epoch(s) of mini-batches of {mini_size} of this rank's {batch.rows()} "
                             "samples")
        totals = LossStats(tokens=0.0, token_sums={})
        grad_norms = []
        steps = 0
        for _ in range(epochs):
            for mini in batch.chunks(mini_size):
                counts = torch.tensor([mini.response_mask.sum().item(), mini.response_mask.shape[0]],
                                      dtype=torch.float64)
                dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
                if counts[0] == 0:  # nothing to learn from (every sample kept out of the loss): no optimizer step
                    continue
                scale = LossScale(tokens=max(counts[0].item(), 1.0), sequences=counts[1].item(),
                                  horizon=horizon)
                micros = self.micro_batches(mini)

                def loss_func(micro, output):
                    outputs = self._per_sample(micro, tokens_of(micro, output))
                    if kept is not None:
                        kept.append((micro.rows, TokenOutputs(**{name: value.detach() for name, value
                                                                 in outputs.tensors().items()})))
                    loss, stats = loss_of(micro.samples, outputs, scale)
                    # What the schedule, the CP all-gather and DDP do to the gradient, undone: that of the
                    # mini-batch's loss remains.
                    return loss * megatron_loss_factor(len(micros), self.dp_size, self.context_size), stats

                for chunk in self.model:
                    chunk.zero_grad_buffer()
                self.optimizer.zero_grad()
                for stats in self.run(micros, loss_func, forward_only=False):
                    totals.add(stats)
                _, grad_norm, _ = self.optimizer.step()
                self.scheduler.step(increment=1)
                grad_norms.append(grad_norm or 0.0)
                steps += 1
        return self._mean_stats(totals, steps) | {"grad_norm": sum(grad_norms) / max(len(grad_norms), 1),
                                                  "lr": self.optimizer.param_groups[0]["lr"]}

    def padding_ratio(self) -> float:
        """Padded tokens / computed tokens of this model's passes since the last call, over its DP ranks."""
        counts = torch.tensor(self.token_counts, dtype=torch.float64)
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        self.token_counts = [0, 0]
        real, computed = counts.tolist()
        return 1.0 - real / computed if computed else 0.0

    def _mean_stats(self, totals: LossStats, steps: int) -> dict[str, float]:
        sum_keys, loss_keys, sums = totals.figures(platform.device())
        if owns_dp_output():  # the last stage computed the stats; add its DP peers'
            dist.all_reduce(sums, group=parallel_state.get_data_parallel_group())
        tokens, *values = sums.tolist()  # the update's one read-back of its statistics
        tokens = max(tokens, 1.0)
        return ({key: value / tokens for key, value in zip(sum_keys, values)}
                | {key: value / steps for key, value in zip(loss_keys, values[len(sum_keys):])})


def _without_device_mode(loss_func, micro, output):
    with device_mode_off():
        return loss_func(micro, output)


def torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers inside Megatron's `optimizer` (one, or a chain's: one per parameter kind)."""
    parts = getattr(optimizer, "chained_optimizers", [optimizer])
    return [part.optimizer for part in parts if isinstance(getattr(part, "optimizer", None), torch.optim.Optimizer)]


def use_fused_adam(optimizer, fused: bool) -> None:
    """Run torch's Adam(W), where Megatron took it (without Transformer Engine or Apex), as one fused kernel (`fused`)
    or as torch chooses (foreach on CUDA). Set on the param groups, which torch reads at every step (Megatron builds
    the optimizer without the flag; torchtitan builds its AdamW fused by default). TE's and Apex's FusedAdam
    are fused already: left alone."""
    for inner in torch_optimizers(optimizer):
        if isinstance(inner, (torch.optim.Adam, torch.optim.AdamW)):
            for group in inner.param_groups:
                group["fused"], group["foreach"] = (True, False) if fused else (None, None)

