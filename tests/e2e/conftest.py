"""The e2e tier's shared runs: a full start-up (Ray, Megatron, vLLM) serves every check that can read its results."""
import pytest

from helpers.demo_run import run_demo


@pytest.fixture(scope="session")
def demo_run(tmp_path_factory):
    """helpers.demo_run's run of the demo: (log_dir, stdout, rows, run folder)."""
    return run_demo(tmp_path_factory.mktemp("demo"))
