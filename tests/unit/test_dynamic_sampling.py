"""DAPO's dynamic sampling (`rl_megatron.trainer.dynamic_sampling`): which groups are kept, how rounds add up, and the
cap's edge cases (nothing kept, a batch that must stay whole mini-batches, stop), with the real prompt loader for the
data position a resumed run starts from."""
import os

import pytest
import torch

from rl_megatron.batch import Sample
from rl_megatron.preflight import load_config
from rl_megatron.data.build import build_prompt_loader
from rl_megatron.errors import ConfigError
from rl_megatron.models.tokenizer import load_tokenizer
from rl_megatron.trainer.dynamic_sampling import GroupFilter, varied_groups
from rl_megatron.trainer.rewards import Rewards
from tests.helpers.runs import REPO

N = 2  # samples per prompt


def load_demo(*overrides):
    return load_config(os.path.join(REPO, "configs", "demo_cpu.yaml"),
                       [f"model.path={os.path.join(REPO, 'configs', 'models', 'tiny-qwen2-digits')}", *overrides])


def test_a_group_varies_when_any_two_of_its_values_differ():
    assert varied_groups(torch.tensor([1.0, 1.0, 0.0, 1.0, 0.0, 0.0, -1.0, 1.0]), N) == [False, True, False, True]
    assert varied_groups(torch.tensor([3.0, 3.0, 3.0]), 1) == [False, False, False]  # a lone sample never varies


class Rounds:
    """Generation rounds whose groups score as given: `scores[round - 1]` holds one pair per prompt."""

    def __init__(self, scores: list[list[tuple[float, float]]], acc: list[list[tuple[float, float]]] | None = None):
        self.scores, self.acc, self.asked = scores, acc or scores, []

    def generate(self, round_: int) -> list[Sample]:
        self.asked.append(round_)
        groups = len(self.scores[round_ - 1])
        # A sample's prompt id names its round and group, so the test can see which ones were kept.
        return [Sample([round_, group], [7, 7, 7], [0.0] * 3, "t", None) for group in range(groups) for _ in range(N)]

    def score(self, samples: list[Sample], round_: int) -> Rewards:
        assert round_ == samples[0].prompt_ids[0]  # each round scored with its number, as it is generated
        flat = lambda pairs: torch.tensor([float(v) for pair in pairs for v in pair])  # noqa: E731
        return Rewards(flat(self.scores[round_ - 1]), flat(self.acc[round_ - 1]), None, {"reward/errors": 1})


def group_filter(train=2, mini=1, metric="acc", max_rounds=3, on_cap="train") -> GroupFilter:
    return GroupFilter(N, train, mini, metric, max_rounds, on_cap)


def kept_prompts(samples: list[Sample]) -> list[tuple[int, int]]:
    return [tuple(s.prompt_ids) for s in samples[::N]]


def test_rounds_go_on_until_the_batch_is_full_and_the_surplus_is_dropped():
    rounds = Rounds([[(1, 1), (0, 1), (0, 0)], [(1, 0), (0, 0), (1, 0)]])
    filled = group_filter(train=2).fill(rounds.generate, rounds.score)
    assert rounds.asked == [1, 2]
    # Round 1 keeps group 1; round 2 keeps groups 0 and 2, of which group 2 is one more than the batch needs.
    assert kept_prompts(filled.samples) == [(1, 1), (2, 0)]
    assert filled.rewards.scores.tolist() == [0, 1, 1, 0]
    # Over all 12 samples generated: 3 + 2 right.
    assert filled.metrics == {"filter/gen_batches": 2, "filter/prompts_used": 6, "filter/kept_groups": 2,
                              "filter/generated_reward/mean": pytest.approx(5 / 12),
                              "filter/generated_acc/mean": pytest.approx(5 / 12),
                              "filter/reached_cap": 0.0, "filter/padded_groups": 0}
    assert filled.rewards.stats == {"reward/errors": 2}  # both rounds' failures count
    assert all(s.loss_mask == [1, 1, 1] for s in filled.samples)


def test_the_metric_decides_what_varies_acc_by_default():
    # Shaped scores differ (a length penalty) where the accuracy does not: filtering on them keeps a group of two
    # right answers, which has no signal (verl-recipe#125).
    scores, acc = [[(1.0, 0.8), (1.0, 0.0)]], [[(1.0, 1.0), (1.0, 0.0)]]
    on_acc = Rounds(scores, acc)
    assert kept_prompts(group_filter(train=1, max_rounds=1).fill(on_acc.generate, on_acc.score).samples) == [(1, 1)]
    on_score = Rounds(scores, acc)
    filled = group_filter(train=1, metric="score", max_rounds=1).fill(on_score.generate, on_score.score)
    assert kept_prompts(filled.samples) == [(1, 0)]


def test_when_every_group_is_filtered_one_mini_batch_of_dropped_groups_trains_on_nothing():
    rounds = Rounds([[(1, 1), (0, 0), (1, 1)]] * 2)
    filled = group_filter(train=4, mini=2, max_rounds=2).fill(rounds.generate, rounds.score)
    assert rounds.asked == [1, 2]
    assert kept_prompts(filled.samples) == [(1, 0), (1, 1)]  # padding: the first dropped groups
    assert all(s.loss_mask == [0, 0, 0] for s in filled.samples)  # kept out of the loss
    assert filled.metrics["filter/kept_groups"] == 0 and filled.metrics["filter/padded_groups"] == 2
    assert filled.metrics["filter/reached_cap"] == 1.0


def test_at_the_cap_the_kept_groups_are_padded_to_whole_mini_batches():
    # 3 groups vary in 2 rounds where the batch wants 8 in mini-batches of 2: 4 groups go to the update, the fourth a
    # dropped one, so that the batch splits into the mini-batches (and data-parallel shares) the pre-flight planned.
    rounds = Rounds([[(0, 1), (1, 1), (0, 1), (0, 0)], [(0, 0), (1, 0), (1, 1), (0, 0)]])
    filled = group_filter(train=8, mini=2, max_rounds=2).fill(rounds.generate, rounds.score)
    assert kept_prompts(filled.samples) == [(1, 0), (1, 2), (2, 1), (1, 1)]
    assert [s.loss_mask for s in filled.samples[::N]] == [[1] * 3] * 3 + [[0] * 3]
    assert len(filled.samples) % (2 * N) == 0
    assert filled.metrics["filter/kept_groups"] == 3 and filled.metrics["filter/padded_groups"] == 1


def test_at_the_cap_on_cap_stop_ends_the_run_saying_what_to_change():
    rounds = Rounds([[(1, 1)]] * 2)
    with pytest.raises(ConfigError, match=r"found 0 of the 2 prompt groups .*max_num_gen_batches=2 rounds \(2 "
                                          r"prompts\).*on_cap=train"):
        group_filter(max_rounds=2, on_cap="stop").fill(rounds.generate, rounds.score)


def test_without_a_cap_rounds_go_on_until_the_batch_is_full():
    rounds = Rounds([[(1, 1)]] * 11 + [[(0, 1)]])
    filled = group_filter(train=1, max_rounds=0).fill(rounds.generate, rounds.score)
    assert rounds.asked == list(range(1, 13)) and kept_prompts(filled.samples) == [(12, 0)]


def test_a_resumed_run_draws_the_prompts_after_every_round_the_saved_step_used():
    cfg = load_demo("algorithm.filter_groups.enable=true", "data.gen_batch_size=40")
    tokenizer = load_tokenizer(cfg.model.path)
    loader = build_prompt_loader(cfg.data, tokenizer, cfg.trainer.seed)
    rounds = []

    def generate(round_):
        rounds.append(round_)
        return [Sample(p.ids, [7], [0.0], p.data_source, p.ground_truth) for p in loader.next_batch()
                for _ in range(N)]

    def score(samples, round_):  # only the third round's prompts vary
        values = torch.tensor([float(i % 2 and len(rounds) == 3) for i in range(len(samples))])
        return Rewards(values, values, None, {})

    filled = group_filter(train=2, max_rounds=0).fill(generate, score)
    assert filled.metrics["filter/gen_batches"] == 3 and filled.metrics["filter/prompts_used"] == 120
    # What a checkpoint saves after the step is the position after all 120 prompts, not after the 2 trained on.
    after_three_rounds = build_prompt_loader(cfg.data, tokenizer, cfg.trainer.seed)
    for _ in range(3):
        after_three_rounds.next_batch()
    assert loader.state_dict() == after_three_rounds.state_dict()
    resumed = build_prompt_loader(cfg.data, tokenizer, cfg.trainer.seed)
    resumed.load_state_dict(loader.state_dict())
    assert [p.ids for p in resumed.next_batch()] == [p.ids for p in loader.next_batch()]


def test_the_filter_follows_the_config():
    assert GroupFilter.of(load_demo()) is None
    cfg = load_demo("algorithm.filter_groups.enable=true", "algorithm.filter_groups.metric=score",
                    "algorithm.filter_groups.max_num_gen_batches=4", "algorithm.filter_groups.on_cap=stop",
                    "data.gen_batch_size=96")
    assert GroupFilter.of(cfg) == GroupFilter(8, 32, 16, "score", 4, "stop")
    assert cfg.data.gen_batch_size == 96 and load_demo().data.gen_batch_size == 32
