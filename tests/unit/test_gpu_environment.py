"""The parts of the GPU paths' set-up that are plain logic, checked on CPU: who decides a worker's environment, vLLM's
allocator settings, the engines' memory share by placement."""
import os

import pytest

from rl_megatron import platform
from rl_megatron.preflight import load_config
from rl_megatron.models.gpt import initialization
from rl_megatron.rollout.vllm_allocator import vllm_allocator_settings, without_expandable_segments
from rl_megatron.rollout.vllm_engine import CPU_ENGINE_ENV, configure_engine_process
from rl_megatron.trainer.workers import worker_env


def test_the_driver_decides_nothing_that_depends_on_a_device():
    # A CPU-only head with GPU workers: what the driver sends must not carry CPU settings (VLLM_HOST_IP=127.0.0.1
    # would break a multi-node engine).
    for local_cluster in (True, False):
        env = worker_env(4, local_cluster=local_cluster)
        assert not set(CPU_ENGINE_ENV) & set(env)
        assert "PYTHONWARNINGS" not in env
        assert env["OMP_NUM_THREADS"] == "4"
    assert "GLOO_SOCKET_IFNAME" not in worker_env(4, local_cluster=False)


@pytest.mark.parametrize("cuda", [False, True])
def test_each_worker_sets_what_its_own_device_needs(monkeypatch, cuda):
    for key in CPU_ENGINE_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setattr(platform, "has_cuda", lambda: cuda)
    configure_engine_process()
    assert ("VLLM_HOST_IP" in os.environ) is (not cuda)
    assert os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0"


@pytest.mark.parametrize("cuda", [False, True])
def test_a_null_setting_follows_the_processs_own_device_and_a_set_one_wins(monkeypatch, cuda):
    monkeypatch.setattr(platform, "has_cuda", lambda: cuda)
    assert platform.on_with_cuda(None) is cuda
    assert platform.on_with_cuda(True) is True and platform.on_with_cuda(False) is False


@pytest.mark.parametrize("conf,expected", [
    ("expandable_segments:True", ""),
    ("max_split_size_mb:512,expandable_segments:True", "max_split_size_mb:512"),
    ("expandable_segments: True,garbage_collection_threshold:0.6", "garbage_collection_threshold:0.6"),
    ("expandable_segments:False", "expandable_segments:False"),
    ("", ""),
])
def test_expandable_segments_are_stripped_and_nothing_else(conf, expected):
    assert without_expandable_segments(conf) == expected


def test_vllm_allocates_without_expandable_segments_and_the_setting_comes_back(monkeypatch):
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True,max_split_size_mb:256")
    with vllm_allocator_settings():
        assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "max_split_size_mb:256"
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:256"
    with pytest.raises(RuntimeError), vllm_allocator_settings():
        raise RuntimeError("engine start failed")
    assert os.environ["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,max_split_size_mb:256"


@pytest.mark.parametrize("placement,expected", [("colocated", 0.5), ("separate", 0.9)])
def test_engines_on_their_own_gpus_take_most_of_their_memory(placement, expected):
    cfg = load_config("configs/demo_cpu.yaml", [f"rollout.placement={placement}"])
    assert cfg.rollout.gpu_memory_utilization == expected
    chosen = load_config("configs/demo_cpu.yaml", [f"rollout.placement={placement}",
                                                   "rollout.gpu_memory_utilization=0.7"])
    assert chosen.rollout.gpu_memory_utilization == 0.7


@pytest.mark.parametrize("cuda,weights_follow,on_host,initialised", [
    (False, False, True, True), (False, True, True, True),  # CPU: unchanged, whatever follows
    (True, False, True, True),  # GPU random init: whole on the host from the seed, the same at any layout
    (True, True, False, False),  # GPU with weights loaded next: on the device, no wasted initialisation
])
def test_megatron_initialises_on_the_host_only_when_nothing_overwrites_it(cuda, weights_follow, on_host, initialised):
    assert initialization(cuda, weights_follow) == {"use_cpu_initialization": on_host,
                                                     "perform_initialization": initialised}
