"""gpt-oss folders as released, their experts in MXFP4 (rl_megatron/models/mxfp4.py), written by the tests' own
quantizer: tests/unit/test_mxfp4.py and tests/distributed/test_gpt_oss.py."""
import json
import os

import torch
from safetensors.torch import save_file
from transformers import GptOssConfig, GptOssForCausalLM

from rl_megatron.models import mxfp4
from rl_megatron.models.hf_weights import INDEX_FILE
from rl_megatron.models.tiny import write_tiny_model

FP4_MAGNITUDES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])  # codes 0-7; bit 3 is the sign
STACKS = ("gate_up_proj", "down_proj")  # the experts' tensors gpt-oss stores in MXFP4
# gpt-oss-20b's config.json: what stays bf16.
QUANTIZATION_CONFIG = {"quant_method": "mxfp4", "modules_to_not_convert": [
    "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
BLOCKS_FILE, SCALES_FILE = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
GATE_UP = "model.layers.1.mlp.experts.gate_up_proj"


def quantize_mxfp4(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(blocks, scales) of `stacked` [experts, in, out] (transformers' orientation), the OCP MX spec's way: each block
    of 32 values along `in` shares the scale 2^(floor(log2(amax)) - 2) (6 = 1.5 * 2^2 is FP4's largest value), each
    value is rounded to the nearest FP4 code; two codes a byte, the first in the low nibble; out-major."""
    values = stacked.float().transpose(1, 2)  # [experts, out, in]
    experts, outputs, inputs = values.shape
    blocks = values.reshape(experts, outputs, inputs // 32, 32)
    amax = blocks.abs().amax(-1)
    exponent = torch.where(amax > 0, torch.floor(torch.log2(amax)) - 2, torch.tensor(-127.0)).clamp(-127, 127)
    scaled = blocks / torch.exp2(exponent)[..., None]
    codes = (scaled.abs()[..., None] - FP4_MAGNITUDES).abs().argmin(-1) | torch.signbit(scaled).long() << 3
    pairs = codes.to(torch.uint8).reshape(experts, outputs, inputs // 32, 16, 2)
    return (pairs[..., 0] | pairs[..., 1] << 4).contiguous(), (exponent + 127).to(torch.uint8).contiguous()


def bits(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor's bit patterns: equal bits, not merely equal values (-0.0 is not 0.0)."""
    return tensor.view({torch.bfloat16: torch.int16, torch.float32: torch.int32}[tensor.dtype])


def save_folder(folder: str, config: dict, tensors: dict[str, torch.Tensor]) -> None:
    """A sharded folder as released: the scales in a second file, everything else in the first, and the index."""
    os.makedirs(folder, exist_ok=True)
    files = {BLOCKS_FILE: {}, SCALES_FILE: {}}
    for name, tensor in tensors.items():
        files[SCALES_FILE if name.endswith(mxfp4.SCALES_SUFFIX) else BLOCKS_FILE][name] = tensor
    for file, part in files.items():
        save_file(part, os.path.join(folder, file), metadata={"format": "pt"})
    with open(os.path.join(folder, INDEX_FILE), "w") as f:
        json.dump({"metadata": {}, "weight_map": {name: file for file, part in files.items() for name in part}}, f)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(config, f)


def write_released(folder: str) -> tuple[str, dict, dict[str, torch.Tensor]]:
    """(folder, config.json, stored tensors) of a tiny gpt-oss (2 layers, 4 experts, hidden 64, width 64) as
    released: bf16, its experts' weights in MXFP4."""
    write_tiny_model(folder, family="gpt-oss")
    with open(os.path.join(folder, "config.json")) as f:
        plain = dict(json.load(f), dtype="bfloat16")
    model, generator = GptOssForCausalLM(GptOssConfig(**plain)).to(torch.bfloat16), torch.Generator().manual_seed(0)
    tensors = {}
    for name, tensor in model.state_dict().items():
        if name.rpartition(".")[2] in STACKS:
            packed = mxfp4.packed_names(name)
            tensors[packed.blocks], tensors[packed.scales] = quantize_mxfp4(tensor.normal_(std=0.5, generator=generator))
        else:
            tensors[name] = tensor.normal_(std=0.1, generator=generator).contiguous()  # biases too, so that a misplaced one shows
    config = dict(plain, quantization_config=QUANTIZATION_CONFIG)
    save_folder(folder, config, tensors)
    return folder, config, tensors
