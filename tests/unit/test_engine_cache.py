"""What an engine's cache holds per sample (rl_megatron/planning/engine_cache.py), against hand-computed sizes: grouped
key/value heads split over TP (and shared where TP exceeds them), multi-head latent attention's latent whole on every
rank, and the Gated DeltaNet layers' per-sequence state; and the plan's engine line saying how many samples fit (test_launch_plan.py)."""
from transformers import Qwen3NextConfig

from rl_megatron.planning.engine_cache import sample_cache

QWEN2_5_7B = dict(model_type="qwen2", hidden_size=3584, num_hidden_layers=28, num_attention_heads=28,
                  num_key_value_heads=4, vocab_size=152064)
MLA = dict(model_type="deepseek_v3", hidden_size=7168, num_hidden_layers=61, num_attention_heads=128,
           num_key_value_heads=128, kv_lora_rank=512, qk_rope_head_dim=64, q_lora_rank=1536, qk_nope_head_dim=128,
           v_head_dim=128, vocab_size=129280)


def test_grouped_attention_keeps_each_ranks_share_of_the_key_value_heads():
    # 28 layers x keys and values x 4 heads x 128 wide x 2 bytes = 56 KiB a token at TP 1.
    assert sample_cache(QWEN2_5_7B, 1, "bfloat16").token_bytes == 28 * 2 * 4 * 128 * 2 == 56 * 1024
    assert sample_cache(QWEN2_5_7B, 2, "bfloat16").token_bytes == 28 * 2 * 2 * 128 * 2
    assert sample_cache(QWEN2_5_7B, 8, "bfloat16").token_bytes == 28 * 2 * 1 * 128 * 2  # a head per rank, shared
    assert sample_cache(QWEN2_5_7B, 1, "float32").sample_bytes(10) == 10 * 28 * 2 * 4 * 128 * 4


def test_latent_attention_keeps_its_latent_and_rotary_key_whole():
    assert sample_cache(MLA, 8, "bfloat16").token_bytes == 61 * (512 + 64) * 2
    assert sample_cache(MLA, 8, "bfloat16").state_bytes == 0


def test_the_gated_delta_net_layers_keep_a_state_per_sequence_not_per_token():
    # Qwen3-Next-80B-A3B (transformers' defaults): 48 layers, every 4th full attention (2 key/value heads of 256).
    hf = Qwen3NextConfig().to_dict()
    cache = sample_cache(hf, 4, "bfloat16")
    assert cache.token_bytes == 12 * 2 * 1 * 256 * 2  # 2 heads over 4 ranks: one each
    # 36 layers: the convolution's last 3 inputs of q, k (16 x 128 each) and v (32 x 128), and a 128 x 128 state
    # per value head, over 4 ranks.
    assert cache.state_bytes == 36 * ((2 * 16 * 128 + 32 * 128) * 3 + 32 * 128 * 128) // 4 * 2
    assert cache.sample_bytes(1000) == 1000 * cache.token_bytes + cache.state_bytes
