"""Shared fixtures: a tiny HF model with weights (built locally), and one local Ray for the test run.

The tiers, each a folder and a pytest marker of the same name (set here from the folder; `-m unit`, `-m "not e2e"`):
- unit (tests/unit; `make test-fast`, under 2 minutes): in this process (what a unit starts itself aside, as the
  sandboxed Python tool), no Ray, no ranks, no fresh interpreter; the CLIs' error checks call each entry point's
  `main(argv)`.
- component (tests/distributed, tests/process): real parts in processes of their own, without the suite's Ray:
  Megatron ranks on gloo (parity with transformers), the CLIs where only a fresh process shows it (the exit code,
  that Ray never started), the reward scorer's process pool, the reaper, what needs a fresh interpreter.
- integration (tests/integration): Ray workers and vLLM engines, on the one Ray of the test run (`ray_session`);
  the multi-node test starts a two-node cluster of its own, once that Ray has ended.
- e2e (tests/e2e): whole training runs and the launch script, as users start them; its benchmark smoke runs
  (test_bench_cli.py) are also `bench`.
- gpu (tests/gpu): `pytest tests/gpu -m gpu` on a CUDA machine; elsewhere they skip, saying why.
`slow` (any tier): minutes-long training runs, only with RL_MEGATRON_SLOW=1.

`make test` runs the suite on two pytest-xdist workers (`-n 2 --dist loadscope`, the scopes of
helpers.xdist_scopes), heaviest tier first. A test marked own_ray starts a Ray in the pytest process: it runs after
the last test on the test run's Ray, on the same worker. `RL_MEGATRON_CPU_TIME=FILE` appends a line per test to
FILE with its CPU seconds, every process it started included (helpers.cpu_time; root, a writable cgroup hierarchy).

What several files share lives in tests/helpers, imported as `helpers.<module>` (this folder is on sys.path through
this conftest): REPO (the repository's root) and the run launchers in helpers.runs."""
import os
from pathlib import Path

import pytest

from helpers.xdist_scopes import TESTS, misplaced, scope_of

# Each test's CPU seconds, its processes' included, appended to the file this names (helpers.cpu_time).
if os.environ.get("RL_MEGATRON_CPU_TIME"):
    pytest_plugins = ["helpers.cpu_time"]

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

# tests/<folder> -> its tier; tests/e2e/<file> -> tiers beside e2e.
TIERS = {"unit": ("unit",), "process": ("component",), "distributed": ("component",),
         "integration": ("integration",), "e2e": ("e2e",), "gpu": ("gpu",)}
FILE_TIERS = {"e2e/test_bench_cli.py": ("bench",)}
MARKERS = {
    "unit": "in this process: no Ray, no ranks, no fresh interpreter (tests/unit; make test-fast)",
    "component": "real parts in processes of their own, without the suite's Ray (tests/distributed, tests/process)",
    "integration": "Ray workers and vLLM engines on the test run's one Ray (tests/integration)",
    "e2e": "whole runs and the launch script as users start them (tests/e2e)",
    "bench": "one smoke run of each benchmark (tests/e2e/test_bench_cli.py)",
    "gpu": "needs a CUDA GPU (torch, megatron-core and transformers; no vLLM or Ray)",
    "slow": "minutes-long training runs; run with RL_MEGATRON_SLOW=1",
    "own_ray": "starts a Ray of its own in this process: runs after the test run's Ray has ended",
}
RAY_SESSION = "ray_session"
# The order `pytest -n` hands the tiers out in: the longest work first, so that no long run starts last. The
# distributed tier is one scope (its kept ranks), among the longest: one worker runs it while the other
# starts on the e2e runs, and the many short tests at the end even the two out.
TIER_ORDER = ("distributed", "e2e", "integration", "process", "unit", "gpu")
_last_ray_user = None  # the last test of the run that uses ray_session: Ray ends after it


def pytest_configure(config):
    for name, description in MARKERS.items():
        config.addinivalue_line("markers", f"{name}: {description}")


def relative_path(item) -> Path:
    return Path(str(item.path)).resolve().relative_to(TESTS)


def tiers(item) -> tuple[str, ...]:
    """The tier markers of a test, from where its file lies under tests/."""
    relative = relative_path(item)
    if relative.parts[0] not in TIERS:
        raise pytest.UsageError(f"tests/{relative}: tests/{relative.parts[0]} is no tier; put the file in one of "
                                f"{', '.join(f'tests/{folder}' for folder in TIERS)} (tests/conftest.py's TIERS)")
    return TIERS[relative.parts[0]] + FILE_TIERS.get(relative.as_posix(), ())


@pytest.hookimpl(tryfirst=True)  # before `-m` selects by the markers set here
def pytest_collection_modifyitems(config, items):
    for item in items:
        for tier in tiers(item):
            item.add_marker(tier)
    # The suite must stay well inside CI's time; whole learning curves run on request.
    if os.environ.get("RL_MEGATRON_SLOW") != "1":
        skip = pytest.mark.skip(reason="a minutes-long training run: set RL_MEGATRON_SLOW=1 to run it")
        for item in items:
            if "slow" in item.keywords:
                item.add_marker(skip)
    if hasattr(config, "workerinput"):
        items.sort(key=lambda item: TIER_ORDER.index(relative_path(item).parts[0]))  # stable: files keep their order
    # Tests with a Ray of their own run after the last test on the run's Ray (which ends then), never beside it.
    users = [index for index, item in enumerate(items) if RAY_SESSION in getattr(item, "fixturenames", ())]
    if users:
        own = [item for item in items[users[0]:users[-1]] if item.get_closest_marker("own_ray")]
        if own:
            rest = [item for item in items if item not in own]
            last = rest.index(items[users[-1]])
            items[:] = rest[:last + 1] + own + rest[last + 1:]


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config, log):
    """`--dist loadscope` with this suite's scopes (helpers.xdist_scopes); other modes as xdist has them."""
    if config.getvalue("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling  # only here: xdist is optional for a plain `pytest`

    class SuiteScopes(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return scope_of(nodeid, config.rootpath)

    return SuiteScopes(config, log)


def pytest_runtest_setup(item):
    # Failed here, where the report shows why: a worker's collection error would end it without a word.
    if hasattr(item.config, "workerinput") and (problem := misplaced(item)):
        pytest.fail(problem, pytrace=False)


def pytest_collection_finish(session):
    global _last_ray_user
    users = [item for item in session.items if RAY_SESSION in getattr(item, "fixturenames", ())]
    _last_ray_user = users[-1] if users else None


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    if item is _last_ray_user and nextitem is not None:
        import ray

        ray.shutdown()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """The demo model's architecture with random seed-0 weights saved as safetensors."""
    from rl_megatron.models.tiny import write_tiny_model

    return write_tiny_model(str(tmp_path_factory.mktemp("tiny-qwen2")), with_weights=True, seed=0)


@pytest.fixture(scope="session")
def ray_session():
    """The test run's one local Ray, started as the trainer starts it (`start_ray`): three CPU slots, for a two-worker
    actor and, for separate placement, an engine worker beside it. It ends after the last test that uses it (tests
    marked own_ray come after that one)."""
    import ray

    from helpers.runs import REPO
    from rl_megatron.preflight import load_config
    from rl_megatron.workers.cluster import start_ray

    assert not ray.is_initialized(), "a Ray is already running in this process"
    start_ray(load_config(os.path.join(REPO, "configs", "demo_cpu.yaml"), [
        f"model.path={os.path.join(REPO, 'configs', 'models', 'tiny-qwen2-digits')}", "ray.num_cpus=3",
        f"ray.object_store_memory={256 * 1024**2}"]))
    yield ray
    ray.shutdown()
