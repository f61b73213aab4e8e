"""Layouts: HF tensors -> TP shards -> HF tensors is the identity, and the shards are Megatron's layout."""
import pytest
import torch

from rl_megatron.models.weight_tables import DenseTable, FusedGateUp, FusedQKV, PaddedVocab, Split, table_for


@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("layout,shapes", [
    (Split(dim=0), [(8, 6)]),
    (Split(dim=1), [(6, 8)]),
    (FusedGateUp(), [(8, 6), (8, 6)]),
    (FusedQKV(groups=4, heads=8, head_dim=2), [(16, 6), (8, 6), (8, 6)]),  # weights
    (FusedQKV(groups=4, heads=8, head_dim=2), [(16,), (8,), (8,)]),  # biases
    (PaddedVocab(vocab=10, padded=12), [(10, 6)]),
])
def test_shard_then_merge_is_identity(layout, shapes, tp):
    hf = [torch.randn(shape) for shape in shapes]
    shards = [layout.shard(hf, rank, tp) for rank in range(tp)]
    assert all(s.shape == shards[0].shape for s in shards)
    merged = layout.merge(shards)
    assert all(torch.equal(m, h) for m, h in zip(merged, hf))


def test_qkv_shard_holds_whole_groups_in_megatron_order():
    # 2 groups of 2 query heads, head_dim 1: rows are [q0 q1 k0 v0 | q2 q3 k1 v1].
    q, k, v = torch.tensor([[0.], [1.], [2.], [3.]]), torch.tensor([[10.], [11.]]), torch.tensor([[20.], [21.]])
    layout = FusedQKV(groups=2, heads=4, head_dim=1)
    assert layout.shard([q, k, v], 0, 1).flatten().tolist() == [0, 1, 10, 20, 2, 3, 11, 21]
    assert layout.shard([q, k, v], 1, 2).flatten().tolist() == [2, 3, 11, 21]


def test_gate_up_shard_is_gate_slice_then_up_slice():
    gate, up = torch.arange(4.).reshape(4, 1), torch.arange(10., 14.).reshape(4, 1)
    assert FusedGateUp().shard([gate, up], 1, 2).flatten().tolist() == [2, 3, 12, 13]


def test_padded_vocab_pads_with_zeros_and_export_drops_them():
    emb = torch.randn(5, 3)
    shards = [PaddedVocab(5, 8).shard([emb], r, 2) for r in range(2)]
    assert torch.equal(shards[1][1:], torch.zeros(3, 3))


HF = {"model_type": "qwen2", "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8,
      "vocab_size": 10, "tie_word_embeddings": False}


def test_table_resolves_layers_with_pipeline_offset_and_te_names():
    table = DenseTable(HF, padded_vocab=16)
    entry = table.lookup("decoder.layers.1.self_attention.linear_qkv.weight", layer_offset=2)
    assert entry.hf_names == tuple(f"model.layers.3.self_attn.{p}_proj.weight" for p in "qkv")
    te = table.lookup("decoder.layers.0.mlp.linear_fc1.layer_norm_weight", layer_offset=0)
    assert te.hf_names == ("model.layers.0.post_attention_layernorm.weight",)
    with pytest.raises(KeyError, match="decoder.layers.0.mystery.weight"):
        table.lookup("decoder.layers.0.mystery.weight", 0)


def test_tied_embeddings_export_once():
    table = DenseTable(dict(HF, tie_word_embeddings=True), padded_vocab=16)
    assert table.lookup("output_layer.weight", 0).hf_names == ("model.embed_tokens.weight",)
    assert not table.exported("output_layer.weight")


def test_unknown_family_is_rejected_by_name():
    with pytest.raises(ValueError, match="gpt_neox"):
        table_for(dict(HF, model_type="gpt_neox"), 16)
