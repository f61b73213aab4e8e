"""RAY_DEBUG, read in one place (rl_megatron/platform/debugger.py; rl_megatron/workers/debugging.py acts on it): the
workers get it, the timeouts a paused worker would run into are lifted while it is on, and what the debugger needs is
checked before Ray starts."""
import datetime
from importlib import metadata

import pytest
import ray._private.utils

from rl_megatron.errors import LaunchError
from rl_megatron.launch.__main__ import plan_node
from rl_megatron.trainer.workers import worker_env
from rl_megatron.workers import debugging
from rl_megatron.platform.debugger import collective_timeout
from rl_megatron.workers.debugging import attach_hint, controller_wait_s, ray_debugger, setup_problem

THIRTY_MINUTES = datetime.timedelta(minutes=30)


@pytest.fixture
def no_debugger(monkeypatch):
    monkeypatch.delenv("RAY_DEBUG", raising=False)
    monkeypatch.delenv("RAY_DEBUG_POST_MORTEM", raising=False)
    return monkeypatch


def test_without_ray_debug_the_workers_get_none_and_the_timeouts_stay(no_debugger):
    env = worker_env(2, local_cluster=True)
    assert "RAY_DEBUG" not in env and "RAY_DEBUG_POST_MORTEM" not in env
    assert ray_debugger() is None
    assert collective_timeout(THIRTY_MINUTES) == THIRTY_MINUTES and collective_timeout(None) is None
    assert controller_wait_s(120) == 120


@pytest.mark.parametrize("mode", ["1", "legacy"])
def test_with_ray_debug_every_worker_gets_it_and_no_timeout_cuts_a_paused_session(no_debugger, mode):
    no_debugger.setenv("RAY_DEBUG", mode)
    no_debugger.setenv("RAY_DEBUG_POST_MORTEM", "1")
    for local_cluster in (True, False):  # a cluster's nodes may have been started without it
        env = worker_env(2, local_cluster=local_cluster)
        assert env["RAY_DEBUG"] == mode and env["RAY_DEBUG_POST_MORTEM"] == "1"
    assert ray_debugger() == mode
    for usual in (THIRTY_MINUTES, None):  # None: torch's default
        assert collective_timeout(usual) >= datetime.timedelta(hours=12)
    assert controller_wait_s(120) is None


def test_ray_debug_off_values_are_passed_on_but_turn_nothing_on(no_debugger):
    no_debugger.setenv("RAY_DEBUG", "0")
    assert worker_env(2, local_cluster=True)["RAY_DEBUG"] == "0"  # Ray then ignores breakpoint(), as asked
    assert ray_debugger() is None and setup_problem(starts_dashboard=True) is None


def test_a_value_ray_ignores_is_refused_naming_the_ones_it_knows(no_debugger):
    no_debugger.setenv("RAY_DEBUG", "true")
    problem = setup_problem(starts_dashboard=False)
    assert problem.startswith("RAY_DEBUG='true'") and "RAY_DEBUG=1" in problem and "RAY_DEBUG=legacy" in problem


def test_the_legacy_debugger_needs_nothing_more(no_debugger):
    no_debugger.setenv("RAY_DEBUG", "legacy")
    assert setup_problem(starts_dashboard=True) is None


@pytest.mark.parametrize("installed,said", [(None, "which is not installed here"), ("1.6.7", "which is 1.6.7 here")])
def test_ray_debug_1_without_a_recent_debugpy_names_the_install(no_debugger, installed, said):
    no_debugger.setenv("RAY_DEBUG", "1")

    def version(name):
        if installed is None:
            raise metadata.PackageNotFoundError(name)
        return installed

    no_debugger.setattr(debugging.metadata, "version", version)
    problem = setup_problem(starts_dashboard=False)
    assert said in problem and "pip install -e .[debug]" in problem and "RAY_DEBUG=legacy" in problem


def test_ray_debug_1_starting_the_dashboard_needs_its_packages(no_debugger):
    no_debugger.setenv("RAY_DEBUG", "1")
    no_debugger.setattr(debugging.metadata, "version", lambda name: "1.8.22")
    no_debugger.setattr(ray._private.utils, "get_dashboard_dependency_error",
                        lambda: ModuleNotFoundError("No module named 'aiohttp_cors'"))
    problem = setup_problem(starts_dashboard=True)
    assert "Ray's dashboard packages (ray[default])" in problem and "aiohttp_cors" in problem
    assert "pip install -e .[debug]" in problem
    assert setup_problem(starts_dashboard=False) is None  # joining a cluster: its head has the dashboard


def test_the_start_line_says_how_to_attach(no_debugger):
    no_debugger.setenv("RAY_DEBUG", "1")
    vscode = attach_hint("127.0.0.1:8265", "127.0.0.1:6379")
    assert "VS Code's Ray Distributed Debugger" in vscode and "add the cluster 127.0.0.1:8265" in vscode
    assert "ssh -L 8265:localhost:8265" in vscode
    assert "Ray reports no dashboard" in attach_hint("", "127.0.0.1:6379")
    no_debugger.setenv("RAY_DEBUG", "legacy")
    assert "`ray debug --address 127.0.0.1:6379`" in attach_hint("", "127.0.0.1:6379")


def test_the_launcher_checks_each_node_before_ray_starts(no_debugger, tmp_path):
    """Node 0 starts the dashboard: it needs Ray's dashboard packages; every node needs debugpy."""
    for name, value in {"NNODES": "2", "MASTER_ADDR": "node0", "GPUS_PER_NODE": "2", "RAY_AUTH_MODE": "disabled",
                        "RAY_DEBUG": "1"}.items():
        no_debugger.setenv(name, value)
    no_debugger.setattr(ray._private.utils, "get_dashboard_dependency_error",
                        lambda: ModuleNotFoundError("No module named 'aiohttp_cors'"))
    config = ["configs/demo_cpu.yaml", [f"trainer.log_dir={tmp_path}", "trainer.nnodes=2"]]
    no_debugger.setenv("NODE_RANK", "0")
    with pytest.raises(LaunchError, match=r"RAY_DEBUG=1: .*aiohttp_cors.*pip install -e \.\[debug\]"):
        plan_node(*config)
    no_debugger.setenv("NODE_RANK", "1")
    plan_node(*config)
    no_debugger.setattr(debugging.metadata, "version", lambda name: "1.6.7")
    with pytest.raises(LaunchError, match=r"RAY_DEBUG=1 stops workers in debugpy, which is 1\.6\.7 here"):
        plan_node(*config)
