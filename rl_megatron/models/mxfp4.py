"""MXFP4 expert weights, as gpt-oss's released folders store them, read as bf16.

gpt-oss-20b/120b ship each MoE layer's two stacked expert weights in MXFP4 (OCP microscaling FP4), config.json saying
so in `quantization_config: {"quant_method": "mxfp4", ...}`; everything else (biases, attention, router, norms,
embeddings) is bf16. For `model.layers.{i}.mlp.experts.gate_up_proj` and `...down_proj` a folder holds instead:

    <name>_blocks  uint8 [experts, out, in / 32, 16]  two FP4 (e2m1) codes a byte, the low nibble first
    <name>_scales  uint8 [experts, out, in / 32]      one E8M0 exponent per block of 32 values: 2^(scale - 127)

`out`-major, i.e. transposed from the stacked tensor transformers' GptOssExperts holds (and a bf16 gpt-oss folder
stores), which is input-major: gate_up_proj [experts, hidden, 2 * width] (gate and up interleaved along the last
dimension), down_proj [experts, width, hidden]. `dequantize_mxfp4` returns that input-major tensor, value for value
what transformers' `convert_moe_packed_tensors` (Mxfp4Config(dequantize=True)) gives, so that a folder's MXFP4 experts
read as its bf16 twin's would (models/expert_stacks.py splits them per expert).

bf16 holds every MXFP4 value exactly (a 2-bit significand times a power of two within bf16's exponent range), so
dequantizing to bf16 loses nothing; an fp32 run widens them exactly when the loader copies them into its parameters.
The trainer and the vLLM engines then work in the run's dtype: nothing is ever re-quantized, and export writes plain
bf16 stacked tensors (`without_quantization_config` keeps config.json truthful about that).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import torch

QUANT_METHOD = "mxfp4"  # config.json's quantization_config.quant_method of such a folder
BLOCKS_SUFFIX, SCALES_SUFFIX = "_blocks", "_scales"
VALUES_PER_BLOCK = 32  # values sharing one scale
BYTES_PER_BLOCK = VALUES_PER_BLOCK // 2  # two 4-bit codes a byte
E8M0_BIAS = 127
E8M0_NAN = 0xFF  # the OCP MX spec's NaN scale: no value of a block with it is a number
# The value of each 4-bit e2m1 code (sign bit, 2 exponent bits, 1 mantissa bit), as the OCP MX spec defines them.
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
# The dtype the experts are read in: exact (module docstring); a run in fp32 casts them up when loading.
DEQUANTIZED_DTYPE = torch.bfloat16
# Values dequantized at a time: bounds the fp32 temporaries (~4 bytes and an index of 4 bytes per value, ~128 MiB)
# whatever the layer's size (a gpt-oss-120b gate_up_proj is 2.1e9 values, 4.2 GB in bf16).
VALUES_PER_CHUNK = 1 << 24


class Mxfp4FormatError(ValueError):
    """MXFP4 tensors that do not fit together; the message names the tensors, their files and the fix."""


def is_mxfp4_config(hf: dict) -> bool:
    """Whether config.json `hf` declares MXFP4 weights (gpt-oss as released)."""
    quantization = hf.get("quantization_config")
    return isinstance(quantization, dict) and str(quantization.get("quant_method", "")).lower() == QUANT_METHOD


def without_quantization_config(hf: dict) -> dict:
    """config.json `hf` for a folder of the same model whose weights are plain (bf16/fp32): an exported folder. Left
    in, quantization_config would make transformers and vLLM look for `_blocks`/`_scales` that are not there."""
    if not is_mxfp4_config(hf):
        return hf
    return {key: value for key, value in hf.items() if key != "quantization_config"}


# vLLM reads quantization_config off the HF config it builds (ModelConfig._verify_quantization): None there builds the
# unquantized model, as for a bf16 folder.
UNQUANTIZED_ENGINE_OVERRIDES = {"quantization_config": None}


def unquantized_engine_overrides(hf_overrides: dict | None, load_format: str) -> dict:
    """vLLM's hf_overrides for an engine of an MXFP4 folder: unquantized expert layers, in the run's dtype, that the
    trainer's weight sync writes (it sends bf16/fp32 tensors, which MXFP4 layers cannot take). Such an engine cannot
    read the folder itself: its unquantized gpt-oss loader wants the bf16 stacked tensors."""
    if load_format != "dummy":
        raise ValueError(f"load_format='{load_format}' would have vLLM read the MXFP4 experts of an MXFP4 folder into "
                         "an unquantized engine, which it cannot: use load_format='dummy' (the weight sync writes the "
                         "trainer's weights), or point the engine at a bf16 export of the model (`python -m "
                         "rl_megatron.convert to-hf`).")
    return {**(hf_overrides or {}), **UNQUANTIZED_ENGINE_OVERRIDES}


@dataclass(frozen=True)
class PackedNames:
    """The two tensors a folder stores for the MXFP4 form of tensor `name`."""

    name: str
    blocks: str
    scales: str


def packed_names(name: str) -> PackedNames:
    return PackedNames(name, name + BLOCKS_SUFFIX, name + SCALES_SUFFIX)


def packed_shapes(shape: tuple[int, ...]) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(blocks, scales) shapes of the MXFP4 form of a stacked tensor of `shape` [experts, in, out]."""
    experts, inputs, outputs = shape
    groups = inputs // VALUES_PER_BLOCK
    return (experts, outputs, groups, BYTES_PER_BLOCK), (experts, outputs, groups)


def shape_problem(blocks_shape: tuple[int, ...], scales_shape: tuple[int, ...]) -> str | None:
    """What makes (blocks, scales) of these shapes not one MXFP4 tensor, or None when they are."""
    if len(blocks_shape) != 4 or blocks_shape[-1] != BYTES_PER_BLOCK:
        return (f"the blocks have shape {list(blocks_shape)}, not [experts, out, in / {VALUES_PER_BLOCK}, "
                f"{BYTES_PER_BLOCK}]")
    if tuple(scales_shape) != tuple(blocks_shape[:-1]):
        return (f"the scales have shape {list(scales_shape)}, but blocks of shape {list(blocks_shape)} need "
                f"{list(blocks_shape[:-1])} (one per block)")
    return None


def _byte_values(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: the (low nibble, high nibble) values of every byte, in the order they sit along the input."""
    codes = torch.arange(256, device=device)
    table = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=device)
    return torch.stack([table[codes & 0x0F], table[codes >> 4]], dim=-1)


def _scale_factors(device: torch.device) -> torch.Tensor:
    """[256] fp32: 2^(scale - 127) for every E8M0 scale, exact (math.ldexp); 2^128 (scale 255) is inf in fp32."""
    return torch.tensor([math.ldexp(1.0, scale - E8M0_BIAS) for scale in range(256)], dtype=torch.float32,
                        device=device)


@torch.no_grad()
def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype = DEQUANTIZED_DTYPE,
                     values_per_chunk: int = VALUES_PER_CHUNK) -> torch.Tensor:
    """The stacked tensor [experts, in, out] in `dtype` that MXFP4 `blocks` [experts, out, in / 32, 16] and
    `scales` [experts, out, in / 32] (both uint8) hold: value = FP4(code) * 2^(scale - 127), the low nibble of a byte
    before the high one along `in`. Each value is formed in fp32 (exact) and rounded once to `dtype`, as transformers
    does; one chunk of rows of one expert at a time, written straight into the transposed result."""
    problem = shape_problem(tuple(blocks.shape), tuple(scales.shape))
    if problem is not None:
        raise Mxfp4FormatError(f"not an MXFP4 tensor: {problem}")
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise Mxfp4FormatError(f"MXFP4 blocks and scales are uint8, not {blocks.dtype} and {scales.dtype}")
    if bool((scales == E8M0_NAN).any()):
        raise Mxfp4FormatError(f"a scale is {E8M0_NAN:#x}, which MXFP4 defines as NaN: the weights are corrupt")
    experts, outputs, groups, _ = blocks.shape
    inputs = groups * VALUES_PER_BLOCK
    out = torch.empty(experts, inputs, outputs, dtype=dtype, device=blocks.device)
    byte_values, factors = _byte_values(blocks.device), _scale_factors(blocks.device)
    rows = max(1, values_per_chunk // max(inputs, 1))  # output rows (of `inputs` values each) per chunk
    for expert in range(experts):
        for start in range(0, outputs, rows):
            stop = min(start + rows, outputs)
            # [rows, groups, 16, 2]: each byte's two values, times its block's scale, then [rows, in].
            values = byte_values[blocks[expert, start:stop].int()]
            values *= factors[scales[expert, start:stop].int()][..., None, None]
            out[expert, :, start:stop] = values.view(stop - start, inputs).t()
    return out


def read_dequantized(name: str, weight_map: dict[str, str], read: Callable[[str], torch.Tensor], folder: str,
                     dtype: torch.dtype = DEQUANTIZED_DTYPE) -> torch.Tensor:
    """Tensor `name` of the folder `folder` from its MXFP4 blocks and scales (`weight_map`: stored name -> file;
    `read`: a stored tensor by name). Mxfp4FormatError naming the tensors and files when they do not fit."""
    packed = packed_names(name)
    blocks_file = weight_map[packed.blocks]
    scales_file = weight_map.get(packed.scales)
    if scales_file is None:
        raise Mxfp4FormatError(
            f"Tensor '{name}' of '{folder}' is stored in MXFP4: '{packed.blocks}' is in '{blocks_file}', but "
            f"'{packed.scales}' (its scales) is in none of the folder's files. Download or copy the folder's "
            "*.safetensors (and model.safetensors.index.json) again.")
    blocks, scales = read(packed.blocks), read(packed.scales)
    try:
        return dequantize_mxfp4(blocks, scales, dtype)
    except Mxfp4FormatError as err:
        raise Mxfp4FormatError(
            f"Tensor '{name}' of '{folder}' ('{packed.blocks}' in '{blocks_file}', '{packed.scales}' in "
            f"'{scales_file}'): {err}. Download or copy those files again.") from None
