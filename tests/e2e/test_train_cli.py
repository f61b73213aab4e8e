"""The user's command, end to end: `python -m rl_megatron.train --config configs/demo_cpu.yaml ...`."""
import glob
import json
import os
import shutil

from helpers.runs import REPO, train

STEP_METRICS = {"reward/mean", "reward/std", "response_length/mean", "actor/pg_loss", "actor/pg_clipfrac",
                "actor/ppo_kl", "actor/grad_norm", "actor/lr", "actor/entropy", "mismatch/token_mult_prob_error",
                "mismatch/max_abs_logprob_diff", "critic/advantages/mean",
                "timing_s/gen", "timing_s/old_log_prob", "timing_s/update_actor", "timing_s/sync_weights",
                "timing_s/step", "perf/tokens_per_s"}


def test_demo_learns_arithmetic_from_reward(tmp_path):
    """The `make demo` job: the mean reward climbs from chance to the 0.8 target."""
    stdout, rows, run_dir = train(tmp_path)
    assert rows[0]["reward/mean"] < 0.3
    assert sum(r["reward/mean"] for r in rows[-5:]) / 5 >= 0.8
    assert len(rows) < 400, "stopped by the step limit, not by reaching the target"
    assert "Target mean reward 0.8 reached." in stdout
    assert all(STEP_METRICS <= set(r) and r["step"] == i + 1 for i, r in enumerate(rows))
    # Trainer (Megatron) and sampler (vLLM) compute the same distribution.
    assert max(r["mismatch/token_mult_prob_error"] for r in rows) <= 1.001
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-5
    assert glob.glob(os.path.join(run_dir, "events.out.tfevents.*"))
    assert os.path.isfile(os.path.join(run_dir, "config.yaml"))


def demo_model_with_layers(folder, layers: int) -> str:
    """The demo model's folder with `layers` layers (the demo initialises randomly, so it holds no weights)."""
    shutil.copytree(os.path.join(REPO, "configs", "models", "tiny-qwen2-digits"), folder)
    config_file = os.path.join(folder, "config.json")
    with open(config_file) as f:
        config = json.load(f)
    config.update(num_hidden_layers=layers, layer_types=["full_attention"] * layers)
    with open(config_file, "w") as f:
        json.dump(config, f)
    return str(folder)


def test_interleaved_pipeline_parallel_run(tmp_path):
    """A few steps with the policy split into two pipeline stages instead of two tensor-parallel shards, each
    stage holding two interleaved model chunks (one layer each). (Two stages without interleaving run end to end
    in test_checkpoint_resume.py, resumed at TP=1 x PP=2.)"""
    vpp = 2
    model = demo_model_with_layers(tmp_path / "model", layers=2 * vpp)
    _, rows, _ = train(tmp_path, "trainer.total_steps=3", "actor.tensor_model_parallel_size=1",
                       "actor.pipeline_model_parallel_size=2", f"actor.virtual_pipeline_model_parallel_size={vpp}",
                       f"model.path={model}", "rollout.max_tokens=3")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["actor/grad_norm"] > 0 for r in rows)
    # The engine samples from the weights the trainer exported from its stages and chunks.
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-5
