"""Rotary position embeddings as a config.json describes them: the inverse frequencies and the attention factor of
each rope type Hugging Face defines that a model family here uses (`default`, `linear`, Llama 3.1's `llama3`,
`yarn` for Qwen2.5's long-context configs and DeepSeek).

Megatron's own rotary classes fix Llama 3's low/high frequency factors and original context (1, 4, 8192) and move
YaRN's tables to CUDA; computing the frequencies here, from the formulas of the papers (as transformers does), gives
one exact mechanism for every type on every device: `models.gpt` puts them into Megatron's rotary embedding.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

SUPPORTED = ("default", "linear", "llama3", "yarn")


def rope_theta(hf: dict) -> float:
    # transformers >= 5 writes rope settings under "rope_parameters"; older configs keep them top-level.
    return hf.get("rope_theta", (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0))


def rope_parameters(hf: dict) -> dict:
    """The rope settings of a config.json as one dict with `rope_type` (older configs say `type`, and keep them
    under `rope_scaling`; transformers >= 5 writes `rope_parameters`)."""
    parameters = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    parameters["rope_type"] = parameters.get("rope_type", parameters.pop("type", "default"))
    parameters.pop("rope_theta", None)
    parameters.pop("partial_rotary_factor", None)
    return parameters


def partial_rotary_factor(hf: dict) -> float:
    """The share of each head's dimensions that rotate (GLM: half); transformers >= 5 may keep it with the rope
    parameters."""
    return hf.get("partial_rotary_factor", (hf.get("rope_parameters") or {}).get("partial_rotary_factor", 1.0))


def rope_scaling(hf: dict) -> dict | None:
    """The rope scaling of a config.json (its type and parameters), None for plain rope: what a checkpoint's
    config must agree on."""
    parameters = rope_parameters(hf)
    return parameters if parameters["rope_type"] != "default" else None


@dataclass(frozen=True)
class Rotary:
    """Inverse frequencies of the rotated dimensions (head_dim x partial_rotary_factor of them, in pairs), and the
    factor YaRN multiplies cos and sin by (1 otherwise)."""

    inv_freq: torch.Tensor
    attention_factor: float


def check_rope(hf: dict) -> None:
    """ValueError naming the field when a config.json's rope type is one this module cannot compute."""
    parameters = rope_parameters(hf)
    kind = parameters["rope_type"]
    if kind not in SUPPORTED:
        raise ValueError(f"rope_scaling type '{kind}' is not supported (supported: "
                         f"{', '.join(SUPPORTED)}); use a model without it.")
    required = {"linear": ("factor",), "llama3": ("factor", "low_freq_factor", "high_freq_factor",
                                                  "original_max_position_embeddings"),
                "yarn": ("original_max_position_embeddings",)}.get(kind, ())
    for key in required:
        if parameters.get(key) is None:
            raise ValueError(f"rope_scaling type '{kind}' needs '{key}'; add it to rope_scaling.")


def base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def llama3_inv_freq(inv_freq: torch.Tensor, factor: float, low_freq_factor: float, high_freq_factor: float,
                    original_max_position_embeddings: int) -> torch.Tensor:
    """Llama 3.1: wavelengths longer than original/low_freq_factor are stretched by `factor`, those shorter than
    original/high_freq_factor kept, and the ones between interpolated smoothly."""
    wavelength = 2 * math.pi / inv_freq
    low_wavelength = original_max_position_embeddings / low_freq_factor
    high_wavelength = original_max_position_embeddings / high_freq_factor
    smooth = (original_max_position_embeddings / wavelength - low_freq_factor) / (high_freq_factor - low_freq_factor)
    interpolated = (1 - smooth) * inv_freq / factor + smooth * inv_freq
    scaled = torch.where(wavelength > low_wavelength, inv_freq / factor, inv_freq)
    medium = (wavelength >= high_wavelength) & (wavelength <= low_wavelength)
    return torch.where(medium, interpolated, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def yarn(theta: float, dim: int, parameters: dict, max_positions: int | None) -> Rotary:
    """YaRN (Peng et al. 2023): dimensions that rotate fewer than beta_slow times over the original context are
    interpolated by `factor`, those rotating more than beta_fast times kept, a linear ramp between; cos and sin
    are scaled by 0.1 ln(factor) + 1 (DeepSeek's configs give that as mscale / mscale_all_dim)."""
    original = parameters["original_max_position_embeddings"]
    factor = parameters.get("factor") or max_positions / original
    beta_fast, beta_slow = parameters.get("beta_fast") or 32, parameters.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if parameters.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / ((high - low) or 0.001)).clamp(0, 1)
    kept = 1 - ramp  # the share of each dimension's frequency extrapolated as is
    wavelengths = theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    inv_freq = 1.0 / (factor * wavelengths) * (1 - kept) + 1.0 / wavelengths * kept
    attention_factor = parameters.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = parameters.get("mscale"), parameters.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
                            if mscale and mscale_all_dim else yarn_mscale(factor))
    return Rotary(inv_freq, float(attention_factor))


def rotary_of(hf: dict, head_dim: int) -> Rotary:
    """The rotary embedding of a config.json's model whose attention heads have `head_dim` dimensions."""
    check_rope(hf)
    parameters = rope_parameters(hf)
    kind, theta = parameters["rope_type"], rope_theta(hf)
    dim = int(head_dim * partial_rotary_factor(hf))
    if kind == "yarn":
        return yarn(theta, dim, parameters, hf.get("max_position_embeddings"))
    inv_freq = base_inv_freq(theta, dim)
    if kind == "linear":
        inv_freq = inv_freq / parameters["factor"]
    elif kind == "llama3":
        inv_freq = llama3_inv_freq(inv_freq, parameters["factor"], parameters["low_freq_factor"],
                                   parameters["high_freq_factor"], parameters["original_max_position_embeddings"])
    return Rotary(inv_freq, 1.0)
