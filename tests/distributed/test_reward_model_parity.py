"""A reward model (reward_model.model.path) held to Hugging Face transformers: a sequence classifier of its own
(another family, depth and width than the policy's), built in the actor's processes at the actor's TP or PP as a
colocated reward model is; the score at each sequence's last token equals AutoModelForSequenceClassification's on the
same folder and rows (fp32, 1e-4)."""
import pytest
import torch

from helpers.parity import config, family_model_dir, make_batch
from helpers.ranks import reward_model_scores
from helpers.reward_models import hf_scores, reward_model_dir
from helpers.worlds import run_distributed

# A Llama of 3 wider layers with grouped-query attention beside the 2-layer Qwen2 policy.
REWARD_MODEL = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


# TP=2, and TP=1 at PP=2: the score head on the last stage only.
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_reward_model_scores_match_transformers(tmp_path, tp, pp):
    policy_dir = family_model_dir(tmp_path / "policy", "qwen2", tied=False, layers=2)
    rm_dir = reward_model_dir(tmp_path / "rm", "llama", layers=3 if pp == 1 else 4, **REWARD_MODEL)
    cfg = config(policy_dir, tp, pp, **{"reward_model.model.path": rm_dir})
    batch = make_batch(18)
    results = run_distributed(reward_model_scores, tp * pp, tp, pp, args=(cfg, batch))
    values = (results[-1] if pp > 1 else results[0]).values  # the last pipeline stage holds the outputs
    scores = values[torch.arange(batch.rows()), batch.lengths - 1]
    reference = hf_scores(rm_dir, batch)
    assert (scores - reference).abs().max() <= 1e-4, (scores, reference)
    assert reference.std() > 0.05  # scores that differ by row: a head read at the wrong position would show
