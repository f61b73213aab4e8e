"""A few GRPO steps of each model family's tiny model (random weights, built locally) through the user's command:
the trainer, its vLLM engines (the weights resharded into them every step) and the scorer. The engines sample with
the trainer's own log-probs (`mismatch/*`), which holds only when both compute the same model.

The few steps are all `slow` (RL_MEGATRON_SLOW=1): in CI, tests/e2e/test_moe_train.py runs the tiny DeepSeek-V3
(latent attention, sigmoid routing with the expert bias, shared experts, a dense first layer) with the MoE knobs.
In CI a 2026 hybrid learns instead: the tiny Qwen3.5-MoE (Gated DeltaNet layers between gated full-attention ones,
experts and a gated shared expert on every layer) learns the digits demo to its target."""
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


def test_tiny_qwen3_5_moe_learns_the_digits(tmp_path):
    """The demo (TP=2, sequence parallel, the experts split over TP) with configs/models/tiny-qwen3-5-moe-digits: from
    chance to the 0.8 target (96 steps on this machine's AVX2 with torch 2.13.0), its engines computing the Gated
    DeltaNet layers in torch (rollout/cpu_gated_delta.py) with the trainer's weights synced every step, sampling with
    the trainer's own probabilities and routing every token as its routers do."""
    stdout, rows, _ = train(tmp_path, "model.path=configs/models/tiny-qwen3-5-moe-digits", "trainer.save_every=-1")
    assert "Target mean reward 0.8 reached." in stdout and len(rows) < 250 and rows[0]["reward/mean"] < 0.15
    assert max(r["mismatch/token_mult_prob_error"] for r in rows) <= 1.001
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-4
    assert min(r["moe/routing_agreement"] for r in rows) >= 0.99
