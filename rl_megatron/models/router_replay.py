"""MoE routing replay (`actor.router_replay`): the update's forward and backward go through the experts the old
log-prob pass chose (R2, verl's name and meaning), so that the policy ratio compares the same computation.

Megatron-core's `RouterReplay` (one per router; record, replay forward, replay backward) does the routing; this
module drives it per micro-batch and moves the choices between Megatron's layout and the samples': a sample's routing
is a [tokens, MoE layers, top-k] tensor of expert ids (int16), position t the experts token t went to, carried in
`TrainBatch.routed_experts` from the old log-prob pass to the update, whatever the micro-batches of each.

In Megatron's layout a router sees the micro-batch's tokens sequence-first ([tokens x rows] flattened, row fastest),
packed or right-padded as `MicroBatch` lays them out; with sequence parallelism (MoE at TP > 1) each TP rank's
router sees its contiguous share of the tokens. Padding positions replay experts 0..k-1 (their outputs join no
loss). The layouts this covers so far: PP=1 and CP=1, any TP (with sequence parallelism) and EP (pre-flight refuses
the others).
"""
from __future__ import annotations

from contextlib import contextmanager
from enum import Enum

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from rl_megatron.sequences import MicroBatch

ROUTING_DTYPE = torch.int16  # expert ids below 32768


class Pass(Enum):
    RECORD = "record"  # the old log-prob pass: keep each token's experts
    REPLAY = "replay"  # the update: route through the recorded experts, forward and (with recomputation) backward


def moe_layers(config) -> list[int]:
    """Global indices of the layers with a router (a mixed model's dense layers have none)."""
    freq = config.moe_layer_freq
    return [i for i in range(config.num_layers) if (freq[i] if isinstance(freq, list) else i % freq == 0)]


class RoutingReplay:
    """Replay hooks on the routers of `chunks` (this rank's model chunks)."""

    def __init__(self, chunks: list):
        config = chunks[0].config
        self.top_k = config.moe_router_topk
        # Sequence parallelism: this rank's routers see share `rank` of `shares` of every micro-batch's tokens.
        self.shares = parallel_state.get_tensor_model_parallel_world_size() if config.sequence_parallel else 1
        self.share = parallel_state.get_tensor_model_parallel_rank() if config.sequence_parallel else 0
        column = {layer: i for i, layer in enumerate(moe_layers(config))}
        self.layers = len(column)
        # Per chunk: (the layer's column in a routing tensor, its router's replay), in layer order.
        self.replays = []
        for chunk in chunks:
            replays = []
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    router.router_replay = RouterReplay()
                    RouterReplay.global_router_replay_instances.remove(router.router_replay)  # ours, not global
                    replays.append((column[layer.layer_number - 1], router.router_replay))
            self.replays.append(replays)
        self.now: Pass | None = None

    @contextmanager
    def running(self, mode: Pass):
        """The passes inside record (RECORD) or replay (REPLAY) their routing."""
        self.now = mode
        try:
            yield
        finally:
            self.now = None
            for replays in self.replays:
                for _, replay in replays:
                    replay.clear_indices()
                    replay.clear_router_replay_action()

    def before_forward(self, chunk: int, micro: MicroBatch) -> None:
        if self.now is Pass.RECORD:
            for _, replay in self.replays[chunk]:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
        elif self.now is Pass.REPLAY:
            if micro.samples.routed_experts is None:
                raise ValueError("actor.router_replay=R2 replays the old log-prob pass's routing, but the batch has "
                                 "none (TrainBatch.routed_experts)")
            targets = model_layout(micro, micro.samples.routed_experts, self.top_k)
            targets = targets.chunk(self.shares)[self.share]  # sequence-first: a share is a contiguous block
            for layer, replay in self.replays[chunk]:
                replay.set_target_indices(targets[:, layer])
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk: int, micro: MicroBatch) -> torch.Tensor | None:
        """Recording: this micro-batch's routing in the model's layout, [rows, tokens, MoE layers, top-k]. Replaying:
        the chunk's routers switch to the backward's replay (full recomputation routes again, in the same order)."""
        if self.now is Pass.REPLAY:
            for _, replay in self.replays[chunk]:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
            return None
        if self.now is not Pass.RECORD:
            return None
        rows, tokens = micro.input_ids.shape
        # int32 for the gather of the shares (gloo has no int16 collectives), int16 to keep
        recorded = torch.zeros(tokens * rows // self.shares, self.layers, self.top_k, dtype=torch.int32,
                               device=micro.input_ids.device)
        for layer, replay in self.replays[chunk]:
            recorded[:, layer] = replay.get_recorded_indices()
            replay.clear_indices()
        if self.shares > 1:
            shares = [torch.empty_like(recorded) for _ in range(self.shares)]
            dist.all_gather(shares, recorded, group=parallel_state.get_tensor_model_parallel_group())
            recorded = torch.cat(shares)
        return recorded.to(ROUTING_DTYPE).view(tokens, rows, self.layers, self.top_k).transpose(0, 1)


def model_layout(micro: MicroBatch, routing: torch.Tensor, top_k: int) -> torch.Tensor:
    """Per-sample routing ([samples, longest, layers, k]) as the routers of `micro` see their tokens:
    [tokens x rows, layers, k] (long), sequence-first; padding positions route to experts 0..k-1."""
    rows, tokens = micro.input_ids.shape
    layers = routing.shape[2]
    laid = torch.arange(top_k, device=routing.device).expand(rows, tokens, layers, top_k).clone()
    for i, length in enumerate(micro.lengths):
        row, start = (i, 0) if micro.cu_seqlens is None else (0, micro.cu_seqlens[i])
        laid[row, start:start + length] = routing[i, :length]
    return laid.transpose(0, 1).reshape(tokens * rows, layers, top_k)
