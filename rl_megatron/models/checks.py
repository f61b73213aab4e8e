"""A model's config.json against the parallel layouts it will run at, before anything is built.

Every size comes with the name the user set it by (a config key, or a command-line flag of the convert CLI), and
every config.json with where it was read from: each ConfigError names both and the fix.
"""
from __future__ import annotations

from typing import Optional

from rl_megatron.errors import ConfigError
from rl_megatron.models import linear_attention
from rl_megatron.models.family import FAMILIES, REQUIRED_FIELDS
from rl_megatron.models.multimodal import refuse_multimodal
from rl_megatron.models.pipeline_stages import check_split

MODEL_SOURCE = "model.path's config.json"
Size = tuple[str, int]  # (the config key or flag that sets it, its value)
OptionalSize = tuple[str, Optional[int]]  # a size whose key may be unset (None)


def check_model_layout(hf: dict, tp: Size, pp: Size, ep: Size, vpp: Size | None = None,
                       source: str = MODEL_SOURCE, first_stage: OptionalSize | None = None,
                       last_stage: OptionalSize | None = None) -> None:
    """A model's config.json (read from `source`) against a parallel layout: its family known and its fields
    usable, TP splitting the heads, PP (x VPP) the layers (evenly, or with the first / last stage's layer counts
    where a caller has those keys: `first_stage`, `last_stage`) and EP the experts."""
    refuse_multimodal(hf, source)  # its fields are in text_config: say what to do, not what is missing
    for key in REQUIRED_FIELDS:
        if key not in hf:
            raise ConfigError(f"{source} lacks '{key}'; is the model a decoder-only causal LM?")
    for key in (*REQUIRED_FIELDS, "num_key_value_heads"):
        value = hf.get(key)
        if key in hf and value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise ConfigError(f"{source} has {key}={value!r}; it must be a positive integer.")
    try:
        family = FAMILIES[hf.get("model_type")]
    except ConfigError as err:
        raise ConfigError(f"{source}: {err}") from None
    check_heads(hf, tp, source)
    check_split(hf["num_hidden_layers"], pp, vpp or ("", 1), first_stage, last_stage, source)
    family.check(hf, source)
    experts = family.experts(hf)
    ep_name, ep_size = ep
    if ep_size > 1 and not experts:
        raise ConfigError(f"{ep_name}={ep_size} needs an MoE model, but {source} has model_type={hf['model_type']!r} "
                          f"(no experts); set {ep_name}=1.")
    if experts % ep_size:
        raise ConfigError(f"{ep_name}={ep_size} must divide the model's {experts} experts ({source}); choose a "
                          "divisor.")


def check_heads(hf: dict, tp: Size, source: str = MODEL_SOURCE) -> None:
    """A tensor-parallel size must split the attention heads and the key/value heads evenly."""
    name, size = tp
    heads = hf["num_attention_heads"]
    groups = hf.get("num_key_value_heads") or heads
    if heads % size or groups % size:
        raise ConfigError(f"{name}={size} must divide the model's attention heads ({heads}) and key/value heads "
                          f"({groups}) ({source}). Choose a size that divides both.")
    family = FAMILIES.get(hf.get("model_type"))
    if family is not None and family.gated_delta_net:
        for key, count in linear_attention.tp_split_counts(hf).items():
            if count % size:
                raise ConfigError(f"{name}={size} must divide the model's linear-attention heads {key}={count} "
                                  f"({source}). Choose a size that divides it too.")


def check_sequence_length(hf: dict, length: Size, source: str = MODEL_SOURCE) -> None:
    """The longest sequence the engines hold against the model's positions."""
    name, value = length
    positions = hf.get("max_position_embeddings")
    if isinstance(positions, int) and value > positions:
        raise ConfigError(f"{name} = {value} exceeds the model's max_position_embeddings={positions} ({source}); "
                          "lower it.")


def check_moe_model(hf: dict, etp: Size) -> None:
    """An MoE model (config.json after the moe section's overrides) against what Megatron trains: shared experts
    only where the family maps them, top-k within the experts, a router with a gradient, experts split evenly over
    expert-TP."""
    family = FAMILIES[hf["model_type"]]
    experts = family.experts(hf)
    if family.moe.shared is None:
        for key in ("shared_expert_intermediate_size", "n_shared_experts", "num_shared_experts"):
            if hf.get(key):
                raise ConfigError(f"The model's config.json (model.path) has {key}={hf[key]}, but the "
                                  f"{hf['model_type']} family has no shared experts; is model_type right?")
    top_k = hf["num_experts_per_tok"]
    if top_k > experts:
        raise ConfigError(f"Each token goes to num_experts_per_tok={top_k} experts (moe.top_k or config.json) of only "
                          f"{experts} (moe.num_experts or config.json); lower moe.top_k.")
    if top_k == 1 and family.renormalises_top_k_of(hf):
        raise ConfigError("Top-1 routing with the weights renormalised over the top-k (config.json norm_topk_prob, "
                          "always for Mixtral) gives every token the weight 1, so the router would get no gradient "
                          "(Megatron refuses it): use moe.top_k >= 2.")
    etp_name, etp_size = etp
    if family.expert_biases and etp_size > 1:
        raise ConfigError(f"The {hf['model_type']} experts' output biases would be added once per expert-TP rank "
                          f"before Megatron sums their partial outputs (at {etp_name}={etp_size}, the TP size by "
                          "default): set actor.expert_tensor_parallel_size=1 (the experts then split over EP).")
    width_key = family.moe.width_key
    if hf[width_key] % etp_size:
        raise ConfigError(f"The experts' width {width_key}={hf[width_key]} (model.path's config.json) does not split "
                          f"over {etp_name}={etp_size} (default: the TP size) ranks; choose a divisor.")
