"""The agent function's worker processes (rl_megatron/agent_workers.py, rollout.agent.num_workers): episodes run
concurrently in them; one that raises, is cancelled (its timeout) or returns what cannot be sent back fails alone,
with a message naming what happened; a worker that dies fails the episodes it held, and the next episode starts a
new one; closing stops them all. (Through the gateway, with the real `openai` client against a real engine:
tests/integration/test_agent_gateway.py.)"""
import asyncio
import os
import textwrap
import time

import pytest

from rl_megatron.agent_workers import AgentWorkerFailed, AgentWorkers

# The user's agent module: the row says what each episode does.
AGENTS = '''
import asyncio, os, threading, time

async def agent(base_url, row):
    how = row["how"]
    if how == "sleeps":
        await asyncio.sleep(row["seconds"])
    if how == "raises":
        raise RuntimeError("the harness broke")
    if how == "hangs":
        await asyncio.sleep(3600)
    if how == "dies":
        await asyncio.sleep(0.2)
        os._exit(3)
    if how == "unpicklable":
        return {"reward": lambda: 1}
    return {"reward": float(len(base_url)), "pid": os.getpid()}

def plain(base_url, row):
    return {"thread": threading.current_thread().name, "pid": os.getpid()}
'''


@pytest.fixture
def module(tmp_path):
    path = tmp_path / "my_agents.py"
    path.write_text(textwrap.dedent(AGENTS))
    return str(path)


def run(workers: AgentWorkers, rows: list[dict], timeout: float = 60.0) -> list:
    """Every row's episode at once; each its result or its exception."""
    async def one(index: int, row: dict):
        return await asyncio.wait_for(workers.run("x" * index, row), row.get("timeout", timeout))

    async def every():
        return await asyncio.gather(*(one(i, row) for i, row in enumerate(rows)), return_exceptions=True)

    return asyncio.run(every())


def test_episodes_run_concurrently_over_the_workers_and_fail_alone(module):
    workers = AgentWorkers(f"{module}:agent", 2)
    try:
        start = time.monotonic()
        results = run(workers, [{"how": "sleeps", "seconds": 1.0}] * 8 + [
            {"how": "raises"}, {"how": "hangs", "timeout": 2.0}, {"how": "unpicklable"}, {"how": "fine"}])
        assert time.monotonic() - start < 8  # the eight 1 s sleeps overlap
        sleeps, (raised, hung, unpicklable, fine) = results[:8], results[8:]
        assert [r["reward"] for r in sleeps] == [float(i) for i in range(8)]
        assert len({r["pid"] for r in sleeps}) == 2 and os.getpid() not in {r["pid"] for r in sleeps}
        assert isinstance(raised, AgentWorkerFailed) and str(raised) == "RuntimeError: the harness broke"
        assert isinstance(hung, asyncio.TimeoutError)
        assert isinstance(unpicklable, AgentWorkerFailed) and "cannot be sent back" in str(unpicklable)
        assert fine["reward"] == 11.0
        # The workers go on after every failure, the timed-out episode cancelled in its worker.
        assert run(workers, [{"how": "fine"}])[0]["reward"] == 0.0
    finally:
        workers.close()
    assert all(worker is None for worker in workers._workers)


def test_a_dead_worker_fails_what_it_held_and_the_next_episode_starts_a_new_one(module):
    workers = AgentWorkers(f"{module}:agent", 1)
    try:
        died, held = run(workers, [{"how": "dies"}, {"how": "sleeps", "seconds": 30}])
        for failed in (died, held):
            assert isinstance(failed, AgentWorkerFailed) and "exited with code 3" in str(failed)
            assert "rollout.agent.num_workers" in str(failed)
        (after,) = run(workers, [{"how": "fine"}])
        assert after["reward"] == 0.0
        process = workers._workers[0].process
    finally:
        workers.close()
    assert process.returncode == 0  # closed: it ended at the end of its input


def test_a_plain_function_runs_in_a_thread_of_its_worker(module):
    workers = AgentWorkers(f"{module}:plain", 1)
    try:
        (result,) = run(workers, [{}])
    finally:
        workers.close()
    assert result["thread"] == "rl_megatron-agent" and result["pid"] != os.getpid()


def test_a_function_the_worker_cannot_load_fails_each_episode_with_the_reason(tmp_path, module):
    workers = AgentWorkers(f"{module}:missing", 1)
    try:
        (failed,) = run(workers, [{}])
    finally:
        workers.close()
    assert isinstance(failed, AgentWorkerFailed) and "has no attribute 'missing'" in str(failed)
