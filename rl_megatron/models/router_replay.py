"""MoE routing replay (`actor.router_replay`, verl's names and meaning) and the routing agreement metric.

- R2: the update's forward and backward go through the experts the old log-prob pass chose, so that the policy
  ratio compares the same computation.
- R3: the old log-prob, reference and update passes go through the experts the rollout engine chose for each token
  (`TrainBatch.routed_experts` from `rollout/routing_capture.py`), so that the trainer computes what the engine did.
- `moe/routing_agreement` (whenever the batch carries the engine's routing): in the old log-prob pass, the fraction
  of (token, MoE layer, top-k slot) choices where the trainer's own router, unreplayed, picks the engine's experts.

Megatron-core's `RouterReplay` (one per router; record, replay forward, replay backward) does the routing; this
module drives it per micro-batch and moves the choices between Megatron's layout and the samples': a sample's routing
is a [tokens, MoE layers, top-k] tensor of expert ids (int16; UNROUTED where unknown), position t the experts token t
went to, carried in `TrainBatch.routed_experts` whatever the micro-batches of each pass.

In Megatron's layout a router sees the micro-batch's tokens sequence-first ([tokens x rows] flattened, row fastest),
packed or right-padded as `MicroBatch` lays them out; with sequence parallelism (MoE at TP > 1) each TP rank's
router sees its contiguous share of the tokens. Unrouted positions (padding, the last token, which the engine never
fed) replay experts 0..k-1: no loss reads their outputs, and causal attention keeps them from every other token.
Each pipeline stage (and virtual chunk) replays its own layers, and R2's record is gathered from the stages after
the pass; under context parallelism each rank's routers see its `context_chunks` of the packed row, and R2's record
is put back together from the CP ranks' shares.
"""
from __future__ import annotations

from contextlib import contextmanager
from enum import Enum

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from rl_megatron.batch import UNROUTED
from rl_megatron.sequences import MicroBatch, context_chunks

ROUTING_DTYPE = torch.int16  # expert ids below 32768


class Pass(Enum):
    RECORD = "record"  # route as the router chooses, and keep each token's experts (R2's old log-prob pass)
    REPLAY = "replay"  # route through the batch's experts, forward and (with recomputation) backward


class _Replay(RouterReplay):
    """Megatron's replay of one router that, when `measuring` a replayed forward, also keeps the experts the router
    would have chosen (`own`)."""

    def __init__(self):
        super().__init__()
        self.measuring = False
        self.own: torch.Tensor | None = None

    def get_replay_topk(self, scores, topk, num_groups=None, group_topk=None, default_compute_topk=None):
        if self.measuring and self.router_replay_action is RouterReplayAction.REPLAY_FORWARD:
            with torch.no_grad():
                self.own = default_compute_topk(scores, topk, num_groups=num_groups, group_topk=group_topk)[1]
        return super().get_replay_topk(scores, topk, num_groups, group_topk, default_compute_topk)


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
        self.columns = {layer: i for i, layer in enumerate(moe_layers(config))}  # global layer -> its column
        self.layers = len(self.columns)
        # Per chunk: (the layer's column in a routing tensor, its router's replay), in layer order.
        self.replays = []
        for chunk in chunks:
            replays = []
            for layer in chunk.decoder.layers:
                router = getattr(layer.mlp, "router", None)
                if router is not None:
                    router.router_replay = _Replay()
                    RouterReplay.global_router_replay_instances.remove(router.router_replay)  # ours, not global
                    replays.append((self.columns[layer.layer_number - 1], router.router_replay))
            self.replays.append(replays)
        self.now: Pass | None = None
        self.records: list[list[torch.Tensor]] = [[] for _ in chunks]  # RECORD: per chunk, each micro-batch's
        self.measuring = False
        self.targets: tuple[torch.Tensor, torch.Tensor] | None = None  # this share's (batch's experts, routed mask)
        # Per MoE layer: top-k slots where the router's own choice is the batch's, and slots compared.
        self.agreement = torch.zeros(2, self.layers, dtype=torch.float64,
                                     device=next(chunks[0].parameters()).device)  # no host sync per layer

    @contextmanager
    def running(self, mode: Pass, measure: bool = False):
        """The passes inside record (RECORD) or replay (REPLAY) their routing; `measure`: count where the routers'
        own choices agree with the batch's routing (`agreement_metrics`)."""
        self.now, self.measuring = mode, measure
        for replays in self.replays:
            for _, replay in replays:
                replay.measuring = measure
        try:
            yield
        finally:
            self.now, self.measuring, self.targets = None, False, None
            self.records = [[] for _ in self.replays]
            for replays in self.replays:
                for _, replay in replays:
                    replay.clear_indices()
                    replay.clear_router_replay_action()
                    replay.measuring, replay.own = False, None

    def before_forward(self, chunk: int, micro: MicroBatch) -> None:
        routing = micro.samples.routed_experts
        if self.now is Pass.REPLAY and routing is None:
            raise ValueError("actor.router_replay replays the batch's routing, but the batch has none "
                             "(TrainBatch.routed_experts: R2 records it in the old log-prob pass, R3 takes the "
                             "engine's, moe.engine_routing)")
        if routing is not None and (self.now is Pass.REPLAY or self.measuring):
            self.targets = rank_share(micro, routing, self.top_k, self.shares, self.share)
        for layer, replay in self.replays[chunk]:
            if self.now is Pass.RECORD:
                replay.set_router_replay_action(RouterReplayAction.RECORD)
            elif self.now is Pass.REPLAY:
                replay.set_target_indices(self.targets[0][:, layer])
                replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)

    def after_forward(self, chunk: int, micro: MicroBatch) -> None:
        """Recording: keeps this chunk's share of the micro-batch's routing (`recorded`). Replaying: the chunk's
        routers switch to the backward's replay (full recomputation routes again, in the same order)."""
        if self.measuring and self.targets is not None:
            self._count_agreement(chunk)
        if self.now is Pass.REPLAY:
            for _, replay in self.replays[chunk]:
                replay.set_router_replay_action(RouterReplayAction.REPLAY_BACKWARD)
        elif self.now is Pass.RECORD:
            self.records[chunk].append(self._record(chunk, micro))

    def recorded(self, micros: list[MicroBatch]) -> list[torch.Tensor]:
        """After a recording pass over `micros`, on every rank: each micro-batch's routing per sample ([samples,
        longest, MoE layers, top-k] int16, zero beyond each sample), its layers gathered from every pipeline stage
        and virtual chunk (each recorded its own; a collective over the pipeline group)."""
        merged = [sum(records) for records in zip(*self.records)]  # each chunk ran every micro-batch, in order
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:
            for record in merged:
                dist.all_reduce(record, group=parallel_state.get_pipeline_model_parallel_group())
        return [micro.unpack(record.to(ROUTING_DTYPE)) for micro, record in zip(micros, merged)]

    def _record(self, chunk: int, micro: MicroBatch) -> torch.Tensor:
        """The chunk's routers' record of `micro`, in the model's layout [rows, tokens, MoE layers, top-k] (int32;
        zero in the columns of other chunks' layers)."""
        rows, tokens = micro.input_ids.shape
        seen = rows * tokens if micro.context_index is None else len(micro.context_index)  # this CP rank's tokens
        # int32 for the gathers (gloo has no int16 collectives), int16 to keep
        recorded = torch.zeros(seen // self.shares, self.layers, self.top_k, dtype=torch.int32,
                               device=micro.input_ids.device)
        for layer, replay in self.replays[chunk]:
            recorded[:, layer] = replay.get_recorded_indices()
            replay.clear_indices()
        if self.shares > 1:
            shares = [torch.empty_like(recorded) for _ in range(self.shares)]
            dist.all_gather(shares, recorded, group=parallel_state.get_tensor_model_parallel_group())
            recorded = torch.cat(shares)
        if micro.context_index is not None:
            shares = [torch.empty_like(recorded) for _ in range(parallel_state.get_context_parallel_world_size())]
            dist.all_gather(shares, recorded, group=parallel_state.get_context_parallel_group())
            recorded = whole_row(shares, micro.cu_seqlens)
        return recorded.view(tokens, rows, self.layers, self.top_k).transpose(0, 1)

    def _count_agreement(self, chunk: int) -> None:
        """Add this micro-batch's share to `agreement`: per layer, the routed tokens' top-k slots whose expert the
        router's own choice (recorded, or kept beside the replay) holds too."""
        experts, routed = self.targets
        for layer, replay in self.replays[chunk]:
            own = replay.get_recorded_indices() if self.now is Pass.RECORD else replay.own
            target = experts[:, layer][routed]
            held = (target.unsqueeze(-1) == own[routed].to(target.device).unsqueeze(-2)).any(-1)
            self.agreement[0, layer] += held.sum()
            self.agreement[1, layer] += held.numel()
        self.targets = None

    def agreement_metrics(self) -> dict[str, float]:
        """moe/routing_agreement (and per layer, moe/layer{i}/routing_agreement) over the data-parallel ranks (and
        the sequence-parallel shares) since the last call; {} when nothing was compared."""
        counts = self.agreement.clone()
        self.agreement.zero_()
        dist.all_reduce(counts, group=parallel_state.get_data_parallel_group())
        if self.shares > 1:
            dist.all_reduce(counts, group=parallel_state.get_tensor_model_parallel_group())
        if parallel_state.get_pipeline_model_parallel_world_size() > 1:  # each stage counted its own layers
            dist.all_reduce(counts, group=parallel_state.get_pipeline_model_parallel_group())
        if parallel_state.get_context_parallel_world_size() > 1:  # each CP rank its share of the tokens
            dist.all_reduce(counts, group=parallel_state.get_context_parallel_group())
        held, compared = counts.tolist()  # the one read-back
        if not sum(compared):
            return {}
        out = {"moe/routing_agreement": sum(held) / sum(compared)}
        out.update({f"moe/layer{layer}/routing_agreement": held[column] / compared[column]
                    for layer, column in self.columns.items() if compared[column]})
        return out


def rank_share(micro: MicroBatch, routing: torch.Tensor, top_k: int, shares: int,
               share: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`model_layout` of the tokens this rank's routers see: its context-parallel positions of the packed row (in
    `context_index` order), then its sequence-parallel share (`share` of `shares`: a contiguous block)."""
    experts, routed = model_layout(micro, routing, top_k)
    return experts.chunk(shares)[share], routed.chunk(shares)[share]


def whole_row(shares: list[torch.Tensor], cu_seqlens: list[int]) -> torch.Tensor:
    """Per-token values of a packed row from its context-parallel ranks' shares (rank r's at `context_chunks`' r)."""
    index = torch.cat([context_chunks(cu_seqlens, rank, len(shares)) for rank in range(len(shares))])
    row = torch.empty(len(index), *shares[0].shape[1:], dtype=shares[0].dtype, device=shares[0].device)
    row[index.to(row.device)] = torch.cat(shares)
    return row


def model_layout(micro: MicroBatch, routing: torch.Tensor, top_k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-sample routing ([samples, longest, layers, k]) as the routers of `micro` see their tokens (its
    context-parallel share: `MicroBatch.model_layout`): ([tokens x rows, layers, k] long, sequence-first; [tokens x
    rows] bool, where the routing is known). Unknown positions (padding, UNROUTED) route to experts 0..k-1."""
    laid = micro.model_layout(routing.long(), fill=UNROUTED)
    laid = laid.transpose(0, 1).reshape(-1, *laid.shape[2:])
    routed = laid[:, 0, 0] != UNROUTED
    laid[~routed] = torch.arange(top_k, device=laid.device)
    return laid, routed
