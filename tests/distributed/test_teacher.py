"""The teacher of on-policy distillation held to Hugging Face transformers, as the policy's passes are
(test_megatron_parity.py): a model of its own (another family, depth, width and head layout than the policy's, the
policy's tokenizer), built in the actor's processes as a colocated teacher is, at the actor's TP or PP; its
log-probs of the policy's sequences equal AutoModelForCausalLM's on the same folder (fp32, 1e-4), and the policy's
beside it stay transformers' too."""
import pytest
import torch

from helpers.parity import config, family_model_dir, hf_model, hf_reference, make_batch
from helpers.ranks import policy_and_teacher_log_probs
from helpers.worlds import run_distributed

# A Llama of 4 wider layers with grouped-query attention and tied embeddings, beside the 2- or 3-layer Qwen2 policy.
TOP_K = 5  # of the demo vocabulary's 18 tokens
TEACHER = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)


# PP=2 with the policy's first stage holding 1 of its 3 layers (actor.num_layers_in_first_pipeline_stage): the
# teacher, whose layers are other, splits its own 4 evenly.
@pytest.mark.parametrize("tp,pp,policy_layers,first_stage", [(2, 1, 2, None), (1, 2, 3, 1)])
def test_teacher_log_probs_match_transformers(tmp_path, tp, pp, policy_layers, first_stage):
    policy_dir = family_model_dir(tmp_path / "policy", "qwen2", tied=False, layers=policy_layers)
    teacher_dir = family_model_dir(tmp_path / "teacher", "llama", tied=True, layers=4, **TEACHER)
    stages = {"actor.num_layers_in_first_pipeline_stage": first_stage} if first_stage else {}
    cfg = config(policy_dir, tp, pp, **{"teacher.model.path": teacher_dir,
                                        "algorithm.distillation.top_k": TOP_K}, **stages)
    batch = make_batch(18)
    probe_ids = torch.randint(0, 18, (*batch.input_ids.shape, TOP_K), generator=torch.Generator().manual_seed(2))
    results = run_distributed(policy_and_teacher_log_probs, tp * pp, tp, pp, args=(cfg, batch, probe_ids))
    policy, teacher, probed = results[-1] if pp > 1 else results[0]  # the last pipeline stage holds the outputs
    mask = batch.response_mask.bool()
    teacher_reference, _, _ = hf_reference(teacher_dir, batch, cfg.rollout.temperature)
    policy_reference, _, _ = hf_reference(policy_dir, batch, cfg.rollout.temperature)
    assert (teacher.log_probs[mask] - teacher_reference[mask]).abs().max() <= 1e-4
    assert (policy.log_probs[mask] - policy_reference[mask]).abs().max() <= 1e-4
    # Two different models: the comparison could not pass by the teacher being the policy.
    assert (teacher_reference[mask] - policy_reference[mask]).abs().max() > 0.1
    # The teacher's top-k (algorithm.distillation.top_k): transformers' k best log-probs, and its log-probs of the ids
    # given; the policy's of any k ids per position (what its update distils through).
    teacher_all = all_log_probs(teacher_dir, batch.input_ids, cfg.rollout.temperature)
    assert (teacher.top_log_probs[mask] - teacher_all.topk(TOP_K, dim=-1).values[mask]).abs().max() <= 1e-4
    at_ids = teacher_all.gather(-1, teacher.top_ids.long())
    assert (teacher.top_log_probs[mask] - at_ids[mask]).abs().max() <= 1e-4
    policy_all = all_log_probs(policy_dir, batch.input_ids, cfg.rollout.temperature)
    assert (probed.top_log_probs[mask] - policy_all.gather(-1, probe_ids)[mask]).abs().max() <= 1e-4


def all_log_probs(model_dir, input_ids, temperature):
    """transformers' log-probs of every token of the vocabulary at each position, [B, S, V]."""
    with torch.no_grad():
        return torch.log_softmax(hf_model(model_dir)(input_ids).logits / temperature, -1)
