"""LoRA through the user's command (configs/demo_cpu_lora.yaml: rank-16 adapters on the frozen random model, the KL
loss's reference the model with its adapters off, the engines given the adapters merged at each sync): killed by
SIGKILL once its step-3 checkpoint is complete and two steps later, the same command continues exactly where it
stopped and the demo learns to the target."""
import os
import signal

from helpers.runs import latest_checkpoint, read_rows_if_any, start_until, train, train_command, assert_same_metrics
from rl_megatron.checkpoint.run import step_dir

CONFIG = "demo_cpu_lora"
RUN = ("trainer.save_every=3", "trainer.keep_last=1")
# Steps to 0.8 of the LoRA demo, same seed, 2-core CPU (docs/lora.md): the bound leaves room for other machines.
STEP_BOUND = 250


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
    for step in (4, 5):
        assert_same_metrics(before[step], rows[step], tolerance=1e-6)
    last = [rows[step]["reward/mean"] for step in sorted(rows)[-5:]]
    assert "Target mean reward 0.8 reached." in stdout and sum(last) / 5 >= 0.8 and max(rows) < STEP_BOUND
    assert rows[1]["reward/mean"] < 0.2  # chance: one digit in ten
    # Engines and trainer compute the same model (the adapters merged into what the engines receive), and the KL
    # loss measures the adapters' departure from the base: zero in step 1's first mini-batch, positive after.
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows.values()) < 5e-5
    assert rows[max(rows)]["actor/kl_loss"] > 0
