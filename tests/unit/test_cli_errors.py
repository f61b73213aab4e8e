"""The command line: `python -m rl_megatron.train` explains bad input in one `error:` line, before Ray starts.

Each case calls the entry point in this process, as `python -m rl_megatron.train ARGS` from the repository's root
does (`rl_megatron.train.main(ARGS)`). A configuration problem must end with exit code 2, print a single line starting
with `error:` on stderr and no traceback, log no warning (which a process of its own would print on stderr), and do so
quickly (Ray and Megatron are never started). What only a process of its own shows, the exit code the shell gets and
that Ray never started, is checked in tests/process/test_cli_process.py.
"""
import gc
import json
import logging
import os
import shutil
import sys
import time
from dataclasses import dataclass

import pytest
import torch
from helpers.ports import closed_port
from helpers.runs import REPO

from rl_megatron.train import main

DEMO = "configs/demo_cpu.yaml"
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
FAIL_FAST_S = 20  # a config error must be reported well before Ray (or Megatron, or vLLM) could start


@dataclass
class Done:
    """What one call of the entry point left: its exit code, what it printed, what it logged at WARNING or above."""
    returncode: int
    stdout: str
    stderr: str
    warnings: list


@pytest.fixture
def run_train(monkeypatch, capsys, caplog):
    """`run_train(*args)`: the CLI with `args`, from the repository's root; returns (Done, seconds it took)."""
    monkeypatch.chdir(REPO)
    collecting = gc.isenabled()  # main defers the garbage collection until start-up is done: put it back after

    def run(*args):
        capsys.readouterr()
        caplog.clear()
        start = time.monotonic()
        try:
            code = main(list(args))
        except SystemExit as exit:  # argparse's --help and usage errors
            code = exit.code
        seconds = time.monotonic() - start
        out, err = capsys.readouterr()
        logged = [record.getMessage() for record in caplog.records if record.levelno >= logging.WARNING]
        return Done(code, out, err, logged), seconds

    yield run
    if collecting:
        gc.enable()


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
    assert proc.warnings == [], proc.warnings
    assert seconds < FAIL_FAST_S, f"took {seconds:.1f} s: the error should come before Ray starts"


def test_help_shows_usage_and_an_example(run_train):
    proc, seconds = run_train("--help")
    assert proc.returncode == 0, proc.stderr
    assert "--config" in proc.stdout
    assert "python -m rl_megatron.train --config configs/demo_cpu.yaml" in proc.stdout  # the example
    assert "key=value" in proc.stdout
    assert seconds < FAIL_FAST_S


def test_malformed_yaml(run_train, tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("trainer:\n  total_steps: [1, 2\nmodel:\n  path: configs/models/tiny-qwen2-digits\n")
    proc, seconds = run_train("--config", str(path))
    assert_config_error(proc, seconds, "bad.yaml", "not valid YAML", "line")


def test_impossible_parallel_layout(run_train):
    proc, seconds = run_train("--config", DEMO, "actor.tensor_model_parallel_size=3")
    assert_config_error(proc, seconds, "actor.tensor_model_parallel_size=3", "trainer.n_gpus_per_node")


def test_missing_model_folder(run_train, tmp_path):
    proc, seconds = run_train("--config", DEMO, f"model.path={tmp_path / 'no-such-model'}")
    assert_config_error(proc, seconds, "model.path=", "no-such-model")


def test_unknown_override_key_suggests_the_right_one(run_train):
    proc, seconds = run_train("--config", DEMO, "trainer.total_step=5")
    assert_config_error(proc, seconds, "trainer.total_step", "Did you mean 'trainer.total_steps'?")


def test_type_error_names_the_key(run_train):
    proc, seconds = run_train("--config", DEMO, "trainer.total_steps=abc")
    assert_config_error(proc, seconds, "trainer.total_steps", "abc")


def test_missing_config_file(run_train):
    proc, seconds = run_train("--config", "configs/no_such_config.yaml")
    assert_config_error(proc, seconds, "configs/no_such_config.yaml", "does not exist")


def test_dataset_with_no_prompts_fails_before_ray(run_train):
    proc, seconds = run_train("--config", DEMO, "data.max_prompt_length=2")
    assert_config_error(proc, seconds, "data.task=arithmetic", "no prompts", "max_prompt_length=2")


def test_a_float_that_is_not_finite(run_train):
    proc, seconds = run_train("--config", DEMO, "actor.optim.lr=nan")
    assert_config_error(proc, seconds, "actor.optim.lr=nan", "finite")


def test_a_log_dir_that_cannot_be_created(run_train, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc, seconds = run_train("--config", DEMO, f"trainer.log_dir={blocker}/runs")
    assert_config_error(proc, seconds, "trainer.log_dir", f"'{blocker}' is a file")


def test_a_checkpoint_dir_that_cannot_be_created(run_train, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc, seconds = run_train("--config", DEMO, f"trainer.checkpoint_dir={blocker}")
    assert_config_error(proc, seconds, "trainer.checkpoint_dir", f"'{blocker}' is a file")


def test_a_rollout_data_dir_that_cannot_be_created(run_train, tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    proc, seconds = run_train("--config", DEMO, f"trainer.rollout_data_dir={blocker}/rollouts")
    assert_config_error(proc, seconds, "trainer.rollout_data_dir", f"'{blocker}' is a file")


def test_a_ray_address_where_no_head_answers(run_train, tmp_path):
    """Ray's own connect retries for minutes, printing its internals; the trainer gives up after
    ray.connect_timeout_s with one line naming the key and what it tried."""
    # A Ray already running in this process would be used instead (tests/conftest.py ends the suite's after its last
    # test).
    assert "ray" not in sys.modules or not sys.modules["ray"].is_initialized()
    with closed_port() as port:
        proc, seconds = run_train("--config", DEMO, f"ray.address=127.0.0.1:{port}", "ray.connect_timeout_s=2",
                                  f"trainer.log_dir={tmp_path}")  # the run's folder is made before Ray is joined
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    error, = proc.stderr.strip().splitlines()
    assert error.startswith("error: ray.address='127.0.0.1:") and "ray.connect_timeout_s=2 s" in error, error
    assert seconds < FAIL_FAST_S, seconds


# ---------------------------------------------------------------------------- the model folder: tokenizer and weights
# Each broken folder is the demo model's (tokenizer, config) with real safetensors weights (conftest's tiny_model_dir),
# broken in one way. Without the pre-flight check these started a run on an empty tokenizer, or failed in a worker's
# traceback after Ray and the workers had started.


def model_copy(source, folder, skip=()) -> str:
    return str(shutil.copytree(source, folder, ignore=shutil.ignore_patterns(*skip)))


def run_on_weights(run_train, folder):
    return run_train("--config", DEMO, f"model.path={folder}", "model.random_init=false")


def test_model_folder_without_tokenizer_files(run_train, tmp_path):
    folder = model_copy(DEMO_MODEL, tmp_path / "no-tokenizer", skip=("tokenizer*",))
    proc, seconds = run_train("--config", DEMO, f"model.path={folder}")
    assert_config_error(proc, seconds, f"model.path='{folder}'", "no tokenizer", "tokenizer.json", "EMPTY tokenizer")


def test_tokenizer_larger_than_the_models_vocabulary(run_train, tmp_path):
    from transformers import AutoTokenizer

    folder = model_copy(DEMO_MODEL, tmp_path / "big-tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(folder)
    tokenizer.add_tokens(["<extra_0>", "<extra_1>"])  # 20 tokens; config.json's vocab_size is 18
    tokenizer.save_pretrained(folder)
    proc, seconds = run_train("--config", DEMO, f"model.path={folder}")
    assert_config_error(proc, seconds, f"model.path='{folder}'", "tokenizer.json", "20 tokens", "vocab_size=18")


def test_no_safetensors_without_random_init(run_train):
    proc, seconds = run_train("--config", DEMO, "model.random_init=false")  # the demo model has no weights
    assert_config_error(proc, seconds, "model.path='configs/models/tiny-qwen2-digits'", "no *.safetensors",
                        "model.random_init=true")


def test_truncated_safetensors_file(run_train, tmp_path, tiny_model_dir):
    folder = model_copy(tiny_model_dir, tmp_path / "truncated")
    weights = os.path.join(folder, "model.safetensors")
    os.truncate(weights, os.path.getsize(weights) // 2)
    proc, seconds = run_on_weights(run_train, folder)
    assert_config_error(proc, seconds, f"model.path='{folder}'", "'model.safetensors'", "cut short")


def test_sharded_weights_whose_index_names_a_missing_shard(run_train, tmp_path, tiny_model_dir):
    from safetensors.torch import load_file

    from rl_megatron.checkpoint.hf_folder import write_hf_folder

    with open(os.path.join(tiny_model_dir, "config.json")) as f:
        hf_config = json.load(f)
    folder = tmp_path / "sharded"
    folder.mkdir()
    state = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    write_hf_folder(state, str(folder), hf_config, tiny_model_dir, torch.float32, max_shard_bytes=100_000,
                    progress=lambda line: None)
    shards = sorted(name for name in os.listdir(folder) if name.endswith(".safetensors"))
    assert len(shards) > 2
    os.remove(folder / shards[1])
    proc, seconds = run_on_weights(run_train, folder)
    assert_config_error(proc, seconds, f"model.path='{folder}'", "model.safetensors.index.json", f"'{shards[1]}'",
                        "missing")


def test_safetensors_lacking_a_tensor_the_model_needs(run_train, tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    folder = model_copy(tiny_model_dir, tmp_path / "lacking")
    weights = os.path.join(folder, "model.safetensors")
    state = load_file(weights)
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, weights)
    proc, seconds = run_on_weights(run_train, folder)
    assert_config_error(proc, seconds, f"model.path='{folder}'", "'model.layers.1.mlp.down_proj.weight'",
                        "(model.safetensors)")


def test_safetensors_with_a_misshapen_tensor(run_train, tmp_path, tiny_model_dir):
    from safetensors.torch import load_file, save_file

    folder = model_copy(tiny_model_dir, tmp_path / "misshapen")
    weights = os.path.join(folder, "model.safetensors")
    state = load_file(weights)
    state["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(32, 64)  # config.json implies (64, 64)
    save_file(state, weights)
    proc, seconds = run_on_weights(run_train, folder)
    assert_config_error(proc, seconds, f"model.path='{folder}'", "'model.layers.0.self_attn.k_proj.weight'",
                        "in 'model.safetensors'", "[32, 64]", "[64, 64]")


def test_model_folder_without_end_of_sequence_ids(run_train, tmp_path):
    """Generation needs to know where to stop: without eos_token_id a worker failed with a KeyError after start-up."""
    folder = model_copy(DEMO_MODEL, tmp_path / "no-eos", skip=("generation_config.json",))
    config = json.load(open(os.path.join(folder, "config.json")))
    del config["eos_token_id"]
    json.dump(config, open(os.path.join(folder, "config.json"), "w"))
    proc, seconds = run_train("--config", DEMO, f"model.path={folder}")
    assert_config_error(proc, seconds, f"model.path='{folder}'", "end-of-sequence token ids", "none is given")
