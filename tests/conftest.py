"""Shared fixtures: a tiny HF model with weights (built locally), and one local Ray for the session.

The tiers: unit (in-process and fast), process (starts processes: the CLIs as subprocesses, the reward scorer's
process pool, a fresh interpreter), distributed (Megatron ranks on gloo), integration (Ray, vLLM engines), e2e
(whole training runs and benchmarks), gpu. What several files share lives in tests/helpers, imported as
`helpers.<module>` (this folder is on sys.path through this conftest)."""
import os

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def pytest_configure(config):
    # tests/gpu: `pytest tests/gpu -m gpu` on a CUDA machine; elsewhere they skip, saying why.
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (torch, megatron-core and transformers; no vLLM or Ray)")
    config.addinivalue_line("markers", "slow: minutes-long training runs; run with RL_MEGATRON_SLOW=1")


def pytest_collection_modifyitems(config, items):
    # The suite must stay well inside CI's time; whole learning curves run on request.
    if os.environ.get("RL_MEGATRON_SLOW") != "1":
        skip = pytest.mark.skip(reason="a minutes-long training run: set RL_MEGATRON_SLOW=1 to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The demo model's architecture with random seed-0 weights saved as safetensors."""
    from rl_megatron.models.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")), with_weights=True, seed=0)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    # Three logical CPU slots: a two-worker actor and, for separate placement, an engine worker beside it.
    ray.init(num_cpus=3, include_dashboard=False, object_store_memory=256 * 1024**2,
             _node_ip_address="127.0.0.1", log_to_driver=False)
    yield ray
    ray.shutdown()
