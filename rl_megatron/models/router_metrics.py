"""Router metrics of an MoE model's training passes: how many tokens each expert gets, how many the capacity limit
drops, and the router losses Megatron computes (its own logging tracker), reduced over every rank.

Metric names (per global layer i, from 0, and over all layers):
  moe/layer{i}/load_min, load_max, load_std   tokens routed to the layer's least / most loaded expert, and the std
                                              over its experts (all micro-batches of the update, every rank)
  moe/load_min, moe/load_max                  the lowest and highest of those over the layers; moe/load_std: their mean
  moe/layer{i}/dropped_tokens, moe/dropped_tokens   token-to-expert assignments over capacity (moe.capacity_factor),
                                              per layer and summed over the layers
  moe/load_balancing_loss, moe/z_loss (and per layer)   Megatron's tracked losses (names as Megatron logs them),
                                              without their coefficients, mean per micro-batch and over the ranks;
                                              only when moe.aux_loss_coeff / moe.z_loss_coeff turn them on
  moe/expert_bias_min, moe/expert_bias_max     routers with an expert bias (DeepSeek-V3, GLM-4.5): its extremes over the
  (and moe/layer{i}/expert_bias_*)            experts after the update (moe.router_bias_update_rate moves it)
Only layers that route are reported (a model's dense layers have no router). Counts include the padding positions
of the micro-batches (the router sees every position).
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

from rl_megatron import platform


class RouterMetrics:
    """Hooks on the routers of `chunks` (this rank's model chunks) that count tokens per expert while `recording`."""

    def __init__(self, chunks: list):
        config = chunks[0].config
        self.num_layers, self.experts, self.top_k = config.num_layers, config.num_moe_experts, config.moe_router_topk
        # Counted on the device (no host sync per router call); the token counts come from shapes, on the host.
        self.load = torch.zeros(self.num_layers, self.experts, dtype=torch.float64, device=platform.device())
        self.assigned = torch.zeros(self.num_layers, dtype=torch.float64)  # tokens x top-k, before dropping
        self.calls = torch.zeros(self.num_layers, dtype=torch.float64)
        self.recording_now = False
        freq = config.moe_layer_freq
        self.routing = [i for i in range(self.num_layers)
                        if (freq[i] if isinstance(freq, list) else i % freq == 0)]
        self.has_bias = config.moe_router_enable_expert_bias
        self.biases = {}  # global layer -> its router's expert bias (a buffer), on this rank's stage
        for chunk in chunks:
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    router.register_forward_hook(self._hook(layer.layer_number - 1))
                    if getattr(router, "expert_bias", None) is not None:
                        self.biases[layer.layer_number - 1] = router.expert_bias

    def _hook(self, layer: int):
        def record(module, inputs, output) -> None:
            # Full activation recomputation runs a layer's training forward twice: once without a graph (keeping
            # only the layer's input) and again in the backward pass. Only the pass that builds the graph counts,
            # as Megatron's router computes its losses only with gradients on.
            if not self.recording_now or not torch.is_grad_enabled():
                return
            _, routing_map = output  # [tokens, experts]: which experts each token goes to, after any dropping
            self.load[layer] += routing_map.sum(0)
            self.assigned[layer] += routing_map.shape[0] * self.top_k
            self.calls[layer] += 1

        return record

    @contextmanager
    def recording(self):
        """Count the routing of the passes inside (a training update); `metrics()` then reports them."""
        from megatron.core.transformer.moe.moe_utils import clear_aux_losses_tracker

        clear_aux_losses_tracker()  # what earlier passes (e.g. the critic's update) left in Megatron's tracker
        for counter in (self.load, self.assigned, self.calls):
            counter.zero_()
        self.recording_now = True
        try:
            yield
        finally:
            self.recording_now = False

    def metrics(self) -> dict[str, float]:
        """The recorded counts and Megatron's tracked losses, reduced over every rank (a collective)."""
        from megatron.core import parallel_state
        from megatron.core.transformer.moe.moe_utils import get_moe_layer_wise_logging_tracker

        # Each layer's counts are on its pipeline stage only; the ranks of a stage route different tokens (their
        # own data-parallel samples, or with sequence parallelism their part of the sequence: MoE at TP > 1 always
        # has it), so the sum over every rank counts each token once.
        counts = torch.cat([self.load.cpu(), self.assigned[:, None]], dim=1)
        dist.all_reduce(counts)
        load, assigned = counts[:, :self.experts], counts[:, self.experts]
        calls = self.calls.clone()  # micro-batches per rank (the same on every rank of a stage)
        dist.all_reduce(calls, op=dist.ReduceOp.MAX)
        dropped = assigned - load.sum(1)
        out = {}
        load, dropped = load[self.routing], dropped[self.routing]
        for i, layer in enumerate(self.routing):
            out.update({f"moe/layer{layer}/load_min": load[i].min().item(),
                        f"moe/layer{layer}/load_max": load[i].max().item(),
                        f"moe/layer{layer}/load_std": load[i].std().item(),
                        f"moe/layer{layer}/dropped_tokens": dropped[i].item()})
        out.update({"moe/load_min": load.min().item(), "moe/load_max": load.max().item(),
                    "moe/load_std": load.std(dim=1).mean().item(), "moe/dropped_tokens": dropped.sum().item()})
        tracker = get_moe_layer_wise_logging_tracker()
        ranks_per_stage = dist.get_world_size() // parallel_state.get_pipeline_model_parallel_world_size()
        for name in sorted(tracker):
            values = tracker[name]["values"].to(device="cpu", dtype=torch.float64)
            dist.all_reduce(values)  # each layer's values are on its stage's ranks
            # As Megatron reduces them: a loss with a reduce group (the load-balancing loss: each sequence shard's
            # part of it) is the sum over that group, and every loss is averaged over the other ranks.
            parts = tracker[name]["reduce_group"].size() if tracker[name].get("reduce_group") is not None else 1
            per_layer = values / (ranks_per_stage // parts) / calls.clamp(min=1)
            out[f"moe/{name}"] = per_layer[self.routing].mean().item()
            out.update({f"moe/layer{i}/{name}": per_layer[i].item() for i in self.routing})
        return out | self.bias_metrics()

    def bias_metrics(self) -> dict[str, float]:
        """The expert biases' extremes per layer and overall (a collective when the model has them: each layer's
        bias is on its stage's ranks only)."""
        if not self.has_bias:
            return {}
        extremes = torch.full((self.num_layers, 2), -float("inf"), dtype=torch.float64)
        for layer, bias in self.biases.items():
            extremes[layer] = torch.stack([bias.max(), -bias.min()]).double().cpu()
        dist.all_reduce(extremes, op=dist.ReduceOp.MAX)
        held = extremes[:, 0] > -float("inf")
        out = {"moe/expert_bias_max": extremes[held, 0].max().item(),
               "moe/expert_bias_min": -extremes[held, 1].max().item()}
        for layer in held.nonzero().flatten().tolist():
            out.update({f"moe/layer{layer}/expert_bias_max": extremes[layer, 0].item(),
                        f"moe/layer{layer}/expert_bias_min": -extremes[layer, 1].item()})
        return out
