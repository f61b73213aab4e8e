"""Your own agent, end to end: `make demo-agent` (configs/demo_cpu_agent.yaml) trains the tool demo's task through
the OpenAI-compatible gateway, driven by an agent written with the official `openai` client
(examples/agents/lookup_openai.py), and learns from chance to the 0.8 target, killed with SIGKILL on the way and
resumed exactly by the same command. One run serves every assert."""
import os
import signal

from helpers.runs import assert_same_metrics, latest_checkpoint, read_rows_if_any, start_until, train, train_command

from rl_megatron.models.tiny import TOOLS, write_tiny_model

AGENT_METRICS = {"agent/calls_per_episode", "agent/prefix_breaks", "agent/samples_per_episode",
                 "agent/untrained_tokens", "agent/episode_s", "agent/episode_s_max", "agent/episodes_failed"}


# The run is SIGKILLed (the whole process group: the controller, its gateway and agents, the workers) once it has
# logged two steps past its first checkpoint; the same command resumes there, re-running the episodes of those steps.
SAVE_EVERY = 20


def test_an_openai_client_agent_learns_through_the_gateway(tmp_path):
    # ~510 HTTP calls a step through the `openai` client, ~4 ms of the controller's CPU each: ~10 minutes on two
    # cores shared with the suite's other worker (docs/benchmarks.md).
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
    assert all(AGENT_METRICS <= set(r) and r["agent/prefix_breaks"] == 0 and r["agent/samples_per_episode"] == 1
               and r["agent/untrained_tokens"] == 0 and r["agent/episodes_failed"] == 0 for r in rows)
    # The tokens the trainer scores are the ones the engines sampled, turn by turn through HTTP.
    assert max(r["mismatch/token_mult_prob_error"] for r in rows) <= 1.001
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 5e-5
    assert all(r["response_length/max"] <= 3 and r["multi_turn/turns/max"] <= 3 for r in rows)


# One-step-off with partial rollouts, the trainer and the engine on a device each (tests/e2e/test_async.py's layout):
# an episode's calls may straddle a weight update, each token keeping the version and log-prob it was sampled with.
ONE_STEP_OFF_PARTIAL = ("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "rollout.placement=separate",
                        "trainer.rollout_staleness=1", "rollout.partial_rollout=true", "trainer.total_steps=6")


def test_gateway_episodes_run_one_step_off_with_partial_rollouts(tmp_path):
    # Multi-turn episodes with partial rollouts hung at the first weight sync before (a use of the engines outlived
    # its batch: tests/unit/test_rollout_ahead.py); where updates land is timing, so only what holds anyway is checked.
    _, rows, _ = train(tmp_path, *ONE_STEP_OFF_PARTIAL, config="demo_cpu_agent")
    assert [r["step"] for r in rows] == list(range(1, 7))
    assert all(r["async/staleness/max"] <= 1 and r["async/dropped"] == 0 and r["agent/episodes_failed"] == 0
               for r in rows)
    # The tokens the newest weights sampled agree with the trainer as in synchronous RL, mid-episode or not (a step
    # whose batch holds none of them logs neither figure).
    current = [r["async/current_version_max_abs_logprob_diff"] for r in rows
               if "async/current_version_max_abs_logprob_diff" in r]
    assert current and max(current) < 5e-5
    assert rows[0]["async/current_version_tokens"] == 1.0


# The gateway's episodes through two more of the trainer's paths at once, a few steps: LoRA adapters served by the
# engines themselves (verified bit for bit at each sync) and dynamic sampling (groups whose episodes all score the
# same are dropped and more rows generated until a batch's worth vary).
LORA_SERVED = ("actor.lora.rank=16", "actor.lora.alpha=32", "actor.lora.target_modules=[all-linear]",
               "resharding.verify=true")
DYNAMIC_SAMPLING = ("algorithm.filter_groups.enable=true", "data.gen_batch_size=32")


def test_gateway_episodes_train_lora_adapters_served_by_the_engines_under_dynamic_sampling(tmp_path):
    _, rows, _ = train(tmp_path, *LORA_SERVED, *DYNAMIC_SAMPLING, "trainer.total_steps=4", "trainer.target_reward=null",
                       config="demo_cpu_agent")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["agent/episodes_failed"] == 0 and r["agent/prefix_breaks"] == 0 for r in rows)
    # Only groups whose episodes scored differently are trained on: a batch's worth each step, from as many rounds
    # of 32 rows as it took.
    assert all(r["filter/kept_groups"] == 32 and r["filter/prompts_used"] == 32 * r["filter/gen_batches"]
               and 0 < r["reward/mean"] < 1 for r in rows)
    # The engines generated through the adapters the trainer holds (they are updated every step): the trainer's
    # recomputed log-probs of the episodes' tokens are the engines' (the lora demo's bound for served adapters).
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-5


# Streaming (trainer.async_mode=streaming) through the same two paths at once: each episode admitted as the engines
# free up, its calls continued across weight updates, its group filtered as soon as it is scored.
STREAMING = ("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "rollout.placement=separate",
             "trainer.async_mode=streaming", "trainer.total_steps=5", "trainer.target_reward=null")


def test_gateway_episodes_stream_with_lora_adapters_served_by_the_engines_under_dynamic_sampling(tmp_path):
    _, rows, _ = train(tmp_path, *STREAMING, *LORA_SERVED, *DYNAMIC_SAMPLING, config="demo_cpu_agent")
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["agent/episodes_failed"] == 0 and r["async/staleness/max"] <= 1 for r in rows)
    assert all(r["filter/kept_groups"] == 32 and r["filter/prompts_used"] >= 32 and 0 < r["reward/mean"] < 1
               for r in rows)
    # Batch 1 and every call continued after an update were sampled by the trainer's current adapters: the engines
    # served exactly those.
    current = [r["async/current_version_max_abs_logprob_diff"] for r in rows
               if "async/current_version_max_abs_logprob_diff" in r]
    assert rows[0]["async/current_version_tokens"] == 1.0 and max(current) < 1e-5


def test_gateway_episodes_carry_the_engines_routing_for_router_replay_r3(tmp_path):
    """An MoE policy (a tiny Qwen3-MoE with the tool demo's tokenizer and chat template) through the gateway with
    actor.router_replay=R3: every token of every call keeps the experts the engine routed it through, and the
    trainer's passes replay them."""
    model = str(tmp_path / "tiny-qwen3-moe-tools")
    write_tiny_model(model, vocabulary=TOOLS, moe=True)
    _, rows, _ = train(tmp_path, f"model.path={model}", "actor.tensor_model_parallel_size=1",
                       "actor.expert_model_parallel_size=2", "actor.micro_batch_size=64", "actor.router_replay=R3",
                       "trainer.total_steps=3", "trainer.target_reward=null", config="demo_cpu_agent")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["agent/episodes_failed"] == 0 and r["agent/calls_per_episode"] > 1 for r in rows)
    # The engines' routing reached the trainer with the tokens (as in-process: tests/e2e/test_moe_train.py).
    assert all(r["moe/routing_agreement"] >= 0.99 and r["mismatch/max_abs_logprob_diff"] < 1e-5 for r in rows)
