"""Model families: what rl_megatron knows about one config.json `model_type`, in one `ModelFamily` record.

A record says which config.json fields the family reads, what Megatron's TransformerConfig takes from them (q/k/v
biases, per-head q/k norms, the MoE router and experts), how its weights map to Hugging Face names (its weight
table, which the planner counts parameters from too), and what a config.json of the family must hold. Each module
of rl_megatron/models/families registers one record by model_type: adding a family is adding a file there.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Callable

from rl_megatron.errors import ConfigError
from rl_megatron.models import families, linear_attention
from rl_megatron.models.rotary import check_rope
from rl_megatron.models.mla import MLA_FIELDS, mla_entries, mla_fields
from rl_megatron.models.moe import MoeSpec
from rl_megatron.models.multimodal import refuse_multimodal
from rl_megatron.models.weight_tables import DenseTable, MoeTable
from rl_megatron.registry import Registry


# config.json fields every family reads: the first four are required, the others have defaults.
REQUIRED_FIELDS = ("num_hidden_layers", "num_attention_heads", "hidden_size", "vocab_size")
COMMON_FIELDS = (*REQUIRED_FIELDS, "num_key_value_heads", "head_dim", "intermediate_size", "rms_norm_eps",
                 "rope_theta", "rope_parameters", "rope_scaling", "partial_rotary_factor", "tie_word_embeddings",
                 "max_position_embeddings")


def head_dim(hf: dict) -> int:
    """The attention heads' width (its key/value heads' too) of a family without MLA."""
    return hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"]


@dataclass(frozen=True)
class ModelFamily:
    model_type: str
    qk_layernorm: bool  # queries and keys normalised per head (Qwen3)
    qkv_bias_key: str | None = "attention_bias"  # config.json's switch of the q/k/v projections' biases (None: none)
    qkv_bias_default: bool = False  # their bias without that key (Qwen2: always)
    qk_layernorm_key: str | None = None  # config.json's switch of the per-head q/k norms (GLM-4.5: use_qk_norm)
    mla: bool = False  # multi-head latent attention (DeepSeek): models/mla.py
    moe: MoeSpec | None = None  # None: a dense family
    sliding_window: bool = False  # config.json's sliding_window limits every layer's attention (Mistral)
    layer_types: bool = False  # config.json's layer_types says which layers sliding_window limits (gpt-oss)
    sinks: bool = False  # a learned logit per attention head joins each softmax and takes no value (gpt-oss)
    linear_bias: bool = False  # every linear layer has a bias: attention output, router, experts (gpt-oss)
    clamped_swiglu: bool = False  # experts' GLU: clamp, x * sigmoid(swiglu_alpha x) * (up + 1) (gpt-oss)
    zero_centred_norms: bool = False  # every RMSNorm but a gated one scales by 1 + weight (Qwen3-Next)
    attention_output_gate: bool = False  # q_proj also holds a sigmoid gate per head on the attention output
    gated_delta_net: bool = False  # the layers layer_types marks linear_attention are Gated DeltaNet layers
    # (Qwen3-Next, Qwen3.5: models/linear_attention.py), their input projection stored as in_proj_packing says
    in_proj_packing: linear_attention.InProjPacking = linear_attention.QWEN3_NEXT_IN_PROJ
    moe_table: type[MoeTable] = MoeTable  # the weight table of the family's MoE models
    engine_check: Callable[[dict], None] | None = None  # ValueError where vLLM's model class computes otherwise

    @property
    def config_fields(self) -> tuple[str, ...]:
        """The config.json fields this family reads."""
        attention = tuple(key for key in (self.qkv_bias_key, self.qk_layernorm_key) if key)
        attention += MLA_FIELDS if self.mla else ()
        attention += ("sliding_window",) if self.sliding_window or self.layer_types else ("use_sliding_window",)
        attention += ("layer_types",) if self.layer_types else ()
        attention += ("swiglu_alpha", "swiglu_limit") if self.clamped_swiglu else ()
        attention += linear_attention.FIELDS if self.gated_delta_net else ()
        moe = () if self.moe is None else self.moe.config_fields
        return tuple(dict.fromkeys((*COMMON_FIELDS, *attention, *moe)))

    @property
    def expert_biases(self) -> bool:
        """Whether the routed experts have biases, which Megatron takes at expert-TP 1 only."""
        return self.moe is not None and self.linear_bias

    def window(self, hf: dict) -> int | None:
        """Positions a token attends to (itself included), None for full causal attention. Qwen2's configs carry
        a sliding_window that applies only with use_sliding_window, and then to the upper layers alone: refused."""
        if hf.get("use_sliding_window"):
            raise ValueError("use_sliding_window=true (sliding-window attention in the layers from max_window_layers "
                             "on) is not supported; Qwen's released models leave it false.")
        return hf.get("sliding_window") if self.sliding_window or self.layer_types else None

    def window_layers(self, hf: dict) -> list[bool] | None:
        """Which layers the window limits (None: every layer, where there is one). gpt-oss: config.json's
        layer_types, alternating sliding and full attention from the first layer when absent (its default)."""
        if not self.layer_types or self.window(hf) is None:
            return None
        kinds = hf.get("layer_types") or ["sliding_attention" if i % 2 == 0 else "full_attention"
                                          for i in range(hf["num_hidden_layers"])]
        unknown = sorted(set(kinds) - {"sliding_attention", "full_attention"})
        if unknown or len(kinds) != hf["num_hidden_layers"]:
            raise ValueError(f"layer_types must name sliding_attention or full_attention for each of the "
                             f"num_hidden_layers={hf['num_hidden_layers']} layers; it has {kinds}.")
        return [kind == "sliding_attention" for kind in kinds]

    def qkv_bias(self, hf: dict) -> bool:
        return bool(hf.get(self.qkv_bias_key, self.qkv_bias_default)) if self.qkv_bias_key else self.qkv_bias_default

    def qk_norm(self, hf: dict) -> bool:
        """Whether queries and keys are RMS-normalised per head (never with MLA, whose LoRA norms are its own)."""
        if self.mla:
            return False
        return bool(hf.get(self.qk_layernorm_key, self.qk_layernorm)) if self.qk_layernorm_key else self.qk_layernorm

    def experts(self, hf: dict) -> int:
        """Routed experts per layer, 0 for a dense family."""
        return self.moe.experts(hf) if self.moe is not None else 0

    def attention_fields(self, hf: dict) -> dict:
        """Megatron TransformerConfig fields of the family's attention (with MLA: MLATransformerConfig's)."""
        if self.mla:
            return mla_fields(hf)
        fields = dict(kv_channels=head_dim(hf), add_qkv_bias=self.qkv_bias(hf), qk_layernorm=self.qk_norm(hf))
        if self.sinks:
            fields["softmax_type"] = "learnable"
        if self.attention_output_gate:
            fields["attention_output_gate"] = True
        if self.gated_delta_net:
            fields.update(linear_attention.megatron_fields(hf))
        return fields

    def norm_fields(self) -> dict:
        """Megatron TransformerConfig fields of the RMSNorms (models/gated_delta_layers.py builds the zero-centred
        ones)."""
        return {"layernorm_zero_centered_gamma": True} if self.zero_centred_norms else {}

    def mlp_fields(self, hf: dict) -> dict:
        """Megatron TransformerConfig fields of the MLPs (experts included): biases, and the gated activation by
        name (models.gpt maps it to Megatron's function). gpt-oss's clamped SwiGLU is Megatron's quick_gelu GLU
        (x * sigmoid(1.702 x)) with glu_linear_offset 1 (the up projection plus one) and its clamp."""
        fields = dict(activation="silu", add_bias_linear=self.linear_bias)
        if self.clamped_swiglu:
            fields.update(activation="quick_gelu", glu_linear_offset=1.0,
                          activation_func_clamp_value=float(hf.get("swiglu_limit", 7.0)))
        return fields

    def moe_fields(self, hf: dict) -> dict:
        """Megatron TransformerConfig fields of the family's router and experts (none for a dense family)."""
        if self.moe is None:
            return {}
        return dict(num_moe_experts=self.experts(hf), moe_router_topk=hf["num_experts_per_tok"],
                    moe_ffn_hidden_size=hf[self.moe.width_key], **self.moe.router_fields(hf),
                    **self.moe.layer_fields(hf))

    def renormalises_top_k_of(self, hf: dict) -> bool:
        """Whether the router divides the top-k weights by their sum (config.json norm_topk_prob, or the family's
        default)."""
        return self.moe is not None and self.moe.renormalises(hf)

    def weight_table(self, hf: dict, padded_vocab: int, transformer_engine: bool = False) -> DenseTable:
        """The Megatron <-> HF table of exactly the parameters a model of this family has (`transformer_engine`:
        of the layers Transformer Engine builds, where they hold other parts than the local ones)."""
        qkv_bias, qk_norm = self.qkv_bias(hf) and not self.mla, self.qk_norm(hf)
        if self.moe is None:
            table = DenseTable(hf, padded_vocab, qkv_bias, qk_norm, output_gate=self.attention_output_gate)
        else:
            shared = self.moe.shared
            table = self.moe_table(hf, padded_vocab, self.moe.names, self.experts(hf), hf[self.moe.width_key], qkv_bias,
                             qk_norm, sparse_layers=self.moe.sparse_layers(hf),
                             shared=(shared.module, shared.width(hf), shared.gate) if shared and shared.width(hf)
                             else None, expert_bias=self.moe.expert_bias, output_gate=self.attention_output_gate)
        if self.mla:
            table.replace_attention(mla_entries(hf, transformer_engine))
        if self.gated_delta_net:
            table.add_linear_attention(linear_attention.table_entries(hf, self.in_proj_packing),
                                       linear_attention.linear_attention_layers(hf))
        return table

    def check(self, hf: dict, source: str) -> None:
        """What a config.json of this family must hold beyond the common fields (ConfigError naming `source`)."""
        try:
            check_rope(hf)
            self.window(hf)
            self.window_layers(hf)
            self.attention_fields(hf)
            if self.gated_delta_net:
                linear_attention.check(hf)
            if self.engine_check is not None:
                self.engine_check(hf)
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from None
        if self.moe is None:
            return
        for key in self.moe.required_fields(hf):
            value = hf.get(key)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ConfigError(f"{source} has {key}={value!r}; an MoE model needs a positive integer there.")
        try:
            self.moe_fields(hf)
        except ValueError as err:
            raise ConfigError(f"{source}: {err}") from None

    def checkpoint_fields(self, hf: dict) -> dict:
        """The family's part of what decides a model's tensors (compared when a checkpoint is loaded)."""
        fields = dict(qkv_bias=self.qkv_bias(hf), qk_layernorm=self.qk_norm(hf), num_experts=self.experts(hf))
        if self.mla:  # only where set, as below
            fields["mla"] = {key: hf.get(key) for key in MLA_FIELDS}
        if self.window(hf) is not None:  # only where set: other checkpoints keep their recorded hash
            fields["sliding_window"] = self.window(hf)
        # gpt-oss's, likewise only where set.
        if self.window_layers(hf) is not None:
            fields["window_layers"] = self.window_layers(hf)
        if self.sinks:
            fields["attention_sinks"] = True
        if self.linear_bias:
            fields["linear_bias"] = True
        if self.clamped_swiglu:
            fields["swiglu_limit"] = self.mlp_fields(hf)["activation_func_clamp_value"]
        if self.zero_centred_norms:
            fields["zero_centred_norms"] = True
        if self.attention_output_gate:
            fields["attention_output_gate"] = True
        if self.gated_delta_net:
            fields.update(linear_attention.checkpoint_fields(hf))
        if self.moe is not None:
            fields.update(expert_width=hf[self.moe.width_key], num_experts_per_tok=hf["num_experts_per_tok"])
            # Only where set, as the sliding window above.
            layer_fields = self.moe.layer_fields(hf)
            if "moe_layer_freq" in layer_fields:
                fields["sparse_layers"] = layer_fields["moe_layer_freq"]
            if "moe_shared_expert_intermediate_size" in layer_fields:
                fields["shared_expert_width"] = layer_fields["moe_shared_expert_intermediate_size"]
        return fields


FAMILIES: Registry[ModelFamily] = Registry(
    "model family", "model_type",
    "register yours with rl_megatron.models.family.register(ModelFamily({name!r}, ...)) in a module listed in "
    "trainer.imports", unique=True)


def register(family: ModelFamily) -> ModelFamily:
    """Register `family` under its model_type (once: a second record of a model_type is an error)."""
    return FAMILIES.add(family.model_type, family)


def family_of(hf: dict) -> ModelFamily:
    """The family of a config.json; ConfigError naming the registered ones when rl_megatron has none for it (or
    saying how to take the language model out of a multimodal folder)."""
    refuse_multimodal(hf)
    return FAMILIES[hf.get("model_type")]


def table_for(hf: dict, padded_vocab: int, transformer_engine: bool = False) -> DenseTable:
    return family_of(hf).weight_table(hf, padded_vocab, transformer_engine)


def moe_experts(hf: dict) -> int:
    """Routed experts per layer of a config.json's model: 0 for a dense (or unsupported) family."""
    family = FAMILIES.get(hf.get("model_type"))
    return family.experts(hf) if family is not None else 0


def needs_sequence_parallel(hf: dict) -> bool:
    """Whether Megatron trains the model at TP > 1 only with sequence parallelism: MoE layers (Megatron asserts it)
    and Gated DeltaNet layers (their gated norm's gradient is summed over the TP ranks only then)."""
    family = FAMILIES.get(hf.get("model_type"))
    return family is not None and (family.experts(hf) > 0 or family.gated_delta_net)


def family_fields(hf: dict) -> dict:
    """The family's part of a checkpoint's config fields; none for an unsupported model_type (whose checkpoint
    differs from any loadable model in model_type already)."""
    family = FAMILIES.get(hf.get("model_type"))
    return family.checkpoint_fields(hf) if family is not None else {}


# Each module of rl_megatron/models/families registers its record when imported. They import this module for
# ModelFamily and register, defined above, so the registry is complete once this module has loaded.
for _module in pkgutil.iter_modules(families.__path__):
    importlib.import_module(f"{families.__name__}.{_module.name}")
