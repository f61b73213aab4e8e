"""gpt-oss's MXFP4 experts as released (rl_megatron/models/mxfp4.py): dequantized value for value as transformers
does, read under their plain names, checked from the safetensors headers, exported as a plain folder, and served by
vLLM engines built unquantized. The MXFP4 folder is a tiny gpt-oss written here with the official tensor names, its
experts quantized by the test's own quantizer."""
import json
import os
import re

import pytest
import torch
from helpers.mxfp4 import BLOCKS_FILE, GATE_UP, SCALES_FILE, STACKS, bits, quantize_mxfp4, save_folder, write_released
from safetensors.torch import load_file
from transformers import GptOssForCausalLM, Mxfp4Config
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from rl_megatron.checkpoint import write_hf_folder
from rl_megatron.config.schema import RolloutConfig
from rl_megatron.errors import ConfigError
from rl_megatron.models import mxfp4
from rl_megatron.models.family import table_for
from rl_megatron.models.gpt import SafetensorsReader
from rl_megatron.models.hf_weights import check_hf_weights
from rl_megatron.rollout.vllm_engine import engine_arguments

@pytest.fixture(scope="module")
def released(tmp_path_factory) -> tuple[str, dict, dict[str, torch.Tensor]]:
    return write_released(str(tmp_path_factory.mktemp("gpt_oss_mxfp4")))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("values_per_chunk", [1, 500, mxfp4.VALUES_PER_CHUNK])
def test_dequantization_is_transformers_bit_for_bit(dtype, values_per_chunk):
    """Every byte and every scale but the NaN one (0xFF), in chunks of one row up to the whole tensor."""
    generator = torch.Generator().manual_seed(1)
    blocks = torch.randint(0, 256, (3, 40, 4, 16), dtype=torch.uint8, generator=generator)
    scales = torch.randint(0, 255, (3, 40, 4), dtype=torch.uint8, generator=generator)
    scales[0, 0, :] = torch.tensor([0, 1, 253, 254])  # the extremes: subnormal and overflowing values
    ours = mxfp4.dequantize_mxfp4(blocks, scales, dtype, values_per_chunk=values_per_chunk)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=dtype)
    assert ours.shape == theirs.shape == (3, 4 * 32, 40) and ours.dtype == dtype and ours.is_contiguous()
    assert torch.equal(bits(ours), bits(theirs))


def test_weights_that_mxfp4_holds_read_back_exactly():
    """Values that are FP4 codes times a power of two per block survive the test's quantizer and the dequantization
    bit for bit, in bf16: the layout (input-major, low nibble first, scale per 32 inputs) without transformers."""
    generator = torch.Generator().manual_seed(2)
    experts, inputs, outputs = 2, 96, 5
    codes = torch.randint(0, 16, (experts, inputs, outputs), generator=generator)
    values = torch.tensor(mxfp4.FP4_E2M1_VALUES)[codes]
    exponents = torch.randint(-20, 20, (experts, inputs // 32, outputs), generator=generator)
    stacked = (values * torch.exp2(exponents.repeat_interleave(32, dim=1).float())).to(torch.bfloat16)
    blocks, scales = quantize_mxfp4(stacked)
    assert blocks.shape == (experts, outputs, inputs // 32, 16) and scales.shape == (experts, outputs, inputs // 32)
    assert torch.equal(bits(mxfp4.dequantize_mxfp4(blocks, scales)), bits(stacked))


def test_the_reader_gives_the_dequantized_experts_under_their_plain_names(released):
    folder, config, tensors = released
    reader = SafetensorsReader(folder)
    experts, hidden, width = config["num_local_experts"], config["hidden_size"], config["intermediate_size"]
    for layer in range(config["num_hidden_layers"]):
        for stack, shape in zip(STACKS, [(experts, hidden, 2 * width), (experts, width, hidden)]):
            name = f"model.layers.{layer}.mlp.experts.{stack}"
            assert name not in reader.weight_map  # only its blocks and scales are stored
            read = reader.get(name)
            packed = mxfp4.packed_names(name)
            assert read.shape == shape and read.dtype == mxfp4.DEQUANTIZED_DTYPE == torch.bfloat16
            assert torch.equal(bits(read), bits(convert_moe_packed_tensors(tensors[packed.blocks],
                                                                           tensors[packed.scales])))
    for name, tensor in tensors.items():  # the plain tensors read as they are stored, the packed ones too
        assert torch.equal(reader.get(name), tensor)


def test_the_weight_table_reads_each_expert_from_the_dequantized_stacks(released):
    """What load_hf_weights reads: one expert's gate, up and down projections as nn.Linear holds them."""
    folder, config, _ = released
    reader = SafetensorsReader(folder)
    read = table_for(config, config["vocab_size"]).stored_reader(reader.get)
    gate_up, down = reader.get(GATE_UP), reader.get("model.layers.1.mlp.experts.down_proj")
    expert = "model.layers.1.mlp.experts.2."
    assert torch.equal(read(expert + "gate_proj.weight"), gate_up[2][:, 0::2].t())
    assert torch.equal(read(expert + "up_proj.weight"), gate_up[2][:, 1::2].t())
    assert torch.equal(read(expert + "down_proj.weight"), down[2].t())


def test_transformers_dequantized_model_holds_what_the_reader_reads(released):
    """transformers' own load of the folder (Mxfp4Config(dequantize=True), on the CPU) against every tensor."""
    folder, _, _ = released
    model = GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                              dtype=torch.bfloat16)
    reader = SafetensorsReader(folder)
    state = model.state_dict()
    assert GATE_UP in state
    for name, tensor in state.items():
        assert tensor.dtype == torch.bfloat16 and torch.equal(bits(reader.get(name)), bits(tensor)), name


def broken_copy(released, tmp_path, **changes) -> str:
    """The released folder with `changes` (stored name -> tensor, or None to leave it out)."""
    _, config, tensors = released
    changed = {name: changes.get(name, tensor) for name, tensor in tensors.items()}
    save_folder(str(tmp_path), config, {name: tensor for name, tensor in changed.items() if tensor is not None})
    return str(tmp_path)


def test_missing_or_misshapen_scales_are_named_with_their_files(released, tmp_path):
    _, config, tensors = released
    packed = mxfp4.packed_names(GATE_UP)
    folder = broken_copy(released, tmp_path / "missing", **{packed.scales: None})
    with pytest.raises(mxfp4.Mxfp4FormatError) as raised:
        SafetensorsReader(folder).get(GATE_UP)
    assert re.fullmatch(re.escape(f"Tensor '{GATE_UP}' of '{folder}' is stored in MXFP4: '{packed.blocks}' is in "
                                  f"'{BLOCKS_FILE}', but '{packed.scales}' (its scales) is in none of the folder's "
                                  "files.") + " Download or copy .* again.", str(raised.value))
    with pytest.raises(ConfigError, match=re.escape(f"stores tensor '{GATE_UP}' in MXFP4 ('{packed.blocks}' in "
                                                    f"'{BLOCKS_FILE}'), but '{packed.scales}' is missing")):
        check_hf_weights(folder, config, "model.path")

    folder = broken_copy(released, tmp_path / "misshapen",
                         **{packed.scales: tensors[packed.scales][:, :-1].contiguous()})
    with pytest.raises(mxfp4.Mxfp4FormatError, match=re.escape(
            f"'{packed.scales}' in '{SCALES_FILE}'): not an MXFP4 tensor: the scales have shape [4, 127, 2], but "
            "blocks of shape [4, 128, 2, 16] need [4, 128, 2] (one per block). Download or copy those files again.")):
        SafetensorsReader(folder).get(GATE_UP)
    with pytest.raises(ConfigError, match=re.escape(
            f"tensor '{packed.scales}' in '{SCALES_FILE}' is U8 of shape [4, 127, 2], but the MXFP4 form of "
            f"'{GATE_UP}' [4, 64, 128] is U8 of shape [4, 128, 2]")):
        check_hf_weights(folder, config, "model.path")


def test_preflight_accepts_the_released_folder(released):
    folder, config, _ = released
    check_hf_weights(folder, config, "model.path")


def test_a_nan_scale_is_refused():
    blocks, scales = torch.zeros(1, 2, 1, 16, dtype=torch.uint8), torch.full((1, 2, 1), 127, dtype=torch.uint8)
    scales[0, 1, 0] = mxfp4.E8M0_NAN
    with pytest.raises(mxfp4.Mxfp4FormatError, match="0xff, which MXFP4 defines as NaN"):
        mxfp4.dequantize_mxfp4(blocks, scales)


def test_an_export_of_the_model_is_a_plain_folder(released, tmp_path):
    """Exported (as `convert to-hf` writes the trainer's per-expert state) the experts are plain stacked bf16 tensors
    and config.json has no quantization_config: transformers loads it unquantized, the same model."""
    folder, config, _ = released
    table = table_for(config, config["vocab_size"])
    read = table.stored_reader(SafetensorsReader(folder).get)
    write_hf_folder({name: read(name) for name in table.hf_tensors()}, str(tmp_path), config, folder,
                    torch.bfloat16, progress=lambda _: None)
    with open(tmp_path / "config.json") as f:
        exported_config = json.load(f)
    assert "quantization_config" not in exported_config and mxfp4.is_mxfp4_config(config)
    [file] = [name for name in os.listdir(tmp_path) if name.endswith(".safetensors")]
    exported = load_file(str(tmp_path / file))
    assert not any(name.endswith((mxfp4.BLOCKS_SUFFIX, mxfp4.SCALES_SUFFIX)) for name in exported)
    assert torch.equal(bits(exported[GATE_UP]), bits(SafetensorsReader(folder).get(GATE_UP)))
    plain = GptOssForCausalLM.from_pretrained(str(tmp_path), dtype=torch.bfloat16)
    assert getattr(plain.config, "quantization_config", None) is None
    dequantized = GptOssForCausalLM.from_pretrained(folder, quantization_config=Mxfp4Config(dequantize=True),
                                                    dtype=torch.bfloat16).state_dict()
    assert all(torch.equal(bits(tensor), bits(dequantized[name])) for name, tensor in plain.state_dict().items())


def test_engines_of_an_mxfp4_folder_are_built_unquantized(released):
    """vLLM would build MXFP4 expert layers (gpt_oss_mxfp4) that the weight sync cannot write; the override
    leaves it none, and the moe section's overrides stand. An engine cannot load an MXFP4 folder itself then."""
    folder, _, _ = released
    from vllm.engine.arg_utils import EngineArgs

    def arguments(mxfp4_folder: bool, load_format: str = "dummy") -> dict:
        return engine_arguments(folder, RolloutConfig(max_model_len=64), "bfloat16", 0, {"num_experts_per_tok": 1},
                                load_format, cuda=False, mla=False, group_timeout_s=None, mxfp4_folder=mxfp4_folder)

    assert arguments(True)["hf_overrides"] == {"num_experts_per_tok": 1, "quantization_config": None}
    assert arguments(False)["hf_overrides"] == {"num_experts_per_tok": 1}
    unquantized, as_released = (EngineArgs(**arguments(flag)).create_model_config() for flag in (True, False))
    assert (unquantized.quantization, unquantized.is_quantized) == (None, False)
    assert (as_released.quantization, as_released.is_quantized) == ("gpt_oss_mxfp4", True)
    assert unquantized.hf_config.num_experts_per_tok == 1
    with pytest.raises(ValueError, match="load_format='auto' would have vLLM read the MXFP4 experts .* use "
                                         "load_format='dummy'"):
        arguments(True, "auto")
