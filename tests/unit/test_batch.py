"""The typed data of a step: samples packed into right-padded tensors (labels aligned one position left), and the
batch operations the worker groups' dispatch and the Megatron workers use."""
import numpy as np
import pytest
import torch

from rl_megatron.batch import UNROUTED, Prompt, Sample, SampleStatus, TokenOutputs, TrainBatch, known_routing_then
from rl_megatron.rollout.completions import Completion
from rl_megatron.workers.worker_group import concat_batches, split_batch

PROMPT = Prompt([1, 7, 14], "arithmetic", "3")


def two_samples() -> list[Sample]:
    return [Sample.answering(PROMPT, [9, 2], [-0.5, -0.25]),
            Sample([1, 5], [6], [-1.0], "arithmetic", "2", status=SampleStatus.TRUNCATED)]


def test_response_tokens_sit_at_their_label_positions():
    batch = TrainBatch.from_samples(two_samples(), pad_id=0)
    assert batch.input_ids.tolist() == [[1, 7, 14, 9, 2], [1, 5, 6, 0, 0]]
    # Position t predicts token t + 1: the response of row 0 (tokens at 3, 4) is predicted at 2, 3.
    assert batch.response_mask.tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert torch.equal(batch.rollout_log_probs, torch.tensor([[0, 0, -0.5, -0.25, 0], [0, -1.0, 0, 0, 0]]))
    assert batch.labels().tolist() == [[7, 14, 9, 2, 0], [5, 6, 0, 0, 0]]


def test_a_loss_mask_keeps_tokens_out_of_the_loss_at_their_label_positions():
    # A tool's output (tokens 30, 31) inside a multi-turn response: in the sequence, not in the loss.
    sample = Sample.answering(PROMPT, [9, 30, 31, 2], [-0.5, 0.0, 0.0, -0.1], loss_mask=[1, 0, 0, 1])
    batch = TrainBatch.from_samples([sample], pad_id=0)
    assert batch.input_ids.tolist() == [[1, 7, 14, 9, 30, 31, 2]]
    assert batch.response_mask.tolist() == [[0, 0, 1, 0, 0, 1, 0]]


def test_a_sample_answers_its_prompt_and_checks_its_lengths():
    sample = two_samples()[0]
    assert (sample.prompt_ids, sample.data_source, sample.ground_truth) == ([1, 7, 14], "arithmetic", "3")
    assert sample.loss_mask == [1, 1] and sample.status is SampleStatus.OK and sample.reward is None
    with pytest.raises(ValueError, match="2 tokens but 1 log-probs"):
        Sample.answering(PROMPT, [9, 2], [-0.5])
    with pytest.raises(ValueError, match="loss mask of 3"):
        Sample.answering(PROMPT, [9, 2], [-0.5, -0.1], loss_mask=[1, 1, 0])


def test_select_keeps_the_sequences_and_the_named_fields():
    batch = TrainBatch.from_samples(two_samples(), pad_id=3)
    batch.advantages = torch.ones(2, 5)
    sent = batch.select("advantages")
    assert sent.pad_id == 3 and sent.rollout_log_probs is None and sent.advantages is batch.advantages
    assert set(sent.tensors()) == {"input_ids", "response_mask", "lengths", "advantages"}
    assert sent.lengths.tolist() == batch.sequence_lengths() == [5, 3]


def test_split_and_concat_round_trip_and_keep_the_pad_id():
    batch = TrainBatch(torch.arange(12).reshape(6, 2), torch.ones(6, 2), pad_id=7, values=torch.rand(6, 2))
    parts = split_batch(batch, 3)
    assert [p.input_ids[:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]
    assert all(p.pad_id == 7 and p.returns is None for p in parts)
    merged = concat_batches(parts)
    assert isinstance(merged, TrainBatch) and merged.tensors().keys() == batch.tensors().keys()
    assert all(torch.equal(merged.tensors()[k], v) for k, v in batch.tensors().items())
    outputs = concat_batches([TokenOutputs(log_probs=torch.zeros(2, 3)), TokenOutputs(log_probs=torch.ones(1, 3))])
    assert outputs.log_probs.tolist() == [[0] * 3] * 2 + [[1] * 3] and outputs.entropy is None


def test_chunks_cut_micro_batches_and_the_last_may_be_shorter():
    batch = TrainBatch(torch.arange(5).unsqueeze(1), torch.ones(5, 1), pad_id=0)
    assert [c.input_ids.flatten().tolist() for c in batch.chunks(2)] == [[0, 1], [2, 3], [4]]


def test_padding_to_a_multiple_pads_tokens_with_the_pad_id_and_the_rest_with_zeros():
    batch = TrainBatch.from_samples(two_samples(), pad_id=9).padded_to_multiple(4)
    assert batch.input_ids.tolist() == [[1, 7, 14, 9, 2, 9, 9, 9], [1, 5, 6, 9, 9, 9, 9, 9]]
    assert batch.response_mask[:, 5:].sum() == 0 and batch.rollout_log_probs[:, 5:].sum() == 0
    assert TokenOutputs(log_probs=torch.zeros(2, 8)).truncated(5).log_probs.shape == (2, 5)


def routing(rows: int, first: int = 0) -> np.ndarray:
    """[rows, 2 MoE layers, top-2] expert ids, row r's all first + r."""
    return np.full((rows, 2, 2), 0, dtype=np.int16) + np.arange(first, first + rows, dtype=np.int16)[:, None, None]


def test_the_engines_routing_is_laid_out_per_position_and_unrouted_where_unknown():
    """Row 0 (5 tokens) has its 4 fed positions' routing; row 1 none (e.g. a failed rollout): UNROUTED there, at
    each row's last token (never fed) and in the padding, also after padding to a multiple."""
    first, second = two_samples()
    first.routed_experts = routing(4)
    batch = TrainBatch.from_samples([first, second], pad_id=0).padded_to_multiple(4)
    assert batch.routed_experts.dtype == torch.int16 and batch.routed_experts.shape == (2, 8, 2, 2)
    assert batch.routed_experts[0, :4, 1, 1].tolist() == [0, 1, 2, 3]
    assert (batch.routed_experts[0, 4:] == UNROUTED).all() and (batch.routed_experts[1] == UNROUTED).all()
    assert TrainBatch.from_samples(two_samples(), pad_id=0).routed_experts is None  # no engine routing: none


def test_a_continued_response_keeps_each_positions_first_routing():
    """A partial rollout continued after a weight sync (or a trajectory's next turn): positions the first part fed
    keep their routing (the weights that sampled what follows them); the continuation adds the positions past them."""
    part = Completion([5, 6], [-0.1, -0.2], SampleStatus.ABORTED, [1, 1], routing(3))  # prompt of 2: 2 + 2 - 1 rows
    rest = Completion([7], [-0.3], SampleStatus.OK, [2], routing(4, first=10))  # prompt 2 + 2: 4 + 1 - 1 rows
    whole = part.followed_by(rest)
    assert whole.response_ids == [5, 6, 7] and whole.versions == [1, 1, 2]
    assert whole.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 13]
    assert known_routing_then(None, routing(2)) is not None and known_routing_then(routing(2), None).shape[0] == 2


def test_split_lists_contiguously():
    assert split_batch(list(range(6)), 2) == [[0, 1, 2], [3, 4, 5]]
    assert concat_batches([[0, 1], [2]]) == [0, 1, 2]


def test_uneven_split_is_an_error():
    with pytest.raises(ValueError, match="5 samples"):
        split_batch(TrainBatch(torch.zeros(5, 1), torch.zeros(5, 1), pad_id=0), 2)
    with pytest.raises(ValueError, match="3 items"):
        split_batch([1, 2, 3], 2)


def test_non_batch_results_come_back_as_a_list():
    assert concat_batches([{"loss": 1.0}, {"loss": 2.0}]) == [{"loss": 1.0}, {"loss": 2.0}]
