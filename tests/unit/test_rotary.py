"""Rotary frequencies of each rope type a config.json can set, against transformers' own (the numerical ground
truth), and the refusals of the ones not supported."""
import math

import pytest
import torch
import transformers
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from rl_megatron.models.rotary import rope_scaling, rotary_of

BASE = dict(hidden_size=256, num_attention_heads=2, head_dim=128, num_hidden_layers=1, vocab_size=10,
            intermediate_size=8)
LLAMA31 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192}
CASES = {
    "llama3.1": ("llama", dict(rope_theta=500000.0, max_position_embeddings=131072, rope_scaling=LLAMA31)),
    "llama3.2": ("llama", dict(rope_theta=500000.0, max_position_embeddings=131072,
                               rope_scaling={**LLAMA31, "factor": 32.0})),
    # A short original context: most dimensions land in the interpolated band.
    "llama3-short": ("llama", dict(rope_theta=10000.0, max_position_embeddings=64,
                                   rope_scaling={**LLAMA31, "original_max_position_embeddings": 16})),
    # Qwen2.5's long-context setting, as its model cards write it ("type", no attention factor).
    "qwen2.5-yarn": ("qwen2", dict(rope_theta=1000000.0, max_position_embeddings=131072,
                                   rope_scaling={"type": "yarn", "factor": 4.0,
                                                 "original_max_position_embeddings": 32768})),
    "yarn-mscale": ("qwen2", dict(rope_theta=10000.0, max_position_embeddings=64,
                                  rope_scaling={"rope_type": "yarn", "factor": 40.0, "mscale": 0.707,
                                                "mscale_all_dim": 0.707, "beta_fast": 32, "beta_slow": 1,
                                                "original_max_position_embeddings": 4})),
    "linear": ("llama", dict(rope_theta=10000.0, max_position_embeddings=64,
                             rope_scaling={"rope_type": "linear", "factor": 2.0})),
    "default": ("mistral", dict(rope_theta=1000000.0, max_position_embeddings=64)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_frequencies_and_attention_factor_equal_transformers(case):
    model_type, fields = CASES[case]
    config = transformers.AutoConfig.for_model(model_type, **BASE, **fields)
    kind = config.rope_parameters["rope_type"]
    if kind == "default":
        expected = 1.0 / (config.rope_parameters["rope_theta"] ** (torch.arange(0, 128, 2).float() / 128)), 1.0
    else:
        expected = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    # From config.json as written on disk by either transformers generation (rope_parameters or rope_scaling).
    for hf in (config.to_dict(), {**BASE, "model_type": model_type, **fields}):
        rotary = rotary_of(hf, 128)
        assert torch.equal(rotary.inv_freq, expected[0]), case
        assert rotary.attention_factor == pytest.approx(expected[1], rel=1e-12)


def test_yarn_attention_factor_by_hand():
    hf = {**BASE, **CASES["qwen2.5-yarn"][1]}
    assert rotary_of(hf, 128).attention_factor == pytest.approx(0.1 * math.log(4.0) + 1.0)
    # mscale equal to mscale_all_dim: the factors cancel (DeepSeek-V2's setting).
    assert rotary_of({**BASE, **CASES["yarn-mscale"][1]}, 128).attention_factor == 1.0


def test_llama3_keeps_high_frequencies_and_divides_low_ones():
    inv = rotary_of({**BASE, **CASES["llama3.1"][1]}, 128).inv_freq
    plain = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    wavelength = 2 * math.pi / plain
    assert torch.equal(inv[wavelength < 2048], plain[wavelength < 2048])
    assert torch.allclose(inv[wavelength > 8192], plain[wavelength > 8192] / 8)


def test_scaling_is_recorded_only_where_set():
    assert rope_scaling({**BASE, "rope_theta": 1.0}) is None
    assert rope_scaling({**BASE, "rope_parameters": {"rope_type": "default", "rope_theta": 5.0}}) is None
    assert rope_scaling({**BASE, "rope_scaling": {"type": "yarn", "factor": 4.0}}) == {"rope_type": "yarn",
                                                                                       "factor": 4.0}


@pytest.mark.parametrize("scaling,message", [
    ({"rope_type": "dynamic", "factor": 2.0}, "type 'dynamic' is not supported"),
    ({"rope_type": "longrope", "factor": 2.0}, "type 'longrope'"),
    ({"rope_type": "llama3", "factor": 8.0}, "needs 'low_freq_factor'"),
    ({"rope_type": "yarn", "factor": 4.0}, "needs 'original_max_position_embeddings'"),
])
def test_unsupported_or_incomplete_scaling_is_refused_naming_the_field(scaling, message):
    with pytest.raises(ValueError, match=message):
        rotary_of({**BASE, "rope_scaling": scaling}, 128)
