"""The worker group's batch splitting and collection."""
import pytest
import torch

from rl_megatron.workers.worker_group import concat_batches, split_batch


def test_split_and_concat_tensor_batches_round_trip():
    batch = {"input_ids": torch.arange(12).reshape(6, 2), "mask": torch.ones(6)}
    parts = split_batch(batch, 3)
    assert [p["input_ids"][:, 0].tolist() for p in parts] == [[0, 2], [4, 6], [8, 10]]
    merged = concat_batches(parts)
    assert all(torch.equal(merged[k], batch[k]) for k in batch)


def test_split_lists_contiguously():
    assert split_batch(list(range(6)), 2) == [[0, 1, 2], [3, 4, 5]]
    assert concat_batches([[0, 1], [2]]) == [0, 1, 2]


def test_uneven_split_is_an_error():
    with pytest.raises(ValueError, match="5 samples"):
        split_batch({"x": torch.zeros(5)}, 2)
    with pytest.raises(ValueError, match="3 items"):
        split_batch([1, 2, 3], 2)


def test_non_batch_results_come_back_as_a_list():
    assert concat_batches([{"loss": 1.0}, {"loss": 2.0}]) == [{"loss": 1.0}, {"loss": 2.0}]
