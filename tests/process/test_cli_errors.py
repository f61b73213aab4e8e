"""The command line: `python -m rl_megatron.train` explains bad input in one `error:` line, before Ray starts.

Each case runs the real entry point in a subprocess. A configuration problem must exit with code 2, print a single
line starting with `error:` on stderr and no traceback, and do so quickly (Ray and Megatron are never started).
"""
import os
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEMO = "configs/demo_cpu.yaml"
FAIL_FAST_S = 20  # a config error must be reported well before Ray (or Megatron, or vLLM) could start


def run_train(*args):
    """Run the CLI from the repository root; returns (completed process, seconds it took)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "rl_megatron.train", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    return proc, time.monotonic() - start


def assert_config_error(proc, seconds, *needles):
    """Exit code 2, exactly one `error:` line on stderr that contains every needle, no traceback, fast."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: "), proc.stderr
    for needle in needles:
        assert needle in lines[0], lines[0]
    assert proc.stdout == "", proc.stdout  # nothing else ran
    assert seconds < FAIL_FAST_S, f"took {seconds:.1f} s: the error should come before Ray starts"


def test_help_shows_usage_and_an_example():
    proc, seconds = run_train("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--config" in proc.stdout
    assert "python -m rl_megatron.train --config configs/demo_cpu.yaml" in proc.stdout  # the example
    assert "key=value" in proc.stdout
    assert seconds < FAIL_FAST_S


def test_malformed_yaml(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  total_steps: [1, 2\nmodel:\n  path: configs/models/tiny-qwen2-digits\n")
    proc, seconds = run_train("--config", str(path))
    assert_config_error(proc, seconds, "bad.yaml", "not valid YAML", "line")


def test_impossible_parallel_layout():
    proc, seconds = run_train("--config", DEMO, "actor.tensor_model_parallel_size=3")
    assert_config_error(proc, seconds, "actor.tensor_model_parallel_size=3", "trainer.n_gpus_per_node")


def test_missing_model_folder(tmp_path):
    proc, seconds = run_train("--config", DEMO, f"model.path={tmp_path / 'no-such-model'}")
    assert_config_error(proc, seconds, "model.path=", "no-such-model")


def test_unknown_override_key_suggests_the_right_one():
    proc, seconds = run_train("--config", DEMO, "trainer.total_step=5")
    assert_config_error(proc, seconds, "trainer.total_step", "Did you mean 'trainer.total_steps'?")


def test_type_error_names_the_key():
    proc, seconds = run_train("--config", DEMO, "trainer.total_steps=abc")
    assert_config_error(proc, seconds, "trainer.total_steps", "abc")


def test_missing_config_file():
    proc, seconds = run_train("--config", "configs/no_such_config.yaml")
    assert_config_error(proc, seconds, "configs/no_such_config.yaml", "does not exist")


def test_dataset_with_no_prompts_fails_before_ray():
    proc, seconds = run_train("--config", DEMO, "data.max_prompt_length=2")
    assert_config_error(proc, seconds, "data.task=arithmetic", "no prompts", "max_prompt_length=2")


def test_ray_without_room_for_the_workers():
    proc, seconds = run_train("--config", DEMO, "ray.num_cpus=1")
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("error: The actor needs 2 CPU slots") and "ray.num_cpus" in last, proc.stderr


def test_data_source_without_a_scorer_fails_before_ray(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    data = str(tmp_path / "odd.parquet")
    pq.write_table(pa.table({"data_source": ["my/odd_task"], "prompt": ["1+1="],
                             "reward_model": [{"ground_truth": "2"}], "extra_info": [{"index": 0}]}), data)
    proc, seconds = run_train("--config", DEMO, "data.task=null", f"data.train_files=[{data}]")
    # Found once the data is read (its line is printed), before Ray or any worker starts.
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and seconds < FAIL_FAST_S, proc.stderr
    error, = proc.stderr.strip().splitlines()
    assert all(word in error for word in ("error: ", "'my/odd_task'", "reward.custom_fn", "countdown")), error
    assert proc.stdout.startswith("data (train): 1 prompts") and "Ray" not in proc.stdout + proc.stderr


def test_a_float_that_is_not_finite():
    proc, seconds = run_train("--config", DEMO, "actor.optim.lr=nan")
    assert_config_error(proc, seconds, "actor.optim.lr=nan", "finite")


def test_a_log_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc, seconds = run_train("--config", DEMO, f"trainer.log_dir={blocker}/runs")
    assert_config_error(proc, seconds, "trainer.log_dir", f"'{blocker}' is a file")


def test_a_checkpoint_dir_that_cannot_be_created(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc, seconds = run_train("--config", DEMO, f"trainer.checkpoint_dir={blocker}")
    assert_config_error(proc, seconds, "trainer.checkpoint_dir", f"'{blocker}' is a file")


def test_a_ray_address_where_no_head_answers():
    """Ray's own connect retries for minutes, printing its internals; the trainer gives up after
    ray.connect_timeout_s with one line naming the key and what it tried."""
    from rl_megatron.workers.distributed import free_port

    proc, seconds = run_train("--config", DEMO, f"ray.address=127.0.0.1:{free_port()}", "ray.connect_timeout_s=2")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    error, = proc.stderr.strip().splitlines()
    assert error.startswith("error: ray.address='127.0.0.1:") and "ray.connect_timeout_s=2 s" in error, error
    assert seconds < FAIL_FAST_S, seconds
