"""An MoE family's router and experts, as one `MoeSpec` of its `ModelFamily` record: the HF names of its routed and
shared experts, which layers route (the others keep a dense MLP), and how its config.json's router settings map to
Megatron's router (score function, top-k renormalisation, scaling, group-limited routing, expert bias).

Each mapping is exact: where transformers computes something Megatron's router cannot, the config is refused with
the field that makes the difference.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from rl_megatron.models.weight_tables import ExpertNames


def every_layer(hf: dict) -> list[bool]:
    return [True] * hf["num_hidden_layers"]


def qwen_sparse_layers(hf: dict) -> list[bool]:
    """Qwen-MoE: a layer routes unless listed in mlp_only_layers, and only every decoder_sparse_step-th layer."""
    dense, step = set(hf.get("mlp_only_layers") or []), hf.get("decoder_sparse_step") or 1
    return [i not in dense and (i + 1) % step == 0 for i in range(hf["num_hidden_layers"])]


def first_k_dense_layers(hf: dict) -> list[bool]:
    """DeepSeek, GLM-4.5: the first first_k_dense_replace layers keep a dense MLP; after them every
    moe_layer_freq-th layer routes (DeepSeek-V2's key; 1 elsewhere)."""
    first, freq = hf.get("first_k_dense_replace") or 0, hf.get("moe_layer_freq") or 1
    return [i >= first and i % freq == 0 for i in range(hf["num_hidden_layers"])]


@dataclass(frozen=True)
class SharedExperts:
    """Experts every token goes through, run as one MLP beside the routed ones."""

    module: str  # HF name of the shared MLP within the layer's MoE block
    width_key: str  # config.json key of its width (of one shared expert, with count_key)
    count_key: str | None = None  # DeepSeek, GLM: n_shared_experts experts of that width, fused into one MLP
    gate: str | None = None  # Qwen2-MoE: the sigmoid gate (a [1, hidden] linear) that scales the shared output

    def width(self, hf: dict) -> int:
        """The shared MLP's width, 0 when the config has none."""
        width = hf.get(self.width_key) or 0
        return width * (hf.get(self.count_key) or 0) if self.count_key else width


@dataclass(frozen=True)
class MoeSpec:
    """An MoE family's experts and router: their HF names, where config.json gives an expert's width, which layers
    route, and the router's defaults (config.json's scoring_func and norm_topk_prob override them)."""

    names: ExpertNames
    width_key: str  # config.json key of a routed expert's hidden width
    renormalises_top_k: bool  # default of norm_topk_prob: the top-k weights divided by their sum
    sparse_layers: Callable[[dict], list[bool]] = every_layer  # which layers route (the others: a dense MLP)
    shared: SharedExperts | None = None
    score_function: str = "softmax"  # default of config.json's scoring_func
    expert_bias: bool = False  # the router adds a per-expert bias to its scores when choosing (DeepSeek-V3's
    # aux-loss-free balancing: HF's gate.e_score_correction_bias)

    def required_fields(self, hf: dict) -> tuple[str, ...]:
        # Qwen's configs say num_experts; transformers >= 5 writes num_local_experts; DeepSeek n_routed_experts.
        count = next((key for key in ("num_experts", "n_routed_experts") if key in hf), "num_local_experts")
        return count, "num_experts_per_tok", self.width_key

    @property
    def config_fields(self) -> tuple[str, ...]:
        shared = () if self.shared is None else tuple(k for k in (self.shared.width_key, self.shared.count_key) if k)
        return ("num_experts", "num_local_experts", "n_routed_experts", "num_experts_per_tok", self.width_key,
                "norm_topk_prob", "scoring_func", "routed_scaling_factor", "n_group", "topk_group", "topk_method",
                "mlp_only_layers", "decoder_sparse_step", "first_k_dense_replace", "moe_layer_freq", *shared)

    def experts(self, hf: dict) -> int:
        return hf[self.required_fields(hf)[0]]

    def renormalises(self, hf: dict) -> bool:
        return bool(hf.get("norm_topk_prob", self.renormalises_top_k))

    def score_function_of(self, hf: dict) -> str:
        return hf.get("scoring_func") or self.score_function

    def router_fields(self, hf: dict) -> dict:
        """Megatron's router settings for this config (ValueError naming the field where Megatron's router would
        compute something else than transformers')."""
        score, renormalise, top_k = self.score_function_of(hf), self.renormalises(hf), hf["num_experts_per_tok"]
        fields = dict(moe_router_score_function=score)
        if score == "softmax":
            # transformers (and vLLM) route with softmax over all experts, then top-k, then with norm_topk_prob
            # divide the k weights by their sum. Megatron's pre-softmax router is softmax then top-k; its default
            # router is softmax over the top-k logits, which is the renormalised form.
            fields["moe_router_pre_softmax"] = not renormalise
        elif score == "sigmoid":
            if not renormalise and top_k > 1:  # Megatron divides sigmoid top-k weights by their sum, always
                raise ValueError("sigmoid routing with norm_topk_prob=false is not supported (Megatron renormalises "
                                 "the top-k sigmoid weights).")
        else:
            raise ValueError(f"scoring_func='{score}' is not supported (softmax or sigmoid).")
        scale = hf.get("routed_scaling_factor") or 1.0
        if scale != 1.0:
            fields["moe_router_topk_scaling_factor"] = float(scale)
        groups, chosen = hf.get("n_group") or 1, hf.get("topk_group") or 1
        if groups > 1 and chosen < groups:
            # A group's score: DeepSeek-V2's group_limited_greedy takes its best expert's, DeepSeek-V3 (and GLM)
            # the sum of its best two; Megatron sums its best top_k / topk_group.
            per_group = 1 if hf.get("topk_method") == "group_limited_greedy" else 2
            if top_k % chosen or top_k // chosen != per_group:
                raise ValueError(f"group-limited routing with num_experts_per_tok={top_k}, topk_group={chosen} and "
                                 f"topk_method={hf.get('topk_method')!r} scores groups unlike Megatron (the best "
                                 f"num_experts_per_tok / topk_group experts of a group); not supported.")
            fields.update(moe_router_num_groups=groups, moe_router_group_topk=chosen)
        if self.expert_bias:
            fields["moe_router_enable_expert_bias"] = True
        return fields

    def layer_fields(self, hf: dict) -> dict:
        """Megatron's fields of the shared experts and of which layers route."""
        fields = {}
        sparse = self.sparse_layers(hf)
        if not any(sparse):
            raise ValueError("no layer routes over the experts (mlp_only_layers / decoder_sparse_step / "
                             "first_k_dense_replace leave every layer dense); use the model's dense family.")
        if not all(sparse):
            fields["moe_layer_freq"] = [int(s) for s in sparse]
        width = self.shared.width(hf) if self.shared else 0
        if width:
            fields.update(moe_shared_expert_intermediate_size=width, moe_shared_expert_gate=bool(self.shared.gate))
        return fields
