"""The activation estimate of rl_megatron/planning/memory.py and layer_memory.py against figures worked out by hand from
their docstrings (tests/distributed/test_memory_plan.py holds them to the bytes autograd saves).

One small dense layer throughout: h = 64, f = 128, 4 heads of 16 (h_q = 64), 2 kv heads (h_kv = 32), 4 layers,
vocabulary 100, bfloat16 (w = 2), TP 2 with sequence parallelism, Transformer Engine's layers, T = 1000 tokens:
  A     = 2 * (4*64/2 + (3*64 + 3*32)/2 + 5*128/2) = 2 * (128 + 144 + 320) = 1184 bytes per token
  head  = 2 * 2*64/2 + 50 * (2 + 4c): 628 in an update (c = 2), 828 in a forward pass (c = 3), 1228 with the
          entropy bonus (c = 5); the padded vocabulary is 100, 50 per TP rank
On the CPU (torch's layers) per rank: 2 heads, Q 32, K 16, V 16, the fused QKV 64 elements; the two norms keep
2 * (8 + 2) * 64/2 = 640 bytes (fp32 input and normalized input, bf16 output), RoPE's tables 2 * 4 * 16 = 128 per
token of a packed row, the MLP 640; the head 10 * 64/2 + 500 = 820 in an update.
"""
import pytest

from rl_megatron.planning.memory import Activations, ModelShape, RolePasses, activation_bytes, in_flight, layer_bytes
from rl_megatron.planning.model_shape import LatentAttention

SHAPE = ModelShape(hidden=64, ffn=128, heads=4, kv_heads=2, head_dim=16, layers=4, vocab=100)
T = 1000


def passes(**changes) -> RolePasses:
    return RolePasses(**{"tokens": T, "row_tokens": T, "tp": 2, "sequence_parallel": True, **changes})


def test_one_layer_by_hand():
    # (kept, kept under selective recompute, the attention core's): TE keeps the core's inputs either way.
    assert layer_bytes(SHAPE, passes()) == (1184, 1184, 0)
    # Without sequence parallelism the norms' 4h are whole on every TP rank: 2 * (256 + 144 + 320).
    assert layer_bytes(SHAPE, passes(sequence_parallel=False)) == (1440, 1440, 0)
    # CPU, packed rows (torch's fused attention per span length): the output projection's input 2 * 32 and the
    # kernel's copies of Q, K, V and its output, 2 * (32 + 16 + 16 + 32) = 192, none of QKV; selective keeps QKV and
    # RoPE's Q and K instead, 2 * (32 + 64 + 32 + 16) = 288.
    assert layer_bytes(SHAPE, passes(attention="spans")) == (640 + 128 + 64 + 192 + 640, 640 + 128 + 288 + 640, 192)
    # CPU, right-padded rows of 250 tokens (Megatron's local attention): 4 rows share RoPE's tables (32); the output
    # and RoPE's Q, 2 * (32 + 32); K and V repeated to the 4 query heads 2 * 2 * 32 = 128 and the fp32 softmax with
    # its bf16 copy, 2 heads * 250 * 6 = 3000 (the core).
    assert layer_bytes(SHAPE, passes(attention="local", row_tokens=250)) == (640 + 32 + 128 + 3128 + 640,
                                                                               640 + 32 + 288 + 640, 3128)
    # float32: norms 2 * 12 * 32, tables 64, MLP 1280; the output and Q 4 * 64, the repeated K, V 4 * 64 and the
    # softmax kept once, 2 * 250 * 4.
    assert layer_bytes(SHAPE, passes(attention="local", row_tokens=250, dtype="float32")) == (
        768 + 64 + 256 + 2256 + 1280, 768 + 64 + 576 + 1280, 2256)
    # Without GQA nothing is repeated: packed, the copies 2 * 4 * 32; padded, the QKV output (V is its view) and
    # RoPE's Q and K stay, 2 * (96 + 32 + 32), beside the output 2 * 32 and the softmax.
    mha = ModelShape(**{**SHAPE.__dict__, "kv_heads": 4})
    assert layer_bytes(mha, passes(attention="spans")).core == 256
    assert layer_bytes(mha, passes(attention="local", row_tokens=250)) == (640 + 32 + 384 + 3000 + 640,
                                                                             640 + 32 + 384 + 640, 3000)
    # Per-head Q/K norms (Qwen3) keep their inputs: the query copied out of the grouped layout, h_q / TP more (the
    # key is a view of QKV); torch's in bf16 keep fp32 copies of Q and K and them normalized, 2 * 4 * (32 + 16).
    qk_norm = ModelShape(**{**SHAPE.__dict__, "qk_norm": True})
    assert layer_bytes(qk_norm, passes()).kept == 1184 + 2 * 32
    assert layer_bytes(qk_norm, passes(attention="spans")).kept == 1664 + 384
    # ... in float32 the query's copy 4 * 32, the normalized Q and K 4 * 48 and QKV itself 4 * 64.
    assert layer_bytes(qk_norm, passes(attention="spans", dtype="float32")).kept == (
        768 + 256 + 1280 + 4 * 32 + 4 * 96 + 4 * 32 + 4 * 48 + 4 * 64)
    # TP 4 over 2 kv heads: Megatron replicates them, one per rank (h_kv counted as 4 heads of 16).
    assert layer_bytes(SHAPE, passes(tp=4)).kept == 2 * (4 * 64 / 4 + (3 * 64 + 3 * 64) / 4 + 5 * 128 / 4)


def test_moe_layer_by_hand():
    """8 experts of width 32, 2 per token, experts whole (ETP 1) beside attention at TP 2: each routed copy keeps
    its input h and its GLU 6 f_e (SwiGLU's 5 and its product with the router's weight), per TP rank's share of the
    tokens; the routing (9 * 8 + 24 * 2) / 2 = 60 bytes over t_sp."""
    moe = ModelShape(**{**SHAPE.__dict__, "ffn": 0, "experts": 8, "top_k": 2, "expert_ffn": 32})
    elements = 4 * 64 / 2 + (3 * 64 + 3 * 32) / 2 + 2 * (64 * 1 + 6 * 32) / 2
    assert layer_bytes(moe, passes(etp=1)).kept == 2 * elements + 60
    # Experts split over ETP = TP = 2: every rank sees the copies of both ranks' tokens, half of each expert.
    gathered = 4 * 64 / 2 + (3 * 64 + 3 * 32) / 2 + 2 * (64 * 2 + 6 * 32) / 2
    assert layer_bytes(moe, passes()).kept == 2 * gathered + 60
    # gpt-oss's clamped SwiGLU keeps 8 f_e a copy.
    clamped = ModelShape(**{**moe.__dict__, "clamped_glu": True})
    assert layer_bytes(clamped, passes(etp=1)).kept == 2 * (elements + 2 * 2 * 32 / 2) + 60


def test_latent_attention_layer_by_hand():
    """Multi-head latent attention (DeepSeek-V2/V3): query rank 32, key/value rank 16, per head 8 non-rotary, 4 rotary
    and 8 value dimensions, 4 heads at TP 2 with sequence parallelism: the compressed query and key/value with their
    norms' outputs (2*32 + 2*16) / 2, the shared rotary key 4, and per head the assembled query and key and the value
    2 (8 + 4) + 8, 2 heads a rank, and the output 2 * 8; MLA's own RoPE keeps its tables, 2 * 4 * 4 bytes."""
    latent = LatentAttention(q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
    mla = ModelShape(**{**SHAPE.__dict__, "kv_heads": 4, "latent": latent})
    assert layer_bytes(mla, passes()) == (2 * (4 * 64 / 2 + (48 + 4) + 2 * 32 + 16 + 5 * 128 / 2) + 32,) * 2 + (0,)
    # Queries straight from the hidden state (Moonlight: q_lora_rank null): only the key/value is compressed.
    direct = ModelShape(**{**mla.__dict__, "latent": LatentAttention(0, 16, 8, 4, 8)})
    assert layer_bytes(direct, passes()).kept == 2 * (4 * 64 / 2 + (16 + 4) + 2 * 32 + 16 + 5 * 128 / 2) + 32
    hf = {"kv_lora_rank": 512, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128}
    assert LatentAttention.of(hf) == LatentAttention(0, 512, 128, 64, 128) and LatentAttention.of({}) is None


def test_shared_experts_and_dense_layers_by_hand():
    """An MoE model whose first layer keeps a dense MLP (DeepSeek's first_k_dense_replace) and whose routed layers
    add shared experts of width 48 beside 2 of 8 routed experts of width 32 (whole, ETP 1): a routed layer keeps
    2 * (128 + 144 + (2 * (64 + 6*32) + 5*48) / 2) + the routing's 60 = 1356 bytes a token, the dense one 1184."""
    moe = ModelShape(**{**SHAPE.__dict__, "experts": 8, "top_k": 2, "expert_ffn": 32, "shared_ffn": 48,
                        "dense_layers": (0,)})
    assert layer_bytes(moe, passes(etp=1)).kept == 1356 and layer_bytes(moe, passes(etp=1), routed=False).kept == 1184
    # Qwen2-MoE's gate scales the shared experts' output, which it keeps: 2 * 64/2 more.
    gated = ModelShape(**{**moe.__dict__, "shared_gate": True})
    assert layer_bytes(gated, passes(etp=1)).kept == 1356 + 64
    estimate = activation_bytes(moe, passes(etp=1))
    assert (estimate.update, estimate.forward) == (T * (1184 + 3 * 1356 + 628), T * 1356)
    # Carrying the routing (routing replay, the agreement metric): each token's 2 experts in the 3 routed layers as
    # int64, of the sequence-parallel rank's 500 tokens, in both passes: 500 * 3 * 2 * 8 = 24000 bytes.
    routed = activation_bytes(moe, passes(etp=1, routing=True))
    assert routed.routing == 24000 and (routed.update, routed.forward) == (estimate.update + 24000,
                                                                           estimate.forward + 24000)
    assert activation_bytes(moe, passes(etp=1, routing=True, trains=False)).update == 0
    qwen2_moe = {"model_type": "qwen2_moe", "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
                 "intermediate_size": 64, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 48,
                 "num_experts": 8, "num_experts_per_tok": 2, "mlp_only_layers": [0], "vocab_size": 40}
    shape = ModelShape.of(qwen2_moe)
    assert (shape.shared_ffn, shape.dense_layers, shape.routes(0), shape.routes(1)) == (48, (0,), False, True)
    assert shape.shared_gate


def test_shape_from_config_json():
    moe = {"model_type": "qwen3_moe", "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 64, "moe_intermediate_size": 16,
           "num_experts": 8, "num_experts_per_tok": 2, "vocab_size": 40}
    assert ModelShape.of(moe) == ModelShape(hidden=32, ffn=64, heads=4, kv_heads=2, head_dim=8, layers=2, vocab=40,
                                            qk_norm=True, experts=8, top_k=2, expert_ffn=16)
    dense = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
             "intermediate_size": 128, "vocab_size": 18}
    assert ModelShape.of(dense) == ModelShape(hidden=64, ffn=128, heads=4, kv_heads=4, head_dim=16, layers=2,
                                              vocab=18)


@pytest.mark.parametrize("changes, update, forward", [
    # 4 layers x A kept, the head (628) on top of them.
    ({}, T * (4 * 1184 + 628), T * 1184),
    # Full recompute in groups of 2: 2 inputs of h/TP (2 * 64/2 bytes each); the backward remakes 2 layers, which
    # outweighs the head, freed by then.
    ({"recompute": "full", "recompute_method": "uniform", "recompute_num_layers": 2}, T * (2 * 64 + 2 * 1184),
     T * 1184),
    # Megatron requires a method and a layer count with full: unset they are read as uniform, 1 layer.
    ({"recompute": "full"}, T * (4 * 64 + 1184), T * 1184),
    # Block: the first layer keeps its input, the other 3 everything; one layer remade at a time.
    ({"recompute": "full", "recompute_method": "block", "recompute_num_layers": 1}, T * (64 + 3 * 1184 + 1184),
     T * 1184),
    # Selective recompute with flash attention: nothing left to drop.
    ({"recompute": "selective"}, T * (4 * 1184 + 628), T * 1184),
    # ... on the CPU with the local attention (rows of 250): the layers keep the core's inputs (1600 each) instead of
    # the core (3128), which the backward remakes one layer at a time, outweighing the head (820).
    ({"recompute": "selective", "attention": "local", "row_tokens": 250}, T * (4 * 1600 + 3128), T * 4568),
    ({"attention": "local", "row_tokens": 250}, T * (4 * 4568 + 820), T * 4568),
    # 1F1B over 2 stages: the first holds 2 micro-batches of its 2 layers (4736) > the last's 2368 + 628.
    ({"pp": 2}, T * 2 * 2 * 1184, T * 1184),
    # Interleaved, 2 chunks per stage: 2 x (1 + 1 / (2 x 2)) = 2.5 micro-batches in flight.
    ({"pp": 2, "vpp": 2}, T * 2.5 * 2 * 1184, T * 1184),
    # Context parallelism 2: 500 tokens per rank.
    ({"cp": 2}, T // 2 * (4 * 1184 + 628), T // 2 * 1184),
    # The entropy bonus: 5 fp32 copies of the logits in the update.
    ({"entropy_bonus": True}, T * (4 * 1184 + 1228), T * 1184),
    # The critic: a value head (its inputs h/TP + h, 2 bytes each) instead of logits.
    ({"policy_head": False}, T * (4 * 1184 + 2 * (32 + 64)), T * 1184),
])
def test_role_passes_by_hand(changes, update, forward):
    estimate = activation_bytes(SHAPE, passes(**changes))
    assert (estimate.update, estimate.forward) == (int(update), int(forward))
    assert estimate.bytes == max(int(update), int(forward)) and estimate.larger_pass == "update"


def test_forward_pass_and_frozen_roles_by_hand():
    """A frozen role (the reference) runs forward passes only: its logits with 3 fp32 copies when they outweigh a
    layer; here with a vocabulary of 1000 (500 per rank: 2 * 64 + 500 * 14 = 7128 bytes per token)."""
    shape = ModelShape(**{**SHAPE.__dict__, "vocab": 1000})
    frozen = activation_bytes(shape, passes(trains=False))
    assert frozen == Activations(bytes=T * 7128, tokens=T, update=0, forward=T * 7128, logits=T * 7000)
    # The actor's forward pass (old log-probs) outweighs its update under full recompute.
    actor = activation_bytes(shape, passes(recompute="full"))
    assert actor.update == T * (4 * 64 + 2 * 64 + 500 * 10) and actor.larger_pass == "forward"
    assert actor.bytes == T * 7128 and actor.logits == T * 7000
    # The padded vocabulary: 1000 rounded up to a multiple of 128 x TP 2 = 1024, 512 per rank.
    assert activation_bytes(shape, passes(trains=False), vocab_multiple=128).logits == T * 512 * 14


def test_micro_batches_in_flight():
    assert (in_flight(1, 1), in_flight(4, 1), in_flight(4, 2)) == (1, 4, 4 * (1 + 3 / 8))
