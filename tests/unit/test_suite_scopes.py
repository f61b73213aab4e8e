"""make test's two workers: what one worker must run together (helpers.xdist_scopes)."""
from pathlib import Path

from helpers.runs import REPO
from helpers.xdist_scopes import scope_of

ROOT = Path(REPO)


def test_tests_that_share_a_session_resource_share_a_scope():
    assert scope_of("tests/distributed/test_moe.py::test_x[a]", ROOT) == scope_of(
        "tests/distributed/test_spawn.py::test_y", ROOT) == "distributed"  # the kept ranks
    assert scope_of("tests/integration/test_weight_sync.py::test_x", ROOT) == scope_of(
        "tests/gpu/test_engines_gpu.py::test_y", ROOT) == "ray_session"  # the test run's Ray
    assert scope_of("tests/e2e/test_train_cli.py::test_x", ROOT) == scope_of(
        "tests/e2e/test_observability.py::test_y", ROOT) == "demo_run"


def test_a_file_with_module_fixtures_is_one_scope_and_other_tests_go_alone():
    assert scope_of("tests/e2e/test_async.py::test_x", ROOT) == "e2e/test_async.py"  # its one_step_off run
    test = "tests/e2e/test_bench_cli.py::test_bench_prints_one_json_line[generate]"
    assert scope_of(test, ROOT) == test
