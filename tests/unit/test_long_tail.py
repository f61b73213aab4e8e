"""The long-tailed workload of `bench async --workload long_tail` (rl_megatron/bench/long_tail.py): lengths drawn
log-normally around rollout.max_tokens / 12, a few ten times that, the same draws in every run; its single-turn loop
is built for a model without a chat template, as the demo's."""
import statistics
import zlib

from helpers.runs import REPO

from rl_megatron.agents import build_agent_loop
from rl_megatron.batch import Prompt
from rl_megatron.bench.long_tail import LongTailLoop, response_length
from rl_megatron.config.schema import RolloutConfig
from rl_megatron.models.tokenizer import load_tokenizer


def test_lengths_are_log_normal_around_a_twelfth_of_the_limit_with_a_tail_ten_times_that():
    lengths = [response_length(key, draw, 120) for key in range(20) for draw in range(100)]
    assert all(1 <= n <= 120 for n in lengths)
    assert 9 <= statistics.median(lengths) <= 11
    assert 0.005 < sum(n >= 100 for n in lengths) / len(lengths) < 0.03  # ~1 in 100 at 10x the median
    assert lengths == [response_length(key, draw, 120) for key in range(20) for draw in range(100)]


def test_the_loop_draws_per_prompt_and_needs_no_chat_template():
    rollout = RolloutConfig(agent_loop="rl_megatron.bench.long_tail:LongTailLoop", max_tokens=120)
    tokenizer = load_tokenizer(f"{REPO}/configs/models/tiny-qwen2-digits")
    assert not getattr(tokenizer, "chat_template", None)
    loop = build_agent_loop(rollout, tokenizer, [tokenizer.eos_token_id])
    assert isinstance(loop, LongTailLoop)
    first, second = Prompt([5, 6, 7], "arithmetic", "3"), Prompt([5, 6, 8], "arithmetic", "4")
    drawn = [loop.response_limit(first), loop.response_limit(second), loop.response_limit(first)]
    # Each prompt's own sequence of draws: its first and second answers', whatever came between.
    key = zlib.crc32(str(first.ids).encode())
    assert (drawn[0], drawn[2]) == (response_length(key, 0, 120), response_length(key, 1, 120))
    again = LongTailLoop(loop.context)
    assert [again.response_limit(first), again.response_limit(second), again.response_limit(first)] == drawn
