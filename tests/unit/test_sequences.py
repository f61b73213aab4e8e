"""Micro-batch plans (sample counts, token budgets, equal counts on every rank, DP balance) and the packed and
padded layouts of a micro-batch, against hand-worked cases."""
import pytest
import torch

from rl_megatron.batch import TokenOutputs, TrainBatch
from rl_megatron.sequences import (balanced_order, fixed_bins, micro_batch, scatter_rows, split_to_count,
                                   token_budget_bins)


def test_fixed_bins_are_consecutive_runs():
    assert fixed_bins(5, 2) == [[0, 1], [2, 3], [4]]


def test_token_budget_bins_first_fit_decreasing():
    lengths = [7, 3, 9, 2, 5, 4]
    # Longest first: 9 -> A; 7 -> B; 5 -> C; 4 -> C (9); 3 -> B (10); 2 fits nowhere (11, 12, 11) -> D.
    assert token_budget_bins(lengths, 10) == [[0, 1], [2], [3], [4, 5]]
    # A sample over the budget runs alone; nothing is lost.
    assert token_budget_bins([30, 2, 2], 10) == [[0], [1, 2]]


def test_split_to_count_halves_the_heaviest_bin_and_keeps_the_budget():
    lengths = [4, 4, 4, 4, 9]
    bins = token_budget_bins(lengths, 16)  # 9 -> A; 4 -> A (13); 4, 4, 4 -> B (12)
    assert bins == [[0, 4], [1, 2, 3]]
    assert split_to_count(bins, lengths, 3) == [[0], [1, 2, 3], [4]]  # A (13 tokens) is the heaviest
    assert split_to_count(bins, lengths, 4) == [[0], [1, 3], [2], [4]]
    assert sorted(i for b in split_to_count(bins, lengths, 5) for i in b) == list(range(5))
    with pytest.raises(ValueError):
        split_to_count(bins, lengths, 6)


def test_balanced_order_evens_tokens_per_rank_within_each_optimizer_step():
    lengths = [100, 90, 10, 5, 80, 70, 20, 15]  # 2 ranks x 2 mini-batches of 2 samples each
    order = balanced_order(lengths, parts=2, group_size=2)
    assert sorted(order) == list(range(8))
    # Step 0 takes rows 0,1 (rank 0) and 4,5 (rank 1) before and after: the same samples, balanced tokens.
    rank0, rank1 = order[:4], order[4:]
    assert {*rank0[:2], *rank1[:2]} == {0, 1, 4, 5} and {*rank0[2:], *rank1[2:]} == {2, 3, 6, 7}
    load = lambda rows: sum(lengths[i] for i in rows)  # noqa: E731
    assert abs(load(rank0) - load(rank1)) < abs(load([0, 1, 2, 3]) - load([4, 5, 6, 7]))
    assert balanced_order(lengths, parts=1, group_size=8) == list(range(8))


def two_rows() -> TrainBatch:
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 0, 0, 0], [0, 0, 1, 1, 0]], dtype=torch.float)
    return TrainBatch(ids, mask, pad_id=0, lengths=torch.tensor([3, 5]))


def test_packed_micro_batch_layout_and_unpacking():
    micro = micro_batch(two_rows(), [1, 0], packing=True, multiple=3)
    assert micro.input_ids.tolist() == [[8, 9, 10, 11, 12, 5, 6, 7, 0]]  # 8 tokens, padded to 9
    assert micro.position_ids.tolist() == [[0, 1, 2, 3, 4, 0, 1, 2, 0]]
    assert micro.cu_seqlens == [0, 5, 8, 9]  # the padding is a span of its own
    assert micro.labels.tolist() == [[9, 10, 11, 12, 5, 6, 7, 0, 0]]
    per_token = torch.arange(9.0).unsqueeze(0)
    assert micro.unpack(per_token).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]]
    assert micro.computed_tokens() == 9


@pytest.mark.parametrize("packing", [True, False])
def test_per_sample_tensors_with_trailing_dimensions_go_to_the_model_layout_and_back(packing):
    """A teacher's top-k ids ([samples, longest, k]) where the model computes each sample's positions, and back."""
    micro = micro_batch(two_rows(), [1, 0], packing=packing, multiple=3)
    per_sample = torch.arange(1, 5 * 2 * 2 + 1).view(2, 5, 2)
    laid = micro.model_layout(per_sample)
    assert laid.shape == (*micro.input_ids.shape, 2)
    inside = torch.arange(5).unsqueeze(0) < torch.tensor(micro.lengths).unsqueeze(1)
    assert torch.equal(micro.unpack(laid), per_sample * inside.unsqueeze(-1))
    if packing:  # sample 1 (5 tokens) then sample 0 (3), then the padding
        assert laid[0, 5].tolist() == per_sample[1, 0].tolist() and laid[0, 8].tolist() == [0, 0]


def test_outputs_with_trailing_dimensions_come_to_the_host_beside_the_flat_ones():
    from rl_megatron.sequences.micro_batches import outputs_to_host
    outputs = [TokenOutputs(log_probs=torch.ones(1, 2), top_ids=torch.ones(1, 2, 3, dtype=torch.int32)),
               TokenOutputs(log_probs=torch.ones(2, 4), top_ids=torch.full((2, 4, 3), 2, dtype=torch.int32))]
    first, second = outputs_to_host(outputs)
    assert first.log_probs.shape == (1, 2) and first.top_ids.shape == (1, 2, 3)
    assert torch.equal(second.top_ids, outputs[1].top_ids) and second.top_ids.dtype == torch.int32


def forked_rows() -> TrainBatch:
    """Row 0: one sample of 3 tokens; row 1: a forked agent episode, segments of 2 and 3 tokens (positions restart)."""
    ids = torch.tensor([[5, 6, 7, 0, 0], [8, 9, 10, 11, 12]])
    mask = torch.tensor([[0, 1, 0, 0, 0], [1, 0, 0, 1, 0]], dtype=torch.float)
    positions = torch.tensor([[0, 1, 2, 0, 0], [0, 1, 0, 1, 2]])
    return TrainBatch(ids, mask, pad_id=0, lengths=torch.tensor([3, 5]), position_ids=positions)


def test_a_forked_sample_packs_as_one_span_per_segment_and_unpacks_as_one_sample():
    micro = micro_batch(forked_rows(), [1, 0], packing=True, multiple=3)
    assert micro.input_ids.tolist() == [[8, 9, 10, 11, 12, 5, 6, 7, 0]]
    assert micro.cu_seqlens == [0, 2, 5, 8, 9]  # the fork's two segments, the other sample, the padding
    assert micro.sample_starts == [0, 5, 8]
    assert micro.position_ids.tolist() == [[0, 1, 0, 1, 2, 0, 1, 2, 0]]
    assert micro.unpack(torch.arange(9.0).unsqueeze(0)).tolist() == [[0, 1, 2, 3, 4], [5, 6, 7, 0, 0]]
    reading = micro.reading_responses().read_positions[0].tolist()
    assert reading == [0, 3, 6]  # sample 1's masked positions (0 and 3), then sample 0's (1, at 5 + 1)
    padded = micro.padded_to(1, 12)
    assert padded.cu_seqlens == [0, 2, 5, 8, 12] and padded.sample_starts == [0, 5, 8]
    with pytest.raises(ValueError, match="actor.sequence_packing=true"):
        micro_batch(forked_rows(), [1], packing=False)
    with pytest.raises(ValueError, match="actor.context_parallel_size=1"):
        micro_batch(forked_rows(), [1], packing=True, span_multiple=4)


def test_padded_micro_batch_is_cut_to_its_longest_sample():
    batch = two_rows()
    micro = micro_batch(batch._with({"input_ids": torch.nn.functional.pad(batch.input_ids, (0, 3)),
                                     "response_mask": torch.nn.functional.pad(batch.response_mask, (0, 3))}),
                        [0], packing=False)
    assert micro.input_ids.tolist() == [[5, 6, 7]] and micro.cu_seqlens is None
    assert micro.unpack(torch.tensor([[1.0, 2.0, 3.0]])).tolist() == [[1, 2, 3]]


def test_one_shape_padding_keeps_the_samples():
    micro = micro_batch(two_rows(), [0, 1], packing=True).padded_to(1, 10)
    assert micro.cu_seqlens == [0, 3, 8, 10] and micro.position_ids.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4, 0, 1]]
    rows = micro_batch(two_rows(), [0], packing=False).padded_to(2, 4)
    assert rows.input_ids.tolist() == [[5, 6, 7, 0], [0, 0, 0, 0]]
    assert rows.unpack(torch.ones(2, 4)).tolist() == [[1, 1, 1]]


def test_scatter_rows_restores_the_batch_order():
    a = TokenOutputs(log_probs=torch.tensor([[1.0, 2.0]]))
    b = TokenOutputs(log_probs=torch.tensor([[3.0, 4.0, 5.0], [6.0, 0.0, 0.0]]))
    out = scatter_rows([([1], a), ([2, 0], b)], count=3, length=4)
    assert out.log_probs.tolist() == [[6, 0, 0, 0], [1, 2, 0, 0], [3, 4, 5, 0]]


def test_context_parallel_shares_cut_each_span_into_balanced_chunks_and_gather_back():
    from rl_megatron.sequences import context_chunks

    cu_seqlens = [0, 8, 12]  # spans of 8 and 4 tokens, 2 CP ranks: chunks of 2 and of 1 token
    assert context_chunks(cu_seqlens, 0, 2).tolist() == [0, 1, 6, 7, 8, 11]
    assert context_chunks(cu_seqlens, 1, 2).tolist() == [2, 3, 4, 5, 9, 10]
    # What each rank computes, gathered in rank order and put back by the inverse permutation, is the row.
    row = torch.arange(12.0).unsqueeze(0) * 10
    order = torch.cat([context_chunks(cu_seqlens, rank, 2) for rank in range(2)])
    gathered = torch.cat([row[:, context_chunks(cu_seqlens, rank, 2)] for rank in range(2)], dim=1)
    assert torch.equal(gathered[:, torch.argsort(order)], row)
    with pytest.raises(ValueError, match="2 x 2 chunks"):
        context_chunks([0, 6], 0, 2)


def test_packed_spans_padded_for_context_parallelism_keep_each_sample_at_its_start():
    micro = micro_batch(two_rows(), [0, 1], packing=True, span_multiple=4)
    assert micro.input_ids.tolist() == [[5, 6, 7, 0, 8, 9, 10, 11, 12, 0, 0, 0]]
    assert micro.cu_seqlens == [0, 4, 12] and micro.position_ids.tolist() == [[0, 1, 2, 3, 0, 1, 2, 3, 4, 5, 6, 7]]
    assert micro.unpack(torch.arange(12.0).unsqueeze(0)).tolist() == [[0, 1, 2, 0, 0], [4, 5, 6, 7, 8]]
    shard = micro.context_shard(1, 2)
    ids, positions = shard.model_inputs()
    assert ids.tolist() == [[6, 7, 10, 11, 12, 0]] and positions.tolist() == [[1, 2, 2, 3, 4, 5]]
    assert shard.labels.tolist() == [[7, 0, 11, 12, 0, 0]]
