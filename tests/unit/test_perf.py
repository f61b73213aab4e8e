"""The actor's model FLOPs (verl's convention) and MFU, and the workers' memory figures, against values computed by
hand; the weight count against real transformers models."""
import pytest
from transformers import AutoModelForCausalLM

from rl_megatron.models.tiny import build_config
from rl_megatron.platform.device_stats import DeviceStats
from rl_megatron.trainer.perf import (actor_mfu_metrics, forward_flops, matmul_weights_per_token, memory_metrics,
                                      mfu)

# hidden 64, 2 layers, 4 query heads and 2 KV heads of 16, MLP 128, vocabulary 100.
DENSE = {"model_type": "qwen2", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "vocab_size": 100}
# QKV 64 x (64 + 32 + 32) = 8192, output 64 x 64 = 4096, MLP 3 x 64 x 128 = 24576: 36864 per layer, x 2 layers,
# + embedding and output layer 2 x 100 x 64 = 12800.
DENSE_WEIGHTS = 86528


def test_weights_per_token_of_a_dense_model():
    assert matmul_weights_per_token(DENSE) == DENSE_WEIGHTS


def test_weights_per_token_of_qwen2_5_7b_are_its_parameter_count():
    """verl's N counts the embedding, so for a real model it is the parameter count less norms and biases: 7.62B for
    Qwen2.5-7B (7.61B published, which has the biases too)."""
    qwen2_5_7b = {"model_type": "qwen2", "hidden_size": 3584, "num_hidden_layers": 28, "num_attention_heads": 28,
                  "num_key_value_heads": 4, "intermediate_size": 18944, "vocab_size": 152064}
    # head_dim 3584 / 28 = 128: QKV 3584 x (3584 + 512 + 512), output 3584 x 3584, MLP 3 x 3584 x 18944.
    per_layer = 3584 * 4608 + 3584 * 3584 + 3 * 3584 * 18944
    assert matmul_weights_per_token(qwen2_5_7b) == 28 * per_layer + 2 * 152064 * 3584 == 7_615_283_200


def test_weights_per_token_of_an_moe_model_count_the_router_and_the_top_k_experts():
    moe = {"model_type": "qwen3_moe", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
           "num_key_value_heads": 2, "head_dim": 32, "num_experts": 4, "num_experts_per_tok": 2,
           "moe_intermediate_size": 64, "intermediate_size": 128, "vocab_size": 18}
    # QKV 64 x 192 + output 64 x 64 = 16384; router 64 x 4 = 256; 2 experts of 3 x 64 x 64 = 24576 (not 4).
    assert matmul_weights_per_token(moe) == 2 * (16384 + 256 + 24576) + 2 * 18 * 64 == 84736
    # Mixtral's config names the experts' width intermediate_size (and, from transformers 5, their count
    # num_local_experts).
    mixtral = {"model_type": "mixtral", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
               "num_key_value_heads": 2, "head_dim": 32, "num_local_experts": 4, "num_experts_per_tok": 2,
               "intermediate_size": 64, "vocab_size": 18}
    assert matmul_weights_per_token(mixtral) == 84736


def matrix_parameters(config) -> int:
    """The weights of the real transformers model's matrices (norms and biases are vectors)."""
    model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters() if p.dim() >= 2)


def test_weights_per_token_match_the_real_models():
    """The demo's Qwen2 multiplies each token by every matrix it has; its MoE variant by all but the experts the
    router did not pick (4 experts, top-2: two of 3 x 64 x 64 per layer left out)."""
    dense = build_config()
    assert matmul_weights_per_token(dense.to_dict()) == matrix_parameters(dense)
    moe = build_config(moe=True)
    expert = 3 * moe.hidden_size * moe.moe_intermediate_size
    skipped = moe.num_hidden_layers * (moe.num_experts - moe.num_experts_per_tok) * expert
    assert matmul_weights_per_token(moe.to_dict()) == matrix_parameters(moe) - skipped


def test_weights_per_token_of_deepseek_v3_count_latent_attention_shared_experts_and_dense_layers():
    """A tiny DeepSeek-V3 (latent attention, a dense first layer, a shared expert, 4 routed experts top-2): every
    matrix of the real model but the routed experts a token does not go through."""
    from transformers import DeepseekV3Config

    config = DeepseekV3Config(vocab_size=18, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
                              num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, q_lora_rank=16,
                              kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                              n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                              n_group=1, topk_group=1)
    skipped = 2 * (4 - 2) * 3 * 64 * 32  # the 2 routing layers' unchosen experts
    assert matmul_weights_per_token(config.to_dict()) == matrix_parameters(config) - skipped
    # Attention's width: the mean of the query/key heads' (16 + 8) and the value heads' (16), x 2 heads.
    assert forward_flops(config.to_dict(), [4]) == 2 * matmul_weights_per_token(config.to_dict()) * 4 + 2 * 3 * 40 * 16


def test_forward_flops_add_attention_over_each_sequence_squared():
    # Sequences of 3 and 5 tokens: 2 x N x 8 tokens, + 2 x 2 layers x 64 (4 heads of 16) x (9 + 25).
    assert forward_flops(DENSE, [3, 5]) == 2 * DENSE_WEIGHTS * 8 + 2 * 2 * 64 * 34 == 1_393_152
    # The same tokens in one sequence cost more attention: it grows with the square of the length.
    assert forward_flops(DENSE, [8]) == 2 * DENSE_WEIGHTS * 8 + 2 * 2 * 64 * 64


def test_mfu_is_flops_over_seconds_times_the_devices_peaks():
    assert mfu(1e11, seconds=2.0, peaks=[1e11, 1e11]) == 0.25
    assert mfu(1e11, seconds=2.0, peaks=[1e11, None]) is None  # a device without a known peak: no figure


def test_actor_mfu_of_the_old_log_probs_and_of_the_update():
    seconds = {"step": 5.0, "old_log_prob": 0.5, "update_actor": 2.0}
    forward = forward_flops(DENSE, [3, 5])
    metrics = actor_mfu_metrics(DENSE, [3, 5], seconds, peaks=[1e6, 1e6], ppo_epochs=2)
    # The update: 2 epochs of a forward and a backward pass (3 forwards each).
    assert metrics == pytest.approx({"perf/mfu/actor_infer": forward / (0.5 * 2e6),
                                     "perf/mfu/actor": 2 * 3 * forward / (2.0 * 2e6)})


def test_actor_mfu_leaves_out_what_did_not_run_or_has_no_peak():
    # A critic warm-up step updates no actor.
    assert set(actor_mfu_metrics(DENSE, [3, 5], {"old_log_prob": 0.5}, [1e6], 1)) == {"perf/mfu/actor_infer"}
    # An unknown GPU (or a float32 model on a GPU).
    assert actor_mfu_metrics(DENSE, [3, 5], {"old_log_prob": 0.5, "update_actor": 2.0}, [None, None], 1) == {}


def test_memory_is_the_most_any_worker_reported():
    gpu = [DeviceStats(1e15, 30.5, 100.0), DeviceStats(1e15, 42.0, 90.0)]
    assert memory_metrics(gpu) == {"perf/max_memory_allocated_gb": 42.0, "perf/cpu_memory_used_gb": 100.0}
    cpu = [DeviceStats(1e10, None, 3.0), DeviceStats(1e10, None, 4.0)]
    assert memory_metrics(cpu) == {"perf/cpu_memory_used_gb": 4.0}
