"""LoRA through the user's command (configs/demo_cpu_lora.yaml: rank-16 adapters on the frozen random model, the KL
loss's reference the model with its adapters off, the engines given the adapters merged at each sync): killed by
SIGKILL two steps after its step-3 checkpoint, the same command continues exactly where it stopped, and the reward
climbs from chance. (The whole curve to 0.8, 266 steps against full fine-tuning's 179: docs/lora.md.)"""
import os
import signal

from helpers.runs import assert_same_metrics, latest_checkpoint, read_rows_if_any, start_until, train, train_command
from rl_megatron.checkpoint.run import step_dir

CONFIG = "demo_cpu_lora"
RUN = ("trainer.save_every=3", "trainer.keep_last=1", "trainer.total_steps=40", "trainer.target_reward=null")
# The engines' merged weights (W + alpha/r BA, rounded once) against the trainer's W x + alpha/r B(Ax): within 1e-4
# as the logits sharpen (4.9e-5 seen over a run to 0.8).
MERGED_LOGPROB_DIFF = 1e-4


def mean_reward(rows) -> float:
    return sum(r["reward/mean"] for r in rows) / len(rows)


def test_lora_demo_resumes_exactly_and_learns(tmp_path):
    killed = start_until(train_command(tmp_path, *RUN, config=CONFIG),
                         lambda: 5 in read_rows_if_any(tmp_path, CONFIG), start_new_session=True)
    before = read_rows_if_any(tmp_path, CONFIG)  # the killed run's records of steps 4 and 5 (after its checkpoint)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    checkpoints = os.path.join(tmp_path, CONFIG, "checkpoints")
    assert latest_checkpoint(tmp_path, CONFIG) == 3
    # The actor alone: its frozen base is the reference (no reference model, though the model is random).
    assert "ref" not in os.listdir(step_dir(checkpoints, 3)) and "actor" in os.listdir(step_dir(checkpoints, 3))

    stdout, rows, _ = train(tmp_path, *RUN, config=CONFIG)
    assert f"Resumed from {step_dir(checkpoints, 3)} (step 3)" in stdout
    rows = {r["step"]: r for r in rows}
    assert sorted(rows) == list(range(1, 41))
    for step in (4, 5):
        assert_same_metrics(before[step], rows[step], tolerance=1e-6)
    steps = [rows[step] for step in sorted(rows)]
    assert mean_reward(steps[:5]) < 0.15 and mean_reward(steps[-10:]) > mean_reward(steps[:5]) + 0.05
    # Engines and trainer compute the same model (the adapters merged into what the engines receive), and the KL
    # loss measures the adapters' departure from the base.
    assert max(r["mismatch/max_abs_logprob_diff"] for r in steps) < MERGED_LOGPROB_DIFF
    assert steps[-1]["actor/kl_loss"] > 0
