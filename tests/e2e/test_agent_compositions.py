"""The gateway's episodes (configs/demo_cpu_agent.yaml: the `openai` client agent of examples/agents/lookup_openai.py)
through the trainer's other paths, a few steps each: one-step-off with partial rollouts, LoRA adapters served by the
engines under dynamic sampling, streaming with both (and a judge of its own judging each group as it is scored),
and router replay (R3) on an MoE policy whose harness compacts its history (its episodes fork). The demo that learns
is tests/e2e/test_agent_demo.py."""
import pytest
from helpers.runs import train

from rl_megatron.models.tiny import TOOLS, write_tiny_model

# A quarter of the demo's batch (8 prompts x 8 episodes, one update a step): these runs check that the paths compose,
# not that the task is learnt (tests/e2e/test_agent_demo.py), and a step's episodes cost the machine most of its time.
PROMPTS = 8
SMALL_BATCH = (f"data.train_batch_size={PROMPTS}",)

# One-step-off with partial rollouts, the trainer and the engine on a device each (tests/e2e/test_async.py's layout):
# an episode's calls may straddle a weight update, each token keeping the version and log-prob it was sampled with.
ONE_STEP_OFF_PARTIAL = ("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "rollout.placement=separate",
                        "trainer.rollout_staleness=1", "rollout.partial_rollout=true", "trainer.total_steps=6",
                        *SMALL_BATCH)


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
DYNAMIC_SAMPLING = ("algorithm.filter_groups.enable=true", f"data.gen_batch_size={PROMPTS}", *SMALL_BATCH)


def test_gateway_episodes_train_lora_adapters_served_by_the_engines_under_dynamic_sampling(tmp_path):
    _, rows, _ = train(tmp_path, *LORA_SERVED, *DYNAMIC_SAMPLING, "trainer.total_steps=4", "trainer.target_reward=null",
                       config="demo_cpu_agent")
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert all(r["agent/episodes_failed"] == 0 and r["agent/prefix_breaks"] == 0 for r in rows)
    # Only groups whose episodes scored differently are trained on: a batch's worth each step, from as many rounds
    # of a batch's rows as it took.
    assert all(r["filter/kept_groups"] == PROMPTS and r["filter/prompts_used"] == PROMPTS * r["filter/gen_batches"]
               and 0 < r["reward/mean"] < 1 for r in rows)
    # The engines generated through the adapters the trainer holds (they are updated every step): the trainer's
    # recomputed log-probs of the episodes' tokens are the engines' (the lora demo's bound for served adapters).
    assert max(r["mismatch/max_abs_logprob_diff"] for r in rows) < 1e-5


# Streaming (trainer.async_mode=streaming) through the same two paths at once: each episode admitted as the engines
# free up, its calls continued across weight updates, its group filtered as soon as it is scored.
STREAMING = ("trainer.n_gpus_per_node=1", "actor.tensor_model_parallel_size=1", "rollout.placement=separate",
             "trainer.async_mode=streaming", "trainer.total_steps=3", "trainer.target_reward=null")


# A judge on an engine of its own (a random model of the tool demo's vocabulary: its verdicts are noise, at a small
# weight) judges each group as streaming scores it.
def own_judge(folder) -> tuple[str, ...]:
    judge = write_tiny_model(str(folder), with_weights=True, seed=3, vocabulary=TOOLS)
    return ("judge.enable=true", f"judge.model.path={judge}", "judge.prompt_template='{prompt}{response}='",
            "judge.max_tokens=2", "judge.coef=0.01", "ray.num_cpus=3")


def test_gateway_episodes_stream_with_lora_adapters_served_by_the_engines_under_dynamic_sampling(tmp_path):
    _, rows, _ = train(tmp_path, *STREAMING, *LORA_SERVED, *DYNAMIC_SAMPLING, *own_judge(tmp_path / "judge"),
                       config="demo_cpu_agent")
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Every group trained on was judged, and the verdicts are in the rewards the filter and the queue read.
    assert all(r["timing_s/judge"] > 0 and r["judge/too_long"] == 0 for r in rows)
    assert all(r["reward/score"] == pytest.approx(r["reward/acc"] + 0.01 * r["judge/score/mean"], abs=1e-6)
               for r in rows)
    assert all(r["agent/episodes_failed"] == 0 and r["async/staleness/max"] <= 1 for r in rows)
    assert all(r["filter/kept_groups"] == PROMPTS and r["filter/prompts_used"] >= PROMPTS and 0 < r["reward/mean"] < 1
               for r in rows)
    # Batch 1 and every call continued after an update were sampled by the trainer's current adapters: the engines
    # served exactly those.
    current = [r["async/current_version_max_abs_logprob_diff"] for r in rows
               if "async/current_version_max_abs_logprob_diff" in r]
    assert rows[0]["async/current_version_tokens"] == 1.0 and max(current) < 1e-5


def test_forked_gateway_episodes_carry_the_engines_routing_for_router_replay_r3(tmp_path):
    """An MoE policy (a tiny Qwen3-MoE with the tool demo's tokenizer and chat template) through the gateway with
    actor.router_replay=R3, driven by a harness that compacts its history after each tool call (every episode that
    calls the tool forks): every token of every segment keeps the experts the engine routed it through, and the
    trainer's passes, each segment attending to itself, replay them and score the tokens as the engine did."""
    model = str(tmp_path / "tiny-qwen3-moe-tools")
    write_tiny_model(model, vocabulary=TOOLS, moe=True)
    _, rows, _ = train(tmp_path, f"model.path={model}", "actor.tensor_model_parallel_size=1",
                       "actor.expert_model_parallel_size=2", "actor.micro_batch_size=32", "actor.router_replay=R3",
                       "rollout.agent.function=examples/agents/lookup_openai.py:compacting_agent",
                       "trainer.total_steps=3", "trainer.target_reward=null", config="demo_cpu_agent")
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert all(r["agent/episodes_failed"] == 0 and r["agent/calls_per_episode"] > 1 for r in rows)
    assert all(r["agent/prefix_breaks"] > 0 and r["agent/segments_per_episode"] > 1 for r in rows)
    # The engines' routing reached the trainer with the tokens (as in-process: tests/e2e/test_moe_train.py), and the
    # trainer's log-probs of every segment's tokens are the engine's.
    assert all(r["moe/routing_agreement"] >= 0.99 and r["mismatch/max_abs_logprob_diff"] < 1e-5 for r in rows)
