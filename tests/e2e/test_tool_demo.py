"""Agentic RL with tools, end to end: `python -m rl_megatron.train --config configs/demo_cpu_tools.yaml` learns to call
the lookup tool and answer from its reply, from reward alone. (That the asynchronous and turn-synchronous schedules
draw the same trajectories, and how much faster the first is: test_bench_cli's multi_turn bench.)"""
from helpers.runs import train

MULTI_TURN_METRICS = {"multi_turn/turns/mean", "multi_turn/turns/max", "multi_turn/tool_tokens/mean",
                      "multi_turn/failed", "tool/calls/mean", "tool/call_rate", "tool/errors", "tool/timeouts",
                      "tool/seconds/mean", "tool/slot_wait_s/mean", "timing_s/gen"}


def test_tool_demo_learns_to_call_the_tool(tmp_path):
    stdout, rows, _ = train(tmp_path, config="demo_cpu_tools")
    # Chance: a random policy rarely calls the tool (one token in 29) and guesses a digit at 1 in 10.
    assert rows[0]["reward/mean"] < 0.15 and rows[0]["tool/call_rate"] < 0.3
    assert sum(r["reward/mean"] for r in rows[-5:]) / 5 >= 0.8
    assert rows[-1]["tool/call_rate"] >= 0.9
    assert "Target mean reward 0.8 reached." in stdout
    assert all(MULTI_TURN_METRICS <= set(r) and r["multi_turn/failed"] == 0 and r["tool/timeouts"] == 0
               for r in rows)
    # One token per turn (rollout.max_tokens=1), at most 3 turns: lengths count the model's tokens, not the
    # template's and the tool's (2 of the turns' tokens vs ~14 spliced per call).
    assert all(r["response_length/max"] <= 3 and r["multi_turn/turns/max"] <= 3 for r in rows)
    assert rows[-1]["multi_turn/turns/mean"] > 1.8 and rows[-1]["multi_turn/tool_tokens/mean"] > 10
    # Trainer (Megatron, over whole trajectories) and sampler (vLLM, turn by turn) agree on the model's tokens.
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 5e-5
