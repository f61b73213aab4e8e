"""An exception raised in a worker reaches the controller as what it is (still an instance of its own class, so a
ConfigError raised there is reported as bad input), with a note naming the worker and quoting the end of its log
(`WorkerGroup.get`)."""
import re

import pytest

from helpers.ray_workers import set_up_only_worker


def failing_worker_class() -> type:
    """A worker for WorkerGroup whose rank 1 raises in `fail`, after printing a line. Made in a function so that Ray
    ships the class by value: the workers cannot import this test module."""

    class Failing(set_up_only_worker()):
        def fail(self) -> int:
            if self.rank == 1:
                print("rank 1 is about to fail", flush=True)
                raise ValueError("the worker's own words")
            return self.rank

    return Failing


def test_an_exception_raised_in_a_worker_names_the_worker_and_quotes_its_log(ray_session):
    from rl_megatron.workers.worker_group import ResourcePool, WorkerGroup

    with WorkerGroup(failing_worker_class(), ResourcePool(1, 2), name="failing") as group:
        with pytest.raises(ValueError, match="the worker's own words") as raised:
            group.get(group.call_async("fail"))
        pid = group.placement[1].pid
    [note] = raised.value.__notes__
    assert note.startswith("Raised in the failing worker rank 1 of 2 (node 0 = ") and f"pid {pid})." in note, note
    assert re.search(r"Last lines of its log \S+:\n(    .*\n)*    rank 1 is about to fail", note), note
