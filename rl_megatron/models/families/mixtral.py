"""Mixtral: Llama's attention; every layer's MLP is a router over routed experts (w1/w3/w2) whose top-k weights
are always renormalised."""
from rl_megatron.models.family import ModelFamily, register
from rl_megatron.models.moe import MoeSpec
from rl_megatron.models.weight_tables import ExpertNames

FAMILY = register(ModelFamily(
    "mixtral", qk_layernorm=False,
    moe=MoeSpec(ExpertNames(block="block_sparse_moe", gate="w1", up="w3", down="w2"),
                width_key="intermediate_size", renormalises_top_k=True)))
