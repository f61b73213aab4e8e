import os

import pytest
from helpers.runs import REPO
from transformers import AutoTokenizer

from rl_megatron.batch import Prompt
from rl_megatron.data.arithmetic import arithmetic_rows
from rl_megatron.data.loader import PromptLoader

TINY_MODEL_DIR = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
NUM_ROWS = 55  # sum over a = 0..9 of the (10 - a) choices of b with a + b <= 9


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL_DIR)


def make_loader(tokenizer, rows=None, batch_size=8, max_prompt_length=8, seed=0):
    rows = arithmetic_rows() if rows is None else rows
    return PromptLoader(rows, tokenizer, batch_size, max_prompt_length, seed)


def take_prompts(loader, num_batches):
    return [tuple(ids) for _ in range(num_batches) for ids in (p.ids for p in loader.next_batch())]


def test_arithmetic_rows_are_every_single_digit_sum():
    rows = arithmetic_rows()
    assert len(rows) == NUM_ROWS
    assert len({row["prompt"] for row in rows}) == NUM_ROWS
    assert {"prompt": "3+4=", "ground_truth": "7", "data_source": "arithmetic"} in rows
    for row in rows:
        a, b = int(row["prompt"][0]), int(row["prompt"][2])
        assert row["prompt"] == f"{a}+{b}=" and row["ground_truth"] == str(a + b) and a + b <= 9


def test_batches_hold_tokenized_prompts_with_their_answers(tokenizer):
    loader = make_loader(tokenizer, batch_size=NUM_ROWS)
    batch = loader.next_batch()
    assert all(isinstance(prompt, Prompt) for prompt in batch)
    assert len(loader.rows) == NUM_ROWS and loader.dropped == 0
    for ids, answer, source in ((p.ids, p.ground_truth, p.data_source) for p in batch):
        # [<bos>, a, '+', b, '='] with digit d at id d + 4
        assert ids[0] == 1 and ids[2] == 14 and ids[4] == 16
        assert answer == str((ids[1] - 4) + (ids[3] - 4))
        assert source == "arithmetic"
    assert [p.extra_info for p in batch] == [{}] * NUM_ROWS  # built-in rows have none; parquet rows carry theirs


def test_long_prompts_are_dropped_and_counted(tokenizer):
    rows = arithmetic_rows() + [{"prompt": "12+34=", "ground_truth": "46", "data_source": "arithmetic"}]
    loader = make_loader(tokenizer, rows, max_prompt_length=5)  # "12+34=" is 7 tokens with <bos>
    assert loader.dropped == 1
    assert len(loader.rows) == NUM_ROWS


@pytest.mark.parametrize("rows", [[], arithmetic_rows()])
def test_no_usable_prompt_is_an_error(tokenizer, rows):
    with pytest.raises(ValueError, match="the dataset has no prompts.*max_prompt_length=4"):
        make_loader(tokenizer, rows, max_prompt_length=4)  # every "a+b=" is 5 tokens


def test_batch_size_must_be_positive(tokenizer):
    with pytest.raises(ValueError, match="batch_size"):
        make_loader(tokenizer, batch_size=0)


def test_every_epoch_visits_each_prompt_once_across_batch_boundaries(tokenizer):
    loader = make_loader(tokenizer, batch_size=20)
    prompts = take_prompts(loader, 11)  # 220 prompts = exactly 4 epochs, each split mid-batch
    assert all(len(prompts[i : i + 20]) == 20 for i in range(0, 220, 20))
    epochs = [prompts[i : i + NUM_ROWS] for i in range(0, 220, NUM_ROWS)]
    for epoch in epochs:
        assert len(set(epoch)) == NUM_ROWS
    assert epochs[0] != epochs[1]  # reshuffled
    assert loader.state_dict() == {"epoch": 4, "offset": 0, "num_rows": NUM_ROWS, "seed": 0, "fingerprint": ""}


def test_order_is_deterministic_per_seed_and_epoch(tokenizer):
    assert take_prompts(make_loader(tokenizer), 5) == take_prompts(make_loader(tokenizer), 5)
    assert take_prompts(make_loader(tokenizer, seed=1), 5) != take_prompts(make_loader(tokenizer), 5)
    # Epoch e is shuffled with seed + e, so seed 0's second epoch is seed 1's first.
    seed_zero = take_prompts(make_loader(tokenizer, batch_size=NUM_ROWS), 2)
    seed_one = take_prompts(make_loader(tokenizer, batch_size=NUM_ROWS, seed=1), 1)
    assert seed_zero[NUM_ROWS:] == seed_one


def test_resume_from_state_dict_continues_exactly(tokenizer):
    loader = make_loader(tokenizer, batch_size=16)
    take_prompts(loader, 3)
    state = loader.state_dict()
    assert state == {"epoch": 0, "offset": 48, "num_rows": NUM_ROWS, "seed": 0, "fingerprint": ""}
    expected = take_prompts(loader, 4)

    resumed = make_loader(tokenizer, batch_size=16)
    resumed.load_state_dict(state)
    assert take_prompts(resumed, 4) == expected


@pytest.mark.parametrize("saved, message", [
    ({"num_rows": 54}, "54 rows"),
    ({"fingerprint": "sha256:0123"}, "'sha256:0123'.*same data files"),
    ({"seed": 7}, "seed 7.*seed is 0"),
])
def test_resume_onto_different_data_is_an_error(tokenizer, saved, message):
    loader = make_loader(tokenizer)
    state = {**loader.state_dict(), "epoch": 1, "offset": 3, **saved}
    with pytest.raises(ValueError, match=message):
        loader.load_state_dict(state)
    assert (loader.epoch, loader.offset) == (0, 0)  # nothing half-loaded


def test_unshuffled_loader_serves_rows_in_order_and_batch_size_none_serves_all(tokenizer):
    loader = PromptLoader(arithmetic_rows(), tokenizer, None, 8, 0, shuffle=False)
    first, second = loader.next_batch(), loader.next_batch()
    assert first == second and len(first) == NUM_ROWS
    assert [p.ground_truth for p in first] == [row["ground_truth"] for row in arithmetic_rows()]
