"""MoE GRPO end to end on the CPU: configs/moe/grpo_tiny_qwen3_moe_cpu.yaml's layout (experts split over the 2
workers at EP=2) with MoE knobs given as key=value overrides, as a sweep gives them, on the tiny DeepSeek-V3
(configs/models/tiny-deepseek-v3-digits: latent attention, a dense first layer, a shared expert, sigmoid routing
with the expert bias). (Each family's few GRPO steps: tests/e2e/test_family_runs.py.)"""
import glob

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.runs import train

ROUTER_METRICS = {"moe/layer1/load_min", "moe/layer1/load_max", "moe/layer1/load_std", "moe/load_std",
                  "moe/dropped_tokens", "moe/load_balancing_loss", "moe/z_loss", "moe/layer1/z_loss",
                  "moe/expert_bias_min", "moe/expert_bias_max", "moe/layer1/expert_bias_max",
                  "moe/routing_agreement", "moe/layer1/routing_agreement"}


def test_moe_grpo_run_logs_router_metrics(tmp_path):
    """Two steps with 8 experts instead of the model folder's 4 (the engines build the same overridden model: the
    weight sync would fail otherwise, and vLLM samples with exactly the trainer's log-probs), both router losses on,
    the expert bias trained and routing replay R3 (the engines' routing of every token replayed by the trainer);
    every step logs the router metrics of the routing layer (the first is dense) to metrics.jsonl and tensorboard,
    among them the trainer's agreement with the engines' routing (the same weights in fp32: all but rounding)."""
    _, rows, run_dir = train(tmp_path, "trainer.total_steps=2", "model.path=configs/models/tiny-deepseek-v3-digits",
                             "moe.num_experts=8", "moe.aux_loss_coeff=0.01", "moe.z_loss_coeff=0.001",
                             "moe.router_bias_update_rate=0.01", "actor.router_replay=R3",
                             config="moe/grpo_tiny_qwen3_moe_cpu")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert ROUTER_METRICS <= set(row) and not any(key.startswith("moe/layer0/") for key in row)
        assert row["actor/grad_norm"] > 0 and row["mismatch/max_abs_logprob_diff"] < 1e-5
        assert row["moe/load_min"] == row["moe/layer1/load_min"] and row["moe/load_max"] == row["moe/layer1/load_max"]
        assert row["moe/dropped_tokens"] == 0
        assert row["moe/routing_agreement"] == row["moe/layer1/routing_agreement"] >= 0.99
        assert row["moe/load_balancing_loss"] > 0 and row["moe/z_loss"] > 0
    # The bias starts at zero (random weights) and moves towards even loads by the rate per optimizer step (2 a
    # step here). The engines route with the synced one.
    assert 0 < rows[0]["moe/expert_bias_max"] <= 2 * 0.01 + 1e-6
    assert rows[1]["moe/expert_bias_max"] <= 4 * 0.01 + 1e-6
    events = EventAccumulator(glob.glob(f"{run_dir}/events.out.tfevents.*")[0])
    events.Reload()
    assert ROUTER_METRICS <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("moe/load_std")] == [1, 2]


def test_tiny_gpt_oss_learns_the_digits(tmp_path):
    """configs/moe/grpo_tiny_gpt_oss_cpu.yaml as a user runs it: the tiny gpt-oss (sinks, the window on its first
    layer, biased experts with the clamped SwiGLU split over the two workers) climbs from chance (0.07) to 0.6 in the
    last 5 steps (step 80 on this machine; the recipe's 0.8 at step 171, docs/benchmarks.md). The engines sample
    with the trainer's own log-probs at every step and route every token as its routers do."""
    stdout, rows, _ = train(tmp_path, "trainer.target_reward=0.6", config="moe/grpo_tiny_gpt_oss_cpu")
    assert "Target mean reward 0.6 reached" in stdout
    assert len(rows) <= 200 and rows[0]["reward/mean"] < 0.3
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-4
    assert min(r["moe/routing_agreement"] for r in rows) >= 0.99


def test_tiny_gpt_oss_on_a_separate_engine_gets_the_trainers_weights(tmp_path):
    """rollout.placement=separate: the engine in a worker of its own, sent gpt-oss's weights by broadcast at every
    step (checked bit for bit: resharding.verify), samples with the trainer's own log-probs."""
    _, rows, _ = train(tmp_path, "trainer.total_steps=3", "trainer.target_reward=null", "trainer.n_gpus_per_node=1",
                       "actor.expert_model_parallel_size=1", "rollout.placement=separate", "resharding.verify=true",
                       config="moe/grpo_tiny_gpt_oss_cpu")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-5
