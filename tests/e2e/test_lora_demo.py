"""LoRA through the user's command (configs/demo_cpu_lora.yaml: rank-16 adapters on the frozen random model, the KL
loss's reference the model with its adapters off). The demo (adapters on lm_head too, which vLLM cannot serve: the
engines get the adapters merged at each sync) climbs from chance. With the default sync (`actor.lora.merge=false`,
adapters on the decoder's linear layers), the engines load the adapters alone after each update, checked bit for bit
(resharding.verify); killed by SIGKILL two steps after its step-3 checkpoint, the same command continues exactly where
it stopped, its engines sent the base again from the checkpoint. (The demo's whole curve to 0.8, 266 steps against
full fine-tuning's 179: docs/lora.md.)"""
import os
import signal

from helpers.runs import assert_same_metrics, latest_checkpoint, read_rows_if_any, start_until, train, train_command
from rl_megatron.checkpoint.run import step_dir

CONFIG = "demo_cpu_lora"
# The engines' merged weights (W + alpha/r BA, rounded once) against the trainer's W x + alpha/r B(Ax): within 1e-4
# as the logits sharpen (4.9e-5 seen over a run to 0.8).
MERGED_LOGPROB_DIFF = 1e-4
# Adapters served by vLLM compute W x + alpha/r B(Ax) as the trainer does (9.5e-7 seen over 60 steps).
SERVED_LOGPROB_DIFF = 1e-5
SERVED = ("actor.lora.target_modules=[all-linear]", "resharding.verify=true", "trainer.save_every=3",
          "trainer.keep_last=1", "trainer.total_steps=6", "trainer.target_reward=null")


def mean_reward(rows) -> float:
    return sum(r["reward/mean"] for r in rows) / len(rows)


def test_lora_demo_learns_with_the_adapters_merged_for_the_engines(tmp_path):
    stdout, rows, run_dir = train(tmp_path, "trainer.total_steps=25", "trainer.target_reward=null",
                                  "trainer.save_every=-1", config=CONFIG)
    assert mean_reward(rows[:5]) < 0.15 and mean_reward(rows[-10:]) > mean_reward(rows[:5]) + 0.05
    # Engines and trainer compute the same model (the adapters merged into what the engines receive), and the KL
    # loss measures the adapters' departure from the base.
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < MERGED_LOGPROB_DIFF
    assert rows[-1]["actor/kl_loss"] > 0


def test_engines_served_the_adapters_resume_exactly(tmp_path):
    killed = start_until(train_command(tmp_path, *SERVED, config=CONFIG),
                         lambda: 5 in read_rows_if_any(tmp_path, CONFIG), start_new_session=True)
    before = read_rows_if_any(tmp_path, CONFIG)  # the killed run's records of steps 4 and 5 (after its checkpoint)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    checkpoints = os.path.join(tmp_path, CONFIG, "checkpoints")
    assert latest_checkpoint(tmp_path, CONFIG) == 3
    # The actor alone: its frozen base is the reference (no reference model, though the model is random).
    assert "ref" not in os.listdir(step_dir(checkpoints, 3)) and "actor" in os.listdir(step_dir(checkpoints, 3))

    stdout, rows, _ = train(tmp_path, *SERVED, config=CONFIG)
    assert f"Resumed from {step_dir(checkpoints, 3)} (step 3)" in stdout
    rows = {r["step"]: r for r in rows}
    assert sorted(rows) == list(range(1, 7))
    for step in (4, 5):
        assert_same_metrics(before[step], rows[step], tolerance=1e-6)
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows.values()) < SERVED_LOGPROB_DIFF
    assert rows[6]["actor/kl_loss"] > 0
