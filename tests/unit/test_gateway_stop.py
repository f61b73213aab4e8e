"""The gateway's stop strings (vLLM's rule): a response is cut after the token that completes the first stop
string; the tokens kept are exactly as sampled, with their log-probs, versions and routing."""
import numpy as np

from rl_megatron.agents.gateway.episode import _stopped
from rl_megatron.batch import SampleStatus
from rl_megatron.rollout.completions import Completion

PIECES = {1: "Hel", 2: "lo\nW", 3: "orld", 4: "!"}


def pieces(ids):
    return [PIECES[i] for i in ids]


def completion(status=SampleStatus.TRUNCATED):
    routing = np.arange(2 + 4 - 1, dtype=np.int16).reshape(-1, 1, 1)  # a 2-token prompt + 4 tokens, less one
    return Completion([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], status, [0, 0, 1, 1], routing)


def test_a_response_is_cut_after_the_token_that_completes_the_stop_string():
    cut, stopped = _stopped(completion(), ["\nWor"], pieces)
    assert stopped and cut.response_ids == [1, 2, 3] and cut.log_probs == [-0.1, -0.2, -0.3]
    assert cut.versions == [0, 0, 1] and cut.status == SampleStatus.OK
    assert cut.routed_experts[:, 0, 0].tolist() == [0, 1, 2, 3]


def test_without_stop_strings_or_a_match_the_response_is_kept_whole():
    whole = completion()
    assert _stopped(whole, [], pieces) == (whole, False)
    assert _stopped(whole, ["xyz"], pieces) == (whole, False)


def test_a_stop_string_completed_by_the_last_token_stops_a_response_that_ran_into_its_limit():
    whole = completion()
    assert _stopped(whole, ["d!"], pieces) == (whole, True)
    ended = completion(SampleStatus.OK)
    assert _stopped(ended, ["d!"], pieces) == (ended, False)
