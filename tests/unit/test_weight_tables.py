"""Layouts: the regions of all TP shards tile the HF tensors exactly, and the shards are Megatron's layout."""
import pytest
import torch

from rl_megatron.models.family import table_for
from rl_megatron.models.weight_layouts import (Entry, FusedGateUp, FusedQKV, PaddedVocab, Split, hf_view, local_view,
                                               shard_from_hf)
from rl_megatron.models.weight_tables import DenseTable


def rebuild_from_shards(entry: Entry, shards: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """The HF tensors put back together from every rank's shard, each element written exactly once."""
    out = {name: torch.full(shape, float("nan")) for name, shape in zip(entry.hf_names, entry.hf_shapes)}
    for rank, shard in enumerate(shards):
        for region in entry.regions(rank, len(shards)):
            target = hf_view(out[region.hf_name], region)
            assert target.isnan().all(), "two ranks claim the same element"
            target.copy_(local_view(shard, region))
    return out


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layout,shapes", [
    (Split(dim=0), [(8, 6)]),
    (Split(dim=1), [(6, 8)]),
    (FusedGateUp(), [(8, 6), (8, 6)]),
    (FusedQKV(groups=4, heads=8, head_dim=2), [(16, 6), (8, 6), (8, 6)]),  # weights
    (FusedQKV(groups=4, heads=8, head_dim=2), [(16,), (8,), (8,)]),  # biases
    (PaddedVocab(padded=12), [(10, 6)]),
])
def test_shards_tile_the_hf_tensors(layout, shapes, tp):
    entry = Entry(tuple(f"t{i}" for i in range(len(shapes))), layout, tuple(shapes))
    hf = [torch.randn(shape) for shape in shapes]
    shards = [shard_from_hf(entry, hf, rank, tp) for rank in range(tp)]
    assert all(tuple(s.shape) == entry.local_shape(tp) for s in shards)
    rebuilt = rebuild_from_shards(entry, shards)
    assert all(torch.equal(rebuilt[n], h) for n, h in zip(entry.hf_names, hf))


def test_qkv_shard_holds_whole_groups_in_megatron_order():
    # 2 groups of 2 query heads, head_dim 1: rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    entry = Entry(("q", "k", "v"), FusedQKV(groups=2, heads=4, head_dim=1), ((4, 1), (2, 1), (2, 1)))
    assert shard_from_hf(entry, [q, k, v], 0, 1).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert shard_from_hf(entry, [q, k, v], 1, 2).flatten().tolist() == [2, 3, 11, 21]


def test_gate_up_shard_is_gate_slice_then_up_slice():
    gate, up = torch.arange(4.).reshape(4, 1), torch.arange(10., 14.).reshape(4, 1)
    entry = Entry(("gate", "up"), FusedGateUp(), ((4, 1), (4, 1)))
    assert shard_from_hf(entry, [gate, up], 1, 2).flatten().tolist() == [2, 3, 12, 13]


def test_padded_vocab_rows_are_zero_and_belong_to_no_hf_row():
    entry = Entry(("emb",), PaddedVocab(padded=8), ((5, 3),))
    shard = shard_from_hf(entry, [torch.randn(5, 3)], 1, 2)
    assert torch.equal(shard[1:], torch.zeros(3, 3))
    assert [(r.start, r.stop) for r in entry.regions(1, 2)] == [((4, 0), (5, 3))]


def test_checkpoint_tensor_of_the_wrong_shape_is_named():
    entry = Entry(("model.norm.weight",), Split(dim=0), ((8,),))
    with pytest.raises(ValueError, match=r"'model.norm.weight' has shape \(6,\).*implies \(8,\)"):
        shard_from_hf(entry, [torch.randn(6)], 0, 1)


HF = {"model_type": "qwen2", "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8,
      "intermediate_size": 16, "vocab_size": 10, "tie_word_embeddings": False}


def test_table_resolves_layers_with_pipeline_offset_and_te_names():
    table = DenseTable(HF, padded_vocab=16)
    entry = table.lookup("decoder.layers.1.self_attention.linear_qkv.weight", layer_offset=2)
    assert entry.hf_names == tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv")
    assert entry.hf_shapes == ((8, 8), (4, 8), (4, 8))
    te = table.lookup("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", layer_offset=0)
    assert te.hf_names == ("model.layers.0.post_attention_layernorm.weight",)
    with pytest.raises(KeyError, match="decoder.layers.0.mystery.weight"):
        table.lookup("decoder.layers.0.mystery.weight", 0)


def test_tied_output_layer_is_the_embedding():
    table = DenseTable(dict(HF, tie_word_embeddings=True), padded_vocab=16)
    assert table.lookup("output_layer.weight", 0).hf_names == ("model.embed_tokens.weight",)


def test_unknown_family_is_rejected_by_name():
    with pytest.raises(ValueError, match="gpt_neox"):
        table_for(dict(HF, model_type="gpt_neox"), 16)


MOE = dict(HF, model_type="qwen3_moe", num_hidden_layers=4, num_experts=4, num_experts_per_tok=2,
           moe_intermediate_size=6)


def test_moe_table_names_experts_globally_from_the_expert_offset():
    table = table_for(MOE, padded_vocab=16)
    fc1 = table.lookup("decoder.layers.1.mlp.experts.local_experts.1.linear_fc1.weight", layer_offset=2,
                       expert_offset=2)
    assert fc1.hf_names == tuple(f"model.layers.3.mlp.experts.3.{p}_proj.weight" for p in ("gate", "up"))
    assert isinstance(fc1.layout, FusedGateUp) and fc1.hf_shapes == ((6, 8), (6, 8))
    fc2 = table.lookup("decoder.layers.0.mlp.experts.local_experts.0.linear_fc2.weight", 0, expert_offset=2)
    assert fc2.hf_names == ("model.layers.0.mlp.experts.2.down_proj.weight",) and fc2.layout == Split(dim=1)
    router = table.lookup("decoder.layers.0.mlp.router.weight", 0, expert_offset=2)
    assert router.hf_names == ("model.layers.0.mlp.gate.weight",) and router.hf_shapes == ((4, 8),)
    with pytest.raises(KeyError, match="mlp.linear_fc1.weight"):  # no dense MLP in an MoE layer
        table.lookup("decoder.layers.0.mlp.linear_fc1.weight", 0)


@pytest.mark.parametrize("family, down", [("qwen3_moe", "down_proj"), ("mixtral", "w2")])
def test_grouped_gemm_expert_names_map_to_the_same_tensors_as_per_expert_ones(family, down):
    """TE's grouped GEMM (TEGroupedMLP, moe.grouped_gemm) names local expert j's weights `linear_fc1.weight<j>`."""
    table = table_for(dict(MOE, model_type=family, intermediate_size=6), padded_vocab=16)
    for fc in ("linear_fc1", "linear_fc2"):
        grouped = table.lookup(f"decoder.layers.1.mlp.experts.{fc}.weight1", layer_offset=2, expert_offset=2)
        assert grouped == table.lookup(f"decoder.layers.1.mlp.experts.local_experts.1.{fc}.weight", 2, 2)
    prefix = "model.layers.3.mlp.experts.3." if family == "qwen3_moe" else "model.layers.3.block_sparse_moe.experts.3."
    assert grouped.hf_names == (prefix + down + ".weight",)
    with pytest.raises(KeyError, match="linear_fc1.bias1"):  # no biases (add_bias_linear=False)
        table.lookup("decoder.layers.1.mlp.experts.linear_fc1.bias1", 0)


@pytest.mark.parametrize("dense", [{"mlp_only_layers": [0]}, {"decoder_sparse_step": 2}])
def test_moe_table_maps_dense_layers_between_routing_ones(dense):
    """Qwen-MoE's dense layers (mlp_only_layers, or off the decoder_sparse_step) keep the dense MLP's names."""
    table = table_for(dict(MOE, **dense), 16)
    fc1 = table.lookup("decoder.layers.0.mlp.linear_fc1.weight", 0)
    assert fc1.hf_names == ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.up_proj.weight")
    assert fc1.hf_shapes == ((16, 8), (16, 8))  # the dense width, intermediate_size
    with pytest.raises(KeyError, match="mlp.router.weight"):
        table.lookup("decoder.layers.0.mlp.router.weight", 0)
    with pytest.raises(KeyError, match="mlp.linear_fc1.weight"):
        table.lookup("decoder.layers.1.mlp.linear_fc1.weight", 0)
    needed = table.hf_tensors()
    assert "model.layers.0.mlp.down_proj.weight" in needed and "model.layers.0.mlp.gate.weight" not in needed
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in needed
    assert "model.layers.1.mlp.down_proj.weight" not in needed


def test_shared_experts_gate_and_expert_bias_map_to_their_hf_names():
    qwen2_moe = dict(MOE, model_type="qwen2_moe", shared_expert_intermediate_size=10)
    table = table_for(qwen2_moe, 16)
    fc1 = table.lookup("decoder.layers.1.mlp.shared_experts.linear_fc1.weight", 0)
    assert fc1.hf_names == ("model.layers.1.mlp.shared_expert.gate_proj.weight",
                            "model.layers.1.mlp.shared_expert.up_proj.weight") and fc1.hf_shapes[0] == (10, 8)
    gate = table.lookup("decoder.layers.1.mlp.shared_experts.gate_weight", 0)
    assert gate.hf_names == ("model.layers.1.mlp.shared_expert_gate.weight",) and gate.hf_shapes == ((1, 8),)
    assert table.lookup("decoder.layers.0.self_attention.linear_qkv.bias", 0)  # Qwen2's q/k/v biases


