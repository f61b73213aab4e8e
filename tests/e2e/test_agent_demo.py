"""Your own agent, end to end: `make demo-agent` (configs/demo_cpu_agent.yaml) trains the tool demo's task through
the OpenAI-compatible gateway, driven by an agent written with the official `openai` client
(examples/agents/lookup_openai.py), and learns from chance to the 0.8 target, killed with SIGKILL on the way and
resumed exactly by the same command. One run serves every assert (the gateway through the trainer's other paths:
test_agent_compositions.py, a module of its own so that the suite's two workers share the runs)."""
import os
import signal

from helpers.runs import assert_same_metrics, latest_checkpoint, read_rows_if_any, start_until, train, train_command

AGENT_METRICS = {"agent/calls_per_episode", "agent/prefix_breaks", "agent/segments_per_episode",
                 "agent/episode_s", "agent/episode_s_max", "agent/episodes_failed"}


# The run is SIGKILLed (the whole process group: the controller, its gateway and agents, the workers) once it has
# logged two steps past its first checkpoint; the same command resumes there, re-running the episodes of those steps.
SAVE_EVERY = 20


def controller_warnings(tmp_path) -> list[str]:
    """The warnings of the run's controller log (a failed episode is logged there with its row and its error)."""
    path = tmp_path / "demo_cpu_agent" / "logs" / "controller.log"
    return [line for line in path.read_text().splitlines() if " WARNING " in line][-20:] if path.exists() else []


def test_an_openai_client_agent_learns_through_the_gateway(tmp_path):
    # ~510 HTTP calls a step through the `openai` client (in the gateway's agent worker processes), over ~80 steps:
    # several minutes on two cores shared with the suite's other worker (docs/benchmarks.md).
    run = (f"trainer.save_every={SAVE_EVERY}",)
    killed = start_until(train_command(tmp_path, *run, config="demo_cpu_agent"),
                         lambda: latest_checkpoint(tmp_path, "demo_cpu_agent") == SAVE_EVERY
                         and SAVE_EVERY + 2 in read_rows_if_any(tmp_path, "demo_cpu_agent"),
                         timeout=900, start_new_session=True)
    os.killpg(killed.pid, signal.SIGKILL)
    killed.wait()
    before = read_rows_if_any(tmp_path, "demo_cpu_agent")
    stdout, rows, _ = train(tmp_path, *run, config="demo_cpu_agent", timeout=1800)
    # Exactly where it stopped: the episodes in flight when it was killed ran again, none counted twice.
    assert "Resumed from" in stdout and f"(step {SAVE_EVERY})" in stdout
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))
    for step in (SAVE_EVERY + 1, SAVE_EVERY + 2):
        assert_same_metrics(before[step], rows[step - 1], tolerance=1e-6)
    # Chance: a random policy rarely calls the tool (one token in 29) and guesses a digit at 1 in 10.
    assert rows[0]["reward/mean"] < 0.15 and rows[0]["tool/call_rate"] < 0.3
    assert sum(r["reward/mean"] for r in rows[-5:]) / 5 >= 0.8
    assert "Target mean reward 0.8 reached." in stdout
    assert rows[-1]["tool/call_rate"] >= 0.9 and rows[-1]["agent/calls_per_episode"] > 1.8
    # The agent keeps its history: every call extends the episode, one sample each, nothing failed.
    odd = [(r["step"], {key: r.get(key) for key in AGENT_METRICS}) for r in rows
           if not (AGENT_METRICS <= set(r) and r["agent/prefix_breaks"] == 0 and r["agent/segments_per_episode"] == 1
                   and r["agent/episodes_failed"] == 0)]
    assert not odd, (odd, controller_warnings(tmp_path))
    # The tokens the trainer scores are the ones the engines sampled, turn by turn through HTTP.
    assert max(r["mismatch/token_mult_prob_error"] for r in rows) <= 1.001
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 5e-5
    assert all(r["response_length/max"] <= 3 and r["multi_turn/turns/max"] <= 3 for r in rows)
