"""Megatron GPTModel built from a Hugging Face config.json, and HF weights loaded into its TP/PP shards."""
from __future__ import annotations

import itertools
import json
import os

import torch
import torch.nn.functional as F
from megatron.core import parallel_state, tensor_parallel
from megatron.core.fusions.fused_bias_geglu import quick_gelu
from megatron.core.models.gpt import GPTModel
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig

from rl_megatron import platform
from rl_megatron.platform import megatron_fixes
from rl_megatron.config.schema import MoeConfig
from rl_megatron.models.activations import ActivationSettings
from rl_megatron.models.family import family_of, head_dim, needs_sequence_parallel, table_for
from rl_megatron.models.gated_delta_layers import hybrid_block
from rl_megatron.models import mxfp4
from rl_megatron.models.hf_weights import INDEX_FILE
from rl_megatron.models.lora import is_adapter_parameter
from rl_megatron.models.packed_attention import LatentDotProductAttention, PackedDotProductAttention
from rl_megatron.models.pipeline_stages import StageLayers
from rl_megatron.models.rotary import partial_rotary_factor, rotary_of
from rl_megatron.models.weight_layouts import shard_from_hf
from rl_megatron.models.weight_tables import DenseTable, padded_vocab_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def eager_quick_gelu(y: torch.Tensor) -> torch.Tensor:
    """Megatron's quick_gelu, uncompiled: Megatron wraps it in torch.compile, which on the CPU builds a C++ kernel
    in every process (about 2 s) for one multiply."""
    return y * torch.sigmoid(1.702 * y)


def activation_function(name: str):
    """The gated MLPs' activation by the name a family's mlp_fields gives; quick_gelu is Megatron's own on CUDA,
    which its fused kernels recognise."""
    if name == "quick_gelu":
        return quick_gelu if platform.has_cuda() else eager_quick_gelu
    return {"silu": F.silu}[name]


def token_dispatcher(moe: MoeConfig) -> str:
    """Megatron's token dispatcher for moe.token_dispatcher: all-to-all on GPU, all-gather on the CPU, where
    megatron-core 0.16's all-to-all dispatcher needs CUDA streams."""
    if moe.token_dispatcher is None:
        return "alltoall" if platform.has_cuda() else "allgather"
    if moe.token_dispatcher == "alltoall" and not platform.has_cuda():
        raise ValueError("moe.token_dispatcher=alltoall needs CUDA (megatron-core's all-to-all dispatcher runs on "
                         "CUDA streams); on the CPU use moe.token_dispatcher=allgather (or leave it unset).")
    return moe.token_dispatcher


def grouped_gemm(moe: MoeConfig) -> bool:
    """moe.grouped_gemm: the experts of a layer as one Transformer-Engine grouped GEMM (TEGroupedMLP), which
    exists only where models are built from TE layers."""
    if moe.grouped_gemm and not uses_transformer_engine():
        raise ValueError("moe.grouped_gemm=true needs Transformer Engine on a CUDA device (TEGroupedMLP); here "
                         "models are built from Megatron's local layers: set moe.grouped_gemm=false.")
    return moe.grouped_gemm


def moe_settings(hf: dict, moe: MoeConfig | None = None) -> dict:
    """Megatron's MoE fields for an MoE config.json (none for a dense model): the family's router and experts
    (the expert count and top-k are config.json's, which `models.hf_config.model_config` overrides) with the `moe`
    section's knobs."""
    family = family_of(hf)
    if not family.experts(hf):
        return {}
    moe = moe or MoeConfig()
    return dict(
        **family.moe_fields(hf),
        # By default no load-balancing loss: RL post-training keeps the pretrained router objective-free.
        moe_router_load_balancing_type="aux_loss" if moe.aux_loss_coeff > 0 else "none",
        moe_aux_loss_coeff=moe.aux_loss_coeff,
        moe_z_loss_coeff=moe.z_loss_coeff or None,
        moe_expert_capacity_factor=moe.capacity_factor,
        moe_token_drop_policy=moe.token_drop_policy,
        # Sigmoid routers (DeepSeek-V3, GLM-4.5) score in fp32 in transformers and vLLM: the same by default here.
        moe_router_dtype=moe.router_dtype or ("fp32" if family.moe.score_function_of(hf) == "sigmoid" else None),
        moe_router_bias_update_rate=moe.router_bias_update_rate,
        moe_token_dispatcher_type=token_dispatcher(moe),
        # One linear layer per expert (SequentialMLP: local_experts.<j>.linear_fc1.weight) unless moe.grouped_gemm
        # (TEGroupedMLP: linear_fc1.weight<j>); the weight table maps both names to the same HF tensors.
        moe_grouped_gemm=grouped_gemm(moe),
    )


def initialization(has_cuda: bool, weights_follow: bool) -> dict:
    """How Megatron initialises the parameters it builds. Random weights are made whole on the host from the seed
    and then sliced, so that every layout starts from the same model. When weights are loaded right after (an HF
    folder, a checkpoint, a copy of the actor), a GPU builds the parameters on the device and leaves them
    uninitialised: no pass over the whole model on the host per rank at start (as verl builds its Megatron models).
    CPU keeps the host initialisation either way (the device is the host)."""
    if has_cuda and weights_follow:
        return {"use_cpu_initialization": False, "perform_initialization": False}
    return {"use_cpu_initialization": True, "perform_initialization": True}


def transformer_config(hf: dict, tp: int, pp: int, dtype: str, ep: int = 1, etp: int | None = None,
                       moe: MoeConfig | None = None, weights_follow: bool = False,
                       activations: ActivationSettings = ActivationSettings(),
                       stages: StageLayers = StageLayers(), deterministic: bool = False) -> TransformerConfig:
    """`deterministic`: trainer.deterministic (rl_megatron/platform/determinism.py)."""
    heads = hf["num_attention_heads"]
    torch_dtype = DTYPES[dtype]
    family, mlp = family_of(hf), mlp_fields(hf)
    return (MLATransformerConfig if family.mla else TransformerConfig)(
        num_layers=hf["num_hidden_layers"],
        hidden_size=hf["hidden_size"],
        ffn_hidden_size=hf.get("intermediate_size"),  # none where every layer routes (Qwen3.5-MoE)
        num_attention_heads=heads,
        num_query_groups=hf.get("num_key_value_heads") or heads,
        **({} if family.mla else position_fields(hf)),  # MLA layers hold their own rotary embedding
        normalization="RMSNorm",
        **family.norm_fields(),
        layernorm_epsilon=hf.get("rms_norm_eps", 1e-6),
        gated_linear_unit=True,
        **mlp,
        **family.attention_fields(hf),
        hidden_dropout=0.0,
        attention_dropout=0.0,
        # TE's fused RoPE takes packed rows without reading their bounds back (Megatron's unfused THD RoPE does,
        # twice a layer); without TE, models/packed_attention.py's sync-free RoPE runs. MLA keeps the unfused one.
        apply_rope_fusion=uses_transformer_engine() and not family.mla,
        tensor_model_parallel_size=tp,
        # Sequence parallelism and recomputation (MoE and Gated DeltaNet layers train at TP > 1 only with sequence
        # parallelism, which is on there unless actor.sequence_parallel=false, refused then by preflight).
        **activations.transformer_config_fields(tp, swiglu=mlp["activation_func"] is F.silu,
                                                needs_sequence_parallel=needs_sequence_parallel(hf)),
        pipeline_model_parallel_size=pp,
        **stages.transformer_config_fields(),  # uneven first / last stages (models/pipeline_stages.py)
        expert_model_parallel_size=ep,
        expert_tensor_parallel_size=etp,  # None: the TP size
        params_dtype=torch_dtype,
        pipeline_dtype=torch_dtype,
        bf16=torch_dtype == torch.bfloat16,
        **initialization(platform.has_cuda(), weights_follow),
        # The training step passes the loss itself to the schedule (no per-token reduction inside Megatron).
        calculate_per_token_loss=False,
        # Embedding lookups by indexing, whose backward sums in order (F.embedding's adds with atomics on GPU).
        deterministic_mode=deterministic,
        **moe_settings(hf, moe),
    )


def mlp_fields(hf: dict) -> dict:
    """Megatron TransformerConfig fields of the family's MLPs (models/family.py), with the activation's function."""
    fields = family_of(hf).mlp_fields(hf)
    return dict(fields, activation_func=activation_function(fields.pop("activation")))


def position_fields(hf: dict) -> dict:
    """Megatron TransformerConfig fields of the model's rotary embedding and attention window. YaRN scales cos and
    sin by its attention factor m, on queries and keys alike: with every dimension rotated that is the softmax
    scale m^2 / sqrt(head_dim), which every attention kernel takes."""
    rotary, fields = rotary_of(hf, head_dim(hf)), {}
    if rotary.attention_factor != 1.0:
        if partial_rotary_factor(hf) != 1.0:
            raise ValueError(f"config.json combines YaRN (attention factor {rotary.attention_factor}) with "
                             f"partial_rotary_factor={partial_rotary_factor(hf)}, which is not supported.")
        fields["softmax_scale"] = rotary.attention_factor ** 2 / head_dim(hf) ** 0.5
    window = family_of(hf).window(hf)
    if window is not None:
        # HF's window counts the token itself: W positions, this one and the W - 1 before it.
        fields["window_size"] = (window - 1, 0)
        layers = family_of(hf).window_layers(hf)
        if layers is not None:  # Megatron's list form: 1 where the layer's attention is windowed
            fields["window_attn_skip_freq"] = [int(windowed) for windowed in layers]
    return fields


def uses_transformer_engine() -> bool:
    """Whether models are built from Transformer-Engine layers: on a CUDA device when TE imports (TE's kernels
    need CUDA, so a CPU run keeps Megatron's local layers even where TE happens to be installed)."""
    from megatron.core.models.gpt import gpt_layer_specs

    # Megatron sets HAVE_TE by importing transformer_engine and its own TE extension: the same test its TE spec
    # relies on, so the two never disagree.
    return platform.has_cuda() and gpt_layer_specs.HAVE_TE


def layer_spec(config: TransformerConfig, vp_stage: int):
    """The layers of model chunk `vp_stage` of this rank's stage: Transformer-Engine specs on GPU when TE imports,
    Megatron's local ones otherwise; dense or MoE per layer (config.moe_layer_freq), as Megatron-LM builds GPT
    models. All name their parameters so that one weight table maps any of them (TE's fused norms and grouped
    experts are aliases)."""
    from megatron.core.models.gpt import gpt_layer_specs

    te = uses_transformer_engine()
    block = gpt_layer_specs.get_gpt_decoder_block_spec(config, use_transformer_engine=te, normalization="RMSNorm",
                                                       vp_stage=vp_stage)
    if not te:
        attention = LatentDotProductAttention if config.multi_latent_attention else PackedDotProductAttention
        for spec in block.layer_specs:  # packed rows and sliding windows; untouched otherwise
            spec.submodules.self_attention.submodules.core_attention = attention
    if config.experimental_attention_variant == "gated_delta_net" or config.layernorm_zero_centered_gamma:
        if te:
            raise ValueError("Hybrid models (Gated DeltaNet layers, zero-centred norms: Qwen3-Next) are built from "
                             "Megatron's local layers only so far; Transformer Engine's layers are not wired for "
                             "them: run them in an environment without transformer_engine.")
        block = hybrid_block(block, config, vp_stage)
    return block


class ValueHead(torch.nn.Module):
    """The critic's output layer: one scalar per position from the final hidden state, whole on every TP rank
    (a scalar cannot be split over TP). Initialised from its own seed, so every rank and layout starts alike."""

    def __init__(self, config: TransformerConfig, seed: int):
        super().__init__()
        self.sequence_parallel = config.sequence_parallel
        # Named like the vocabulary output layer's parameters (output_layer.weight/.bias), which Megatron's
        # checkpointing expects of a GPTModel's last stage.
        self.weight = torch.nn.Parameter(torch.empty(1, config.hidden_size, dtype=config.params_dtype))
        self.bias = torch.nn.Parameter(torch.zeros(1, dtype=config.params_dtype))
        with torch.no_grad():
            self.weight.normal_(std=config.init_method_std, generator=torch.Generator().manual_seed(seed))

    def forward(self, hidden_states: torch.Tensor, weight=None, runtime_gather_output=None):
        """Called as GPTModel calls its vocabulary output layer: [s, b, h] -> ([s, b, 1], no bias)."""
        if self.sequence_parallel:
            # Each rank needs every position; in the backward pass each keeps its own positions' gradient (the
            # head's computation is whole on every rank, so no sum over ranks).
            hidden_states = tensor_parallel.gather_from_sequence_parallel_region(
                hidden_states, tensor_parallel_output_grad=False)
        return F.linear(hidden_states, self.weight, self.bias), None


def build_gpt(hf: dict, dtype: str, make_vocab_size_divisible_by: int, vp_stage: int = 0,
              value_head_seed: int | None = None, moe: MoeConfig | None = None,
              weights_follow: bool = False, activations: ActivationSettings = ActivationSettings(),
              stages: StageLayers = StageLayers(), deterministic: bool = False) -> GPTModel:
    """Model chunk `vp_stage` of this rank's shard of the model (parallel_state must be initialised); with
    `value_head_seed`, the critic: the same trunk with a `ValueHead` instead of the vocabulary output. `moe`: the
    config's MoE knobs (defaults without). `weights_follow`: the caller loads every weight next (`initialization`).
    `activations`: the role's sequence parallelism and recomputation (default: Megatron's, at this rank's TP).
    `stages`: the layers of the first / last pipeline stage (default: an even split). `deterministic`:
    trainer.deterministic."""
    tp = parallel_state.get_tensor_model_parallel_world_size()
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    config = transformer_config(hf, tp, pp, dtype, ep=parallel_state.get_expert_model_parallel_world_size(),
                                etp=parallel_state.get_expert_tensor_parallel_world_size(), moe=moe,
                                weights_follow=weights_follow, activations=activations, stages=stages,
                                deterministic=deterministic)
    context = parallel_state.get_context_parallel_world_size()
    if context > 1 and not uses_transformer_engine():
        raise ValueError(f"actor.context_parallel_size={context} needs Transformer Engine's attention on a CUDA device "
                         "(context-parallel attention passes key/value chunks between the CP ranks inside TE's kernels;"
                         " Megatron's local attention cannot): set actor.context_parallel_size=1 here.")
    config.context_parallel_size = context
    # Megatron reads the chunk count from the config when it splits the layers (None: no interleaving).
    vpp = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    config.virtual_pipeline_model_parallel_size = vpp
    # The interleaved schedule's default batched exchange sends activations and gradients to the same peer at
    # PP=2, where they pair up crosswise (Megatron-LM issue #1450). Separate forward and backward transfers (the
    # setting Megatron-LM itself uses with interleaving) keep them apart; the plain 1F1B schedule rejects them.
    config.overlap_p2p_comm = vpp is not None
    config.batch_p2p_comm = vpp is None
    # Micro-batches vary in shape (token budgets, packing): stages exchange each activation's shape first. Megatron
    # refuses that with MoE's all-gather dispatcher, so such models run a pass's micro-batches in one shape instead
    # (workers/megatron_model.py).
    config.variable_seq_lengths = pp > 1 and not (config.num_moe_experts
                                                 and config.moe_token_dispatcher_type == "allgather")
    model = GPTModel(
        config=config,
        transformer_layer_spec=layer_spec(config, vp_stage),
        vocab_size=padded_vocab_size(hf["vocab_size"], make_vocab_size_divisible_by, tp),
        max_sequence_length=hf.get("max_position_embeddings", 4096),
        pre_process=parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        post_process=parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_output=True,  # logits stay split over the vocabulary; log-probs never gather them
        share_embeddings_and_output_weights=bool(hf.get("tie_word_embeddings")) and value_head_seed is None,
        position_embedding_type="rope",
        rotary_percent=partial_rotary_factor(hf),
        vp_stage=vp_stage,
    )
    if not config.multi_latent_attention:  # the rope type's frequencies (models/rotary.py) for Megatron's plain ones
        rotary = model.rotary_pos_emb
        rotary.inv_freq = rotary_of(hf, config.kv_channels).inv_freq.to(rotary.inv_freq.device)
    if value_head_seed is not None and model.post_process:
        model.output_layer = ValueHead(config, value_head_seed)
    model = model.to(DTYPES[dtype])
    megatron_fixes.fix_expert_biases(model)
    for module in model.modules():  # the expert biases stay in fp32, as Megatron updates and applies them
        if getattr(module, "expert_bias", None) is not None:
            module.expert_bias.data = module.expert_bias.data.float()
    return model


def build_gpt_chunks(hf: dict, dtype: str, make_vocab_size_divisible_by: int,
                     value_head_seed: int | None = None, moe: MoeConfig | None = None,
                     weights_follow: bool = False,
                     activations: ActivationSettings = ActivationSettings(),
                     stages: StageLayers = StageLayers(), deterministic: bool = False) -> list[GPTModel]:
    """This rank's model chunks in virtual-pipeline order (one without interleaving)."""
    chunks = parallel_state.get_virtual_pipeline_model_parallel_world_size() or 1
    return [build_gpt(hf, dtype, make_vocab_size_divisible_by, vp_stage, value_head_seed, moe, weights_follow,
                      activations, stages, deterministic) for vp_stage in range(chunks)]


def hf_parameters(model: GPTModel):
    """(name, parameter) of everything that has a Hugging Face counterpart in the model's weights: all but a
    critic's value head and LoRA adapters."""
    critic = isinstance(getattr(model, "output_layer", None), ValueHead)
    parameters = ((name, param) for name, param in model.named_parameters()
                  if not (critic and name.startswith("output_layer.")) and not is_adapter_parameter(name))
    # The routers' expert biases (aux-loss-free balancing) are buffers, updated outside the optimizer.
    return itertools.chain(parameters, ((name, buffer) for name, buffer in model.named_buffers()
                                        if name.endswith(".router.expert_bias")))


def weight_table(model: GPTModel, hf: dict) -> DenseTable:
    return table_for(hf, model.vocab_size, uses_transformer_engine())


def layer_offset(model: GPTModel) -> int:
    """Global index of this model chunk's first layer (Megatron numbers a chunk's layers globally, from 1)."""
    layers = model.decoder.layers
    return layers[0].layer_number - 1 if len(layers) else 0


def tp_shard(name: str) -> tuple[int, int]:
    """(rank, size) of the tensor-parallel split of parameter `name`: routed experts split over their own
    expert-TP group (actor.expert_tensor_parallel_size), everything else over the TP group."""
    if name.startswith("decoder.layers.") and ".mlp.experts." in name:
        return parallel_state.get_expert_tensor_parallel_rank(), parallel_state.get_expert_tensor_parallel_world_size()
    return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_tensor_model_parallel_world_size()


def expert_offset(model: GPTModel) -> int:
    """Global index of this rank's first routed expert (Megatron numbers a rank's experts from 0)."""
    per_rank = (model.config.num_moe_experts or 0) // parallel_state.get_expert_model_parallel_world_size()
    return parallel_state.get_expert_model_parallel_rank() * per_rank


class SafetensorsReader:
    """Reads single tensors from a folder of *.safetensors files without loading the whole model."""

    def __init__(self, folder: str):
        from safetensors import safe_open

        index_file = os.path.join(folder, INDEX_FILE)
        if os.path.isfile(index_file):
            with open(index_file) as f:
                weight_map = json.load(f)["weight_map"]
        else:
            files = sorted(f for f in os.listdir(folder) if f.endswith(".safetensors"))
            if not files:
                raise FileNotFoundError(
                    f"No *.safetensors weights in '{folder}'. Convert the model to safetensors, or set "
                    "model.random_init=true to start from random weights.")
            weight_map = {}
            for name in files:
                with safe_open(os.path.join(folder, name), framework="pt") as handle:
                    weight_map.update({key: name for key in handle.keys()})
        self.folder, self.weight_map = folder, weight_map
        self._open = {}

    def get(self, name: str, expert: int | None = None) -> torch.Tensor:
        """Tensor `name` (with `expert`: only its slice `[expert]`, the one expert of a stacked tensor a rank needs,
        read alone); one the folder stores in MXFP4 (`name`_blocks and `name`_scales: gpt-oss's experts as
        released) dequantized, to bf16 (models/mxfp4.py)."""
        from safetensors import safe_open

        if name not in self.weight_map and mxfp4.packed_names(name).blocks in self.weight_map:
            # Dequantized with the expert's leading dimension kept: [1, ...] in, [1, ...] out.
            part = self.get if expert is None else (lambda packed: self.get(packed, expert).unsqueeze(0))
            tensor = mxfp4.read_dequantized(name, self.weight_map, part, self.folder)
            return tensor if expert is None else tensor[0]
        if name not in self.weight_map:
            raise KeyError(f"Tensor '{name}' is not in the safetensors of '{self.folder}'; "
                           "does model.path hold the model its config.json describes?")
        file = self.weight_map[name]
        if file not in self._open:
            self._open[file] = safe_open(os.path.join(self.folder, file), framework="pt")
        return self._open[file].get_tensor(name) if expert is None else self._open[file].get_slice(name)[expert]


@torch.no_grad()
def load_hf_weights(model: GPTModel, hf: dict, folder: str) -> None:
    """Copy the HF weights into this rank's TP/PP shard of `model`, checking every shape."""
    table = weight_table(model, hf)
    read = table.stored_reader(SafetensorsReader(folder).get)
    offset, experts = layer_offset(model), expert_offset(model)
    for name, param in hf_parameters(model):
        entry = table.lookup(name, offset, experts)
        shard = shard_from_hf(entry, [read(n) for n in entry.hf_names], *tp_shard(name))
        if shard.shape != param.shape:
            raise ValueError(f"Parameter '{name}' (from {', '.join(entry.hf_names)}) has shape "
                             f"{tuple(shard.shape)} in the checkpoint but {tuple(param.shape)} in the model.")
        param.copy_(shard)
