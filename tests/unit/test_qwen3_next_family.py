"""The qwen3_next record (models/linear_attention.py, models/families/qwen3_next.py): its layers read from config.json
as transformers reads them, the configs it refuses (naming the field), and the layouts of its regrouped tensors
(Gated DeltaNet's in_proj and conv1d, the gated attention's q projection), each covering every HF element once over
the TP ranks. (Numerics against transformers: tests/distributed/test_qwen3_next.py.)"""
import pytest
import torch
from transformers import Qwen3NextConfig

from rl_megatron.config import ConfigError
from rl_megatron.models.checks import check_model_layout
from rl_megatron.models.family import table_for
from rl_megatron.models.linear_attention import linear_attention_layers
from rl_megatron.models.tiny import family_config
from rl_megatron.models.weight_layouts import shard_from_hf

TINY = family_config("qwen3_next", layers=4).to_dict()


@pytest.mark.parametrize("fields", [{"layer_types": ["full_attention", "linear_attention"] * 3},
                                    {"full_attention_interval": 3}, {}])
def test_layers_are_read_as_transformers_reads_them(fields):
    hf = {"num_hidden_layers": 6, **fields}
    expected = Qwen3NextConfig(num_hidden_layers=6, **fields).layer_types
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
def test_configs_megatron_would_compute_otherwise_are_refused_by_field(fields, tp, named):
    hf = {**TINY, **fields}
    if fields.get("partial_rotary_factor", 0) is None:
        hf.pop("partial_rotary_factor")
        hf["rope_parameters"] = {key: value for key, value in hf["rope_parameters"].items()
                                 if key != "partial_rotary_factor"}
    with pytest.raises(ConfigError, match=named):
        check_model_layout(hf, ("actor.tensor_model_parallel_size", tp), ("pp", 1), ("ep", 1))


@pytest.mark.parametrize("name", ["self_attention.in_proj.weight", "self_attention.conv1d.weight",
                                  "self_attention.linear_qkv.weight"])
@pytest.mark.parametrize("tp", [1, 2])
def test_regrouped_tensors_cover_every_element_once(name, tp):
    layer = 1 if "linear_qkv" in name else 0  # a linear-attention layer, then a full-attention one
    entry = table_for(TINY, TINY["vocab_size"]).layer_entries(layer)[name]
    # Every element of the HF tensors numbered, distinct across them; the shards together hold each number once.
    sizes = [torch.Size(shape).numel() for shape in entry.hf_shapes]
    starts = torch.tensor([0, *sizes]).cumsum(0).tolist()
    numbered = [torch.arange(start, start + size, dtype=torch.float64).reshape(shape)
                for start, size, shape in zip(starts, sizes, entry.hf_shapes)]
    held = torch.cat([shard_from_hf(entry, numbered, rank, tp).flatten() for rank in range(tp)])
    assert torch.equal(held.sort().values, torch.arange(sum(sizes), dtype=torch.float64))
