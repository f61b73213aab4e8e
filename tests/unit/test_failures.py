"""A dead worker's report, from what Ray says and the node's kernel tells: the cause in plain words, the log's end."""
from rl_megatron.workers import failures
from rl_megatron.workers.failures import WorkerPlacement, cause_of_death, describe_death

# What Ray 2.60 says of a worker its memory monitor killed, and of one that was SIGKILLed.
RAY_OOM = ("2 worker(s) were killed due to the node running low on memory. Memory on the node (IP: 10.0.0.5, ID: "
           "13171d7e2b68) was 22.61GB used / 23.54GB limit (0.96)\nTop 10 memory users: ...")
RAY_SIGKILL = ("The actor died unexpectedly before finishing this task.\n\tclass_name: HybridWorker\nWorker "
               "unexpectedly exits with a connection error code 2. End of file. There are some potential root causes."
               " (1) The process is killed by SIGKILL by OOM killer due to high memory usage.")


def test_ray_memory_monitor_is_named_with_the_node_figures():
    cause = cause_of_death(RAY_OOM, local=False, oom_kills_before=None)
    assert cause.startswith("Ray's memory monitor killed it") and "(node 10.0.0.5: 22.61GB used / 23.54GB limit)" in cause


def test_the_kernel_oom_killer_is_told_by_its_counter_on_this_node(monkeypatch):
    monkeypatch.setattr(failures, "oom_kills", lambda: 7)
    assert cause_of_death(RAY_SIGKILL, local=True, oom_kills_before=6).startswith(
        "the kernel's OOM killer ended 1 process(es) on this node since the run started")
    plain = cause_of_death(RAY_SIGKILL, local=True, oom_kills_before=7)
    assert plain.startswith("its process was killed") and "GiB in use now" in plain
    assert "`dmesg` on that node" in cause_of_death(RAY_SIGKILL, local=False, oom_kills_before=7)


def test_the_report_names_rank_node_and_log_and_tails_it_without_ray_markers(tmp_path):
    err, out = tmp_path / "worker-1.err", tmp_path / "worker-1.out"
    err.write_text(":job_id:01000000\n:actor_name:HybridWorker\n" + "".join(f"line {i}\n" for i in range(20)))
    out.write_text(":job_id:01000000\n")
    where = WorkerPlacement(1, 0, "node-a", "10.0.0.5", 4242, (str(out), str(err)), ray_debug="")
    report = describe_death("actor+rollout", 1, 2, where, RAY_OOM, this_node="node-a", oom_kills_before=None)
    lines = report.splitlines()
    assert lines[0].startswith("The actor+rollout worker rank 1 of 2 (node 0 = 10.0.0.5, pid 4242) died: Ray's memory")
    assert lines[1] == f"Its log {out} is empty."
    assert lines[2] == f"Last lines of its log {err}:" and lines[3:] == [f"    line {i}" for i in range(8, 20)]
    remote = describe_death("actor+rollout", 1, 2, where, RAY_SIGKILL, this_node="node-b", oom_kills_before=None)
    assert remote.splitlines()[1:] == [f"Its log: {out} on 10.0.0.5.", f"Its log: {err} on 10.0.0.5."]
    unplaced = describe_death("rollout", 0, 4, None, RAY_OOM, this_node="node-a", oom_kills_before=None)
    assert unplaced.startswith("The rollout worker rank 0 of 4 (before it reported its node) died")
