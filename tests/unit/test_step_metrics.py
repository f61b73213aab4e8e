"""What a step reports of its samples: response and prompt lengths, and how many responses hit the token limit."""
import pytest

from rl_megatron.batch import Sample, SampleStatus
from rl_megatron.trainer.metrics import length_metrics


def sample(prompt: int, response: int, status: SampleStatus = SampleStatus.OK) -> Sample:
    return Sample(list(range(prompt)), list(range(response)), [0.0] * response, "arithmetic", "7", status=status)


def test_lengths_and_the_share_of_responses_cut_off_at_the_limit():
    # rollout.max_tokens = 4: two responses ran into it; a third is 4 tokens long too but ended with its stop token
    # (vLLM's finish reason "stop"), and an aborted one is not cut off by the limit.
    samples = [sample(3, 4, SampleStatus.TRUNCATED), sample(3, 4, SampleStatus.TRUNCATED), sample(5, 4),
               sample(5, 1), sample(6, 2, SampleStatus.ABORTED)]
    assert length_metrics(samples) == pytest.approx({
        "response_length/mean": 15 / 5, "response_length/max": 4, "response_length/min": 1,
        "response_length/clip_ratio": 2 / 5,
        "prompt_length/mean": 22 / 5, "prompt_length/max": 6, "prompt_length/min": 3})
