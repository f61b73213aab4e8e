"""Routing replay's layouts (rl_megatron/models/router_replay.py) as pure functions: which experts each rank's
routers replay under context and sequence parallelism, and R2's record put back together from the context-parallel
ranks' shares. (The passes themselves, against transformers: tests/distributed/test_router_replay.py.)"""
import torch

from rl_megatron.batch import UNROUTED, TrainBatch
from rl_megatron.models.router_replay import model_layout, rank_share, whole_row
from rl_megatron.sequences import context_chunks, micro_batch

LAYERS, TOP_K, CP = 2, 2, 2


def packed_micro_batch():
    """Three samples of 5, 7 and 3 tokens in one packed row, spans padded to multiples of 2 x CP; each position's
    routing distinct (expert ids encode sample and position), UNROUTED at each sample's last token."""
    lengths = [5, 7, 3]
    ids = torch.ones(3, 7, dtype=torch.long)
    routing = torch.full((3, 7, LAYERS, TOP_K), UNROUTED, dtype=torch.int16)
    for i, length in enumerate(lengths):
        for position in range(length - 1):
            routing[i, position] = torch.tensor([[100 * i + position, 1000 + layer] for layer in range(LAYERS)])
    batch = TrainBatch(ids, torch.zeros(3, 7), pad_id=0, lengths=torch.tensor(lengths), routed_experts=routing)
    return micro_batch(batch, [0, 1, 2], packing=True, span_multiple=2 * CP), routing


def test_each_context_parallel_rank_replays_the_positions_it_computes():
    micro, routing = packed_micro_batch()
    cu = micro.cu_seqlens
    seen = []
    for rank in range(CP):
        shard = micro.context_shard(rank, CP)
        experts, routed = rank_share(shard, routing, TOP_K, shares=1, share=0)
        assert experts.shape == (len(shard.context_index), LAYERS, TOP_K)
        for token, index in enumerate(shard.context_index.tolist()):
            sample = next(i for i in range(len(cu) - 1) if cu[i] <= index < cu[i + 1])
            position = index - cu[sample]
            known = sample < 3 and position < micro.lengths[sample] - 1
            assert bool(routed[token]) == known
            if known:
                assert torch.equal(experts[token], routing[sample, position].long())
            else:  # padding and last tokens replay experts 0..k-1
                assert experts[token].tolist() == [list(range(TOP_K))] * LAYERS
            seen.append(index)
        # Sequence parallelism then cuts this rank's tokens into contiguous shares.
        halves = [rank_share(shard, routing, TOP_K, shares=2, share=share)[0] for share in range(2)]
        assert torch.equal(torch.cat(halves), experts)
    assert sorted(seen) == list(range(cu[-1]))  # the ranks together replay the whole row, each position once
    whole, _ = model_layout(micro, routing, TOP_K)
    assert torch.equal(whole_row([rank_share(micro.context_shard(rank, CP), routing, TOP_K, 1, 0)[0]
                                  for rank in range(CP)], cu), whole)


def test_r2s_record_is_put_back_together_from_the_context_parallel_shares():
    cu = [0, 8, 12, 20]
    row = torch.arange(20 * LAYERS * TOP_K, dtype=torch.int32).view(20, LAYERS, TOP_K)
    shares = [row[context_chunks(cu, rank, CP)] for rank in range(CP)]
    assert torch.equal(whole_row(shares, cu), row)
