"""The reference policy (`Role.REF`, a frozen copy of the initial actor built beside it) scores a batch with the same
bits as the policy it copies, at every TP size and with or without sequence parallelism: before any update the KL
between them is exactly 0. Without sequence parallelism a packed row's hidden states were a transposed tensor
(strides (h, s * h, 1)), which `torch.matmul` folds into one GEMM for a weight that requires grad and not for a
frozen one, so the two rounded apart by one ULP (`platform.megatron_fixes.embeddings_in_standard_strides`)."""
import pytest

from helpers.parity import config, family_model_dir, make_batch
from helpers.ranks import policy_and_reference_log_probs
from helpers.worlds import run_distributed


@pytest.mark.parametrize("tp,sequence_parallel", [(1, False), (2, False), (2, True)])
def test_the_reference_scores_as_the_policy_it_copies_bit_for_bit(tmp_path, tp, sequence_parallel):
    model_dir = family_model_dir(tmp_path / "policy", "qwen2", tied=False, layers=2)
    cfg = config(model_dir, tp, 1, **{"actor.sequence_parallel": sequence_parallel})
    batch = make_batch(18)
    policy, reference = run_distributed(policy_and_reference_log_probs, tp, tp, 1, args=(cfg, batch))[0]
    mask = batch.response_mask.bool()
    assert mask.any() and (policy.log_probs[mask] != 0).all()
    assert (policy.log_probs[mask] == reference.log_probs[mask]).all(), \
        (policy.log_probs - reference.log_probs).abs().max()
