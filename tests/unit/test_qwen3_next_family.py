"""The Gated DeltaNet hybrids' records (models/linear_attention.py; models/families/qwen3_next.py and qwen3_5.py, whose
linear attention stores its input projection otherwise): their layers read from config.json as transformers reads
them, the configs they refuse (naming the field), and the layouts of their regrouped tensors (Gated DeltaNet's in_proj
and conv1d, the gated attention's q projection), each covering every HF element once over the TP ranks.
(Numerics against transformers: tests/distributed/test_qwen3_next.py.)"""
import os

import pytest
import torch
from transformers import Qwen3_5MoeTextConfig, Qwen3_5TextConfig, Qwen3NextConfig

from helpers.runs import REPO
from rl_megatron.config import ConfigError
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.preflight import load_config
from rl_megatron.preflight.layout import check_hybrid_layers
from rl_megatron.models.checks import check_model_layout
from rl_megatron.models.family import table_for
from rl_megatron.models.linear_attention import DeltaNetShape, linear_attention_layers
from rl_megatron.models.tiny import family_config
from rl_megatron.models.weight_layouts import shard_from_hf

HYBRIDS = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")
TINY = {model_type: family_config(model_type, layers=4).to_dict() for model_type in HYBRIDS}


@pytest.mark.parametrize("hf_config", [Qwen3NextConfig, Qwen3_5TextConfig, Qwen3_5MoeTextConfig])
@pytest.mark.parametrize("fields", [{"layer_types": ["full_attention", "linear_attention"] * 3},
                                    {"full_attention_interval": 3}, {}])
def test_layers_are_read_as_transformers_reads_them(fields, hf_config):
    hf = {"num_hidden_layers": 6, **fields}
    expected = hf_config(num_hidden_layers=6, **fields).layer_types
    assert linear_attention_layers(hf) == [kind == "linear_attention" for kind in expected]


@pytest.mark.parametrize("fields, tp, named", [
    ({"layer_types": ["linear_attention"]}, 1, "layer_types"),
    ({"layer_types": ["linear_attention", "sliding_attention"] * 2}, 1, "layer_types"),
    ({"hidden_act": "gelu"}, 1, "hidden_act"),
    ({"attention_bias": True}, 1, "attention_bias"),
    ({"partial_rotary_factor": None}, 1, "partial_rotary_factor"),
    ({"linear_num_value_heads": 3}, 1, "linear_num_value_heads"),
    ({"linear_num_key_heads": 1, "linear_num_value_heads": 2}, 2, "linear_num_key_heads"),
])
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_configs_megatron_would_compute_otherwise_are_refused_by_field(fields, tp, named, model_type):
    hf = {**TINY[model_type], **fields}
    if fields.get("partial_rotary_factor", 0) is None:
        hf.pop("partial_rotary_factor")
        hf["rope_parameters"] = {key: value for key, value in hf["rope_parameters"].items()
                                 if key != "partial_rotary_factor"}
    with pytest.raises(ConfigError, match=named):
        check_model_layout(hf, ("actor.tensor_model_parallel_size", tp), ("pp", 1), ("ep", 1))


@pytest.mark.parametrize("name", ["self_attention.in_proj.weight", "self_attention.conv1d.weight",
                                  "self_attention.linear_qkv.weight"])
@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("model_type", HYBRIDS)
def test_regrouped_tensors_cover_every_element_once(name, tp, model_type):
    layer = 1 if "linear_qkv" in name else 0  # a linear-attention layer, then a full-attention one
    hf = TINY[model_type]
    entry = table_for(hf, hf["vocab_size"]).layer_entries(layer)[name]
    # Every element of the HF tensors numbered, distinct across them; the shards together hold each number once.
    sizes = [torch.Size(shape).numel() for shape in entry.hf_shapes]
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    numbered = [torch.arange(start, start + size, dtype=torch.float64).reshape(shape)
                for start, size, shape in zip(starts, sizes, entry.hf_shapes)]
    held = torch.cat([shard_from_hf(entry, numbered, rank, tp).flatten() for rank in range(tp)])
    assert torch.equal(held.sort().values, torch.arange(sum(sizes), dtype=torch.float64))


@pytest.mark.parametrize("tp", [1, 2])
def test_both_in_proj_packings_give_megatron_the_same_heads(tp):
    """Qwen3.5's four tensors, each part whole, regrouped per key head into Qwen3-Next's two: the in_proj shard a TP
    rank gets from either is the same (which head is which is held to transformers by the parity tests)."""
    entries = {model_type: table_for(TINY[model_type], 18).layer_entries(0)["self_attention.in_proj.weight"]
               for model_type in ("qwen3_next", "qwen3_5_text")}
    shape, hidden = DeltaNetShape.of(TINY["qwen3_5_text"]), TINY["qwen3_5_text"]["hidden_size"]
    key_heads = shape.key_heads
    g = torch.Generator().manual_seed(0)
    qkv, z, b, a = (torch.randn(size, generator=g) for size in entries["qwen3_5_text"].hf_shapes)
    q, k, v = qkv.split([shape.qk, shape.qk, shape.v])

    def per_key_head(*parts):  # [part 0 of key head 0, part 1 of it, ...; then key head 1's]
        return torch.cat([x.reshape(key_heads, -1, hidden) for x in parts], 1).reshape(-1, hidden)

    grouped = [per_key_head(q, k, v, z), per_key_head(b, a)]
    for rank in range(tp):
        assert torch.equal(shard_from_hf(entries["qwen3_5_text"], [qkv, z, b, a], rank, tp),
                           shard_from_hf(entries["qwen3_next"], grouped, rank, tp))


QWEN3_NEXT = os.path.join(REPO, "configs", "models", "tiny-qwen3-next-digits")


def test_what_the_hybrid_layers_lack_yet_is_refused_before_anything_starts():
    # LoRA: no adapters on the Gated DeltaNet layers yet.
    with pytest.raises(ConfigError) as info:
        load_config(os.path.join(REPO, "configs", "demo_cpu_lora.yaml"), [f"model.path={QWEN3_NEXT}"])
    assert "actor.lora.rank" in str(info.value) and "Gated DeltaNet" in str(info.value)
    # Transformer Engine's layers where it imports on CUDA: the role holding the model named.
    cfg = load_config(os.path.join(REPO, "configs", "demo_cpu.yaml"), [f"model.path={QWEN3_NEXT}"])
    hf = read_hf_config(QWEN3_NEXT)
    check_hybrid_layers(cfg, hf, cuda=True, transformer_engine=False)
    check_hybrid_layers(cfg, hf, cuda=False, transformer_engine=True)
    with pytest.raises(ConfigError) as info:
        check_hybrid_layers(cfg, hf, cuda=True, transformer_engine=True)
    assert "the actor's model (model_type='qwen3_next')" in str(info.value)
    assert "pip uninstall transformer-engine" in str(info.value)
    demo = load_config(os.path.join(REPO, "configs", "demo_cpu.yaml"), [])
    check_hybrid_layers(demo, read_hf_config(demo.model.path), cuda=True, transformer_engine=True)  # not hybrid
