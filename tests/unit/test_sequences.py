"""Rollouts packed into right-padded training tensors, labels aligned one position left."""
import torch

from rl_megatron.rollout.vllm_engine import Generation
from rl_megatron.trainer.sequences import pack_generations


def test_response_tokens_sit_at_their_label_positions():
    packed = pack_generations([Generation([1, 7, 14], [9, 2], [-0.5, -0.25]),
                               Generation([1, 5], [6], [-1.0])], pad_id=0)
    assert packed["input_ids"].tolist() == [[1, 7, 14, 9, 2], [1, 5, 6, 0, 0]]
    # Position t predicts token t + 1: the response of row 0 (tokens at 3, 4) is predicted at 2, 3.
    assert packed["response_mask"].tolist() == [[0, 0, 1, 1, 0], [0, 1, 0, 0, 0]]
    assert torch.equal(packed["rollout_log_probs"], torch.tensor([[0, 0, -0.5, -0.25, 0], [0, -1.0, 0, 0, 0]]))
