"""trainer.deterministic: the environment the driver hands every worker, the torch settings each worker applies, the
environments refused at start (naming the key), and Megatron's deterministic_mode. The GPU kernels themselves run
only on a GPU; what decides them is plain logic, checked here."""
import os

import pytest
import torch
from helpers.runs import REPO

from rl_megatron.config import ConfigError
from rl_megatron.models.hf_config import model_config
from rl_megatron.preflight import load_config
from rl_megatron.models.gpt import transformer_config
from rl_megatron.platform.determinism import check_environment, make_process_deterministic
from rl_megatron.trainer.workers import worker_env

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
VARIABLES = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NVTE_ALLOW_NONDETERMINISTIC_ALGO", "NVTE_FLASH_ATTN",
             "NVTE_FUSED_ATTN", "NVTE_UNFUSED_ATTN")


@pytest.fixture
def clean_environment(monkeypatch):
    """None of the variables set; torch's global settings restored afterwards."""
    for name in VARIABLES:
        monkeypatch.delenv(name, raising=False)
    settings = (torch.are_deterministic_algorithms_enabled(), torch.backends.cudnn.deterministic,
                torch.backends.cudnn.benchmark)
    yield monkeypatch
    torch.use_deterministic_algorithms(settings[0])
    torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = settings[1:]


def test_a_worker_started_with_the_drivers_environment_is_deterministic(clean_environment):
    env = worker_env(2, local_cluster=True, deterministic=True)
    assert {name: env[name] for name in VARIABLES[:3]} == {
        "CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
    for name, value in env.items():  # what Ray's runtime_env sets in the worker process before it starts
        clean_environment.setenv(name, value)
    make_process_deterministic(os.environ)
    assert torch.are_deterministic_algorithms_enabled() and not torch.is_deterministic_algorithms_warn_only_enabled()
    assert torch.backends.cudnn.deterministic and not torch.backends.cudnn.benchmark


def test_without_the_key_the_workers_get_nothing_of_it(clean_environment):
    assert not set(VARIABLES) & set(worker_env(2, local_cluster=True))


def test_deterministic_values_of_the_users_own_are_kept(clean_environment):
    clean_environment.setenv("NCCL_ALGO", "Tree,Ring")
    clean_environment.setenv("CUBLAS_WORKSPACE_CONFIG", ":16:8")
    env = worker_env(2, local_cluster=True, deterministic=True)
    assert (env["NCCL_ALGO"], env["CUBLAS_WORKSPACE_CONFIG"]) == ("Tree,Ring", ":16:8")


def test_a_process_started_without_the_environment_is_refused(clean_environment):
    with pytest.raises(ConfigError, match="trainer.deterministic=true: this process started without "
                                          "CUBLAS_WORKSPACE_CONFIG, NVTE_ALLOW_NONDETERMINISTIC_ALGO, NCCL_ALGO"):
        make_process_deterministic(os.environ)
    assert not torch.are_deterministic_algorithms_enabled()


@pytest.mark.parametrize("environment, words", [
    ({"NVTE_ALLOW_NONDETERMINISTIC_ALGO": "1"}, "needs NVTE_ALLOW_NONDETERMINISTIC_ALGO in ['0']"),
    ({"CUBLAS_WORKSPACE_CONFIG": ":0:0"}, "needs CUBLAS_WORKSPACE_CONFIG in [':4096:8', ':16:8']"),
    ({"NCCL_ALGO": "Ring,NVLS"}, "needs NCCL's ring or tree algorithms"),
    ({"NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"}, "cannot train with Transformer Engine's FlashAttention alone"),
])
def test_the_config_check_refuses_what_cannot_be_deterministic(clean_environment, environment, words):
    for name, value in environment.items():
        clean_environment.setenv(name, value)
    load_config(DEMO)  # nothing is asked of the environment without the key
    with pytest.raises(ConfigError, match=r"^trainer\.deterministic=true ") as info:
        load_config(DEMO, ["trainer.deterministic=true"])
    assert words in str(info.value) and "set trainer.deterministic=false" in str(info.value)


def test_other_attention_choices_pass_the_check():
    for environment in ({}, {"NVTE_FLASH_ATTN": "0"}, {"NVTE_FUSED_ATTN": "0"}, {"NVTE_FLASH_ATTN": "1"}):
        check_environment(environment)


def test_megatron_builds_deterministically_with_the_key():
    hf = model_config(load_config(DEMO))
    assert transformer_config(hf, tp=1, pp=1, dtype="float32", deterministic=True).deterministic_mode is True
    assert transformer_config(hf, tp=1, pp=1, dtype="float32").deterministic_mode is False
