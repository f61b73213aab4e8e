"""A few GRPO steps of each model family's tiny model (random weights, built locally) through the user's command:
the trainer, its vLLM engines (the weights resharded into them every step) and the scorer. The engines sample with
the trainer's own log-probs (`mismatch/*`), which holds only when both compute the same model.

All `slow` (RL_MEGATRON_SLOW=1): in CI, tests/e2e/test_moe_train.py runs the tiny DeepSeek-V3 (latent attention,
sigmoid routing with the expert bias, shared experts, a dense first layer) with the MoE knobs."""
import pytest
from helpers.parity import family_model_dir
from helpers.runs import train

from rl_megatron.models.tiny import LLAMA3_ROPE

# MoE families run configs/moe/grpo_tiny_qwen3_moe_cpu.yaml's layout (experts split over the 2 workers), dense ones
# the demo's (TP=2).
MOE_RECIPE = "moe/grpo_tiny_qwen3_moe_cpu"


@pytest.mark.parametrize("family,extra,recipe", [
    pytest.param("deepseek_v3", {}, MOE_RECIPE, marks=pytest.mark.slow),  # the expert bias trained
    pytest.param("deepseek_v2", {}, MOE_RECIPE, marks=pytest.mark.slow),
    pytest.param("glm4_moe", {}, MOE_RECIPE, marks=pytest.mark.slow),
    pytest.param("qwen2_moe", {"mlp_only_layers": [0]}, MOE_RECIPE, marks=pytest.mark.slow),
    pytest.param("llama", LLAMA3_ROPE, "demo_cpu", marks=pytest.mark.slow),
    pytest.param("mistral", {"sliding_window": 4}, "demo_cpu", marks=pytest.mark.slow),
    # Qwen3-Next at the demo's TP=2 (sequence parallel): its engines' Gated DeltaNet layers computed in torch.
    pytest.param("qwen3_next", {}, "demo_cpu", marks=pytest.mark.slow),
])
def test_grpo_steps_on_each_family(tmp_path, family, extra, recipe):
    model_dir = family_model_dir(tmp_path / family, family, tied=False, **extra)
    bias_rate = ("moe.router_bias_update_rate=0.01",) if family == "deepseek_v3" else ()
    _, rows, _ = train(tmp_path / "run", f"model.path={model_dir}", "model.random_init=false", "trainer.total_steps=3",
                       "trainer.target_reward=null", "trainer.save_every=-1", *bias_rate, config=recipe)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["actor/grad_norm"] > 0
        assert row["mismatch/max_abs_logprob_diff"] < 1e-4, row["mismatch/max_abs_logprob_diff"]
    if recipe == MOE_RECIPE:  # router metrics of the routing layers only: the first layer is dense in each
        assert "moe/layer1/load_max" in rows[0] and "moe/layer0/load_max" not in rows[0]
    # The expert bias: it moves towards even loads at the rate set, and is frozen by default. The engines route with
    # the synced bias: the mismatch above stays at rounding.
    if family == "deepseek_v3":
        assert rows[0]["moe/expert_bias_max"] != rows[-1]["moe/expert_bias_max"]
    elif family == "glm4_moe":
        assert rows[0]["moe/expert_bias_max"] == rows[-1]["moe/expert_bias_max"] > 0
