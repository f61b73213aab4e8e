"""MoE GRPO end to end on the CPU: configs/moe/grpo_tiny_qwen3_moe_cpu.yaml (a tiny Qwen3-MoE, experts split over
the 2 workers at EP=2) with MoE knobs given as key=value overrides, as a sweep gives them."""
import glob

from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from helpers.runs import train

ROUTER_METRICS = {"moe/layer0/load_min", "moe/layer1/load_max", "moe/layer1/load_std", "moe/load_std",
                  "moe/dropped_tokens", "moe/load_balancing_loss", "moe/z_loss", "moe/layer0/z_loss"}


def test_moe_grpo_run_logs_router_metrics(tmp_path):
    """Two steps with 8 experts instead of the model folder's 4 (the engines build the same overridden model: the
    weight sync would fail otherwise, and vLLM samples with exactly the trainer's log-probs) and both router losses
    on; every step logs the router metrics to metrics.jsonl and tensorboard."""
    _, rows, run_dir = train(tmp_path, "trainer.total_steps=2", "moe.num_experts=8", "moe.aux_loss_coeff=0.01",
                             "moe.z_loss_coeff=0.001", config="moe/grpo_tiny_qwen3_moe_cpu")
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert ROUTER_METRICS <= set(row)
        assert row["actor/grad_norm"] > 0 and row["mismatch/max_abs_logprob_diff"] < 1e-5
        # The model-wide figures are those of its 2 layers: the least and most loaded expert of any layer.
        assert row["moe/load_min"] == min(row[f"moe/layer{i}/load_min"] for i in (0, 1))
        assert row["moe/load_max"] == max(row[f"moe/layer{i}/load_max"] for i in (0, 1))
        assert row["moe/dropped_tokens"] == 0
        assert row["moe/load_balancing_loss"] > 0 and row["moe/z_loss"] > 0
    events = EventAccumulator(glob.glob(f"{run_dir}/events.out.tfevents.*")[0])
    events.Reload()
    assert ROUTER_METRICS <= set(events.Tags()["scalars"])
    assert [e.step for e in events.Scalars("moe/load_std")] == [1, 2]
