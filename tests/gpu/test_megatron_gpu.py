"""One CUDA GPU, TP=1: Megatron's log-probs and a GRPO update (forward, backward, optimizer step) against Hugging
Face transformers on the same weights, with Transformer-Engine layers when TE imports (MoE experts as TE's grouped
GEMM) and Megatron's local layers otherwise. Needs torch with CUDA, megatron-core and transformers only: nothing on this path imports vLLM or Ray.

    pytest tests/gpu -m gpu -v -rA      (-rA prints which layer implementation ran)
"""
import importlib.util

import pytest
import torch

from helpers.parity import config, family_model_dir, hf_model, hf_reference, hf_update_reference, make_batch
from rl_megatron.models.tiny import LLAMA3_ROPE, QWEN2_5_YARN
from rl_megatron.workers.spawn import run_distributed

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(),
                                 reason="needs a CUDA GPU (torch.cuda.is_available() is False)")]

# Largest differences allowed from the float32 reference, per parameter dtype of the Megatron model. float32:
# Megatron's local layers match to rounding; TE may run float32 GEMMs in TF32 (10-bit mantissa), hence its looser
# bound. bfloat16 (8-bit mantissa) weights and activations: a loose bound that still catches any wrong mapping,
# which moves log-probs by O(1).
LOG_PROB_TOLERANCE = {("float32", False): 1e-4, ("float32", True): 2e-3, ("bfloat16", False): 0.1,
                      ("bfloat16", True): 0.1}
GRAD_NORM_RELATIVE_TOLERANCE = {("float32", False): 1e-4, ("float32", True): 5e-3, ("bfloat16", False): 0.02,
                                ("bfloat16", True): 0.02}


def log_probs_then_update(cfg, batch):
    """On the GPU rank: which layers the model was built from, its log-probs and entropy, then one update."""
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.models.gpt import uses_transformer_engine
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=10)
    layer = actor.chunks[0].decoder.layers[0]
    out = actor.log_probs(batch)
    metrics = actor.update(batch)
    # A routing layer's experts: DeepSeek's and GLM-4.5's first layers are dense.
    experts = next((routed.mlp.experts for routed in actor.chunks[0].decoder.layers if hasattr(routed.mlp, "experts")),
                   None)
    return {"uses_transformer_engine": uses_transformer_engine(),
            "attention_module": type(layer.self_attention.linear_proj).__module__,
            "experts_class": type(experts).__name__ if experts is not None else None,
            "device": str(next(layer.parameters()).device), "metrics": metrics, **out.tensors()}


TE_INSTALLED = importlib.util.find_spec("transformer_engine") is not None


MOE_FAMILIES = ("qwen3_moe", "mixtral", "qwen2_moe", "deepseek_v2", "deepseek_v3", "glm4_moe", "gpt_oss",
                "qwen3_next", "qwen3_5_moe_text")
# The Gated DeltaNet hybrids: fla's kernels where fla imports, else the torch delta rule (models/gated_delta.py); they
# refuse Transformer Engine layers (docs/model-families.md).
HYBRID_FAMILIES = ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")


# qwen2: QKV biases, separate output layer (and Qwen2.5's YaRN); qwen3: QK-norm, tied embeddings; Llama 3.1's rope
# scaling; Mistral's sliding window (TE's window_size); the MoE families (float32 only: in bfloat16 near-tied router
# scores may pick other experts than transformers does) with TE's grouped GEMM (TEGroupedMLP, moe.grouped_gemm)
# when TE is installed: DeepSeek's latent attention (TE keeps its down projections whole), sigmoid routers with the
# expert bias, shared experts, dense first layers; GLM-4.5's partial rotary; gpt-oss's sinks (TE's learnable softmax
# offset), windows on every other layer, biased experts and clamped SwiGLU (not yet run on a GPU: docs/gpu.md); the
# Gated DeltaNet hybrids (Qwen3-Next, Qwen3.5 dense and MoE).
@pytest.mark.parametrize("family,tied,dtype,extra", [(family, tied, dtype, {}) for family, tied in (("qwen2", False),
                                                                                                  ("qwen3", True))
                                                     for dtype in ("float32", "bfloat16")]
                         + [("qwen2", False, "float32", QWEN2_5_YARN), ("llama", True, "float32", LLAMA3_ROPE),
                            ("mistral", False, "float32", {"sliding_window": 4})]
                         + [(family, False, "float32", {}) for family in (*MOE_FAMILIES, "qwen3_5_text")])
def test_log_probs_and_update_match_transformers(tmp_path, family, tied, dtype, extra):
    if family in HYBRID_FAMILIES and TE_INSTALLED:
        pytest.skip("the Gated DeltaNet hybrids refuse Transformer Engine layers: run without transformer_engine")
    model_dir = family_model_dir(tmp_path / family, family, tied, **extra)
    moe = family in MOE_FAMILIES
    # 4 prompts x 2 samples per mini-batch: the whole batch of 8, so the update is one optimizer step on it.
    cfg = config(model_dir, 1, 1, **{"model.dtype": dtype, **({"moe.grouped_gemm": TE_INSTALLED} if moe else {})})
    batch = make_batch(18)
    ref_log_probs, ref_entropy, _ = hf_reference(model_dir, batch, cfg.rollout.temperature)
    # The reference's log-probs are the update's old log-probs on both sides: both then compute the same loss.
    batch.old_log_probs = ref_log_probs
    result = run_distributed(log_probs_then_update, 1, args=(cfg, batch))[0]

    te = result["uses_transformer_engine"]
    print(f"layers: {'Transformer Engine' if te else 'Megatron local'} ({result['attention_module']}), "
          f"device {result['device']}, dtype {dtype}")
    assert result["device"].startswith("cuda")
    # TE layers exactly when TE is installed (an installed TE that fails to import fails here, not silently).
    assert te == TE_INSTALLED
    assert ("transformer_engine" in result["attention_module"]) == te
    if moe:
        assert result["experts_class"] == ("TEGroupedMLP" if te else "SequentialMLP")

    mask = batch.response_mask.bool()
    tolerance = LOG_PROB_TOLERANCE[dtype, te]
    assert (result["log_probs"][mask] - ref_log_probs[mask]).abs().max() <= tolerance
    assert (result["entropy"][mask] - ref_entropy[mask]).abs().max() <= tolerance

    ref_loss, ref_grad_norm = hf_update_reference(hf_model(model_dir), batch, cfg)
    metrics = result["metrics"]
    assert metrics["actor/pg_loss"] == pytest.approx(ref_loss, abs=tolerance)
    assert metrics["actor/grad_norm"] == pytest.approx(ref_grad_norm, rel=GRAD_NORM_RELATIVE_TOLERANCE[dtype, te])
