"""A generative judge without workers: its message filled from a sample, the score read from verdicts of every
parser (and refused where a verdict holds none), its section's checks before anything starts, and its scores mixed
into the rewards."""
import os
import types

import pytest
import torch

from helpers.runs import REPO
from rl_megatron.batch import Sample
from rl_megatron.config import ConfigError
from rl_megatron.config.pools import worker_pools
from rl_megatron.doctor.parity import family_model_dir
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.tokenizer import load_tokenizer
from rl_megatron.planning import build_plan
from rl_megatron.planning.memory import GIB
from rl_megatron.preflight import load_config
from rl_megatron.rewards.judge import (encode_message, judge_engine_settings, judge_message, parse_verdict,
                                       template_fields)
from rl_megatron.roles import Role
from rl_megatron.rollout.gate import EngineGate
from rl_megatron.trainer.judge import Judge
from rl_megatron.trainer.rewards import ModelScores, Rewards

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
TOOLS_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-tools")  # a tokenizer with a chat template
DIGITS_TEMPLATE = "judge.prompt_template='{prompt}{response}='"  # the digits vocabulary writes nothing else
FITS = ("rollout.max_model_len=32", "judge.max_tokens=2")


def config_error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(DEMO, list(overrides))
    return str(info.value)


@pytest.mark.parametrize("verdict,parser,score", [
    ("8", "number", 8.0), ("Score: 7.5 out of 10, final: -2", "number", -2.0), ("It is right.", "number", None),
    ("so \\boxed{9} but \\boxed{ 10 }", "boxed", 10.0), ("\\boxed{ten}", "boxed", None), ("9", "boxed", None),
    ('{"score": 3} then {"reason": "x", "score": 4.5}', "json", 4.5), ('{"score": true}', "json", None),
    ('{"score": 7', "json", None), ('{"other": 1} {"score": "8"}', "json", None), ("1e999", "number", None),
])
def test_a_verdicts_score_by_each_parser(verdict, parser, score):
    assert parse_verdict(verdict, parser) == score


def test_the_message_fills_the_template_with_the_samples_text():
    assert template_fields("Q: {prompt} A: {response} ({{note}}) gt={ground_truth}") == {
        "prompt", "response", "ground_truth"}
    assert judge_message("Q: {prompt} A: {response} {{x}} {ground_truth}", "3+4", "7", 7) == "Q: 3+4 A: 7 {x} 7"
    cfg = load_config(DEMO, ["judge.enable=true", DIGITS_TEMPLATE, *FITS])
    tokenizer = load_tokenizer(cfg.model.path)
    judge = Judge(cfg, tokenizer)
    sample = Sample(tokenizer.encode("3+4="), tokenizer.encode("7", add_special_tokens=False) + [2], [0.0, 0.0],
                    "arithmetic", "7")
    assert judge.message(sample) == "3+4=7="  # the prompt's text, the response without its end of sequence
    # A chat prompt: its last user message is the question.
    sample.prompt_messages = [{"role": "system", "content": "1+1="}, {"role": "user", "content": "2+2="}]
    assert judge.message(sample) == "2+2=7="
    # Plain text without a chat template; the user's turn through one, the assistant's opened.
    assert encode_message(tokenizer, "3+4=7=") == tokenizer("3+4=7=")["input_ids"]
    chat = load_tokenizer(TOOLS_MODEL)
    assert encode_message(chat, "hi") == chat.apply_chat_template([{"role": "user", "content": "hi"}],
                                                                  add_generation_prompt=True, tokenize=True,
                                                                  return_dict=True)["input_ids"]


def test_judge_scores_enter_the_rewards_scaled_with_failures_counted():
    cfg = load_config(DEMO, ["judge.enable=true", DIGITS_TEMPLATE, *FITS, "judge.coef=0.5", "judge.mode=alone"])
    rule = Rewards(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), None, {"reward/errors": 0.0})
    judged = ModelScores("judge", torch.tensor([0.8, 0.2]), cfg.judge, {"judge/parse_failures": 1.0})
    rewards = rule.with_sources([judged])
    assert torch.allclose(rewards.scores, torch.tensor([0.4, 0.1]))  # alone: 0.5 x the judge's, the rule's dropped
    assert rewards.metrics()["judge/parse_failures"] == 1.0 and rewards.metrics()["judge/score/mean"] == 0.5
    assert torch.equal(judged.select([1, 0]).scores, torch.tensor([0.2, 0.8]))
    # A reward model and a judge, both mixed: each added at its weight.
    both = load_config(DEMO, ["judge.enable=true", DIGITS_TEMPLATE, *FITS])
    model = ModelScores("reward_model", torch.tensor([1.0, -1.0]), both.reward_model)
    mixed = rule.with_sources([model, ModelScores("judge", torch.tensor([0.8, 0.2]), both.judge)])
    assert torch.allclose(mixed.scores, torch.tensor([2.8, -0.8]))


def test_the_judges_section_is_checked_before_anything_starts():
    message = config_error("judge.enable=true", "judge.prompt_template='Rate {answer}'", *FITS)
    assert "judge.prompt_template names {answer}" in message and "{prompt}, {response}, {ground_truth}" in message
    # The demo's engines hold 9 tokens: a judge's message and verdict need more, and the message says how many.
    message = config_error("judge.enable=true", DIGITS_TEMPLATE)
    assert "rollout.max_model_len=9" in message and "set rollout.max_model_len=" in message
    # Streaming scores each group as it finishes, on the policy's engines, which a self-judge would share: a judge of
    # its own judges each group then (tests/e2e/test_agent_compositions.py); dynamic sampling's rounds are judged one
    # by one (below, and tests/e2e/test_algorithm_variants.py).
    message = config_error("judge.enable=true", DIGITS_TEMPLATE, *FITS, "trainer.async_mode=streaming")
    assert "trainer.async_mode=streaming" in message and "set judge.model.path to a judge of its own" in message
    load_config(DEMO, ["judge.enable=true", DIGITS_TEMPLATE, *FITS, "algorithm.filter_groups.enable=true",
                       "data.gen_batch_size=32"])
    assert "judge.score_scale" in config_error("judge.enable=true", "judge.score_scale=0")


# ------------------------------------------------------------------------------------------ a judge of its own


@pytest.fixture(scope="module")
def judge_dir(tmp_path_factory) -> str:
    """A 2-layer Llama with weights and the digits tokenizer (max_position_embeddings 64)."""
    return family_model_dir(tmp_path_factory.mktemp("judge"), "llama", tied=False, layers=2)


def test_a_judge_of_its_own_gets_a_pool_of_engines_in_the_plan(judge_dir):
    cfg = load_config(DEMO, ["judge.enable=true", f"judge.model.path={judge_dir}", DIGITS_TEMPLATE,
                             "judge.max_tokens=2", "judge.n_gpus_per_node=2", "judge.tensor_parallel_size=2"])
    assert [(pool.name, pool.roles, pool.world_size) for pool in worker_pools(cfg)] == [
        (Role.ACTOR, (Role.ACTOR, Role.ROLLOUT), 2), (Role.JUDGE, (Role.JUDGE,), 2)]
    settings = judge_engine_settings(cfg, read_hf_config(judge_dir))
    assert (settings.tensor_parallel_size, settings.max_model_len, settings.max_tokens) == (2, 64, 2)
    assert settings.top_p == cfg.rollout.top_p and not settings.partial_rollout
    pool = build_plan(cfg, gpu_memory_gib=80).pools[1]
    (judge,) = pool.roles
    assert (judge.name, judge.engine, judge.layout) == (Role.JUDGE, "vLLM", "TP=2, 1 engines")
    assert judge.memory_bytes == int(0.9 * 80 * GIB) and "judge.gpu_memory_utilization=0.9" in judge.memory_note
    # Its messages and verdicts against its own length, with its own tokenizer.
    message = config_error("judge.enable=true", f"judge.model.path={judge_dir}", DIGITS_TEMPLATE,
                           "judge.max_model_len=10", "judge.max_tokens=2")
    assert "the judge's engines" in message and "set judge.max_model_len=13" in message
    # The policy's engines judge where the judge has no engines: the pools say which.
    assert Role.JUDGE not in {pool.name for pool in worker_pools(load_config(DEMO, ["judge.enable=true",
                                                                                    DIGITS_TEMPLATE, *FITS]))}
    # With engines of its own it judges each streamed group as it is scored.
    load_config(DEMO, ["judge.enable=true", f"judge.model.path={judge_dir}", DIGITS_TEMPLATE, "judge.max_tokens=2",
                       "trainer.async_mode=streaming", "rollout.placement=separate", "ray.num_cpus=4"])


@pytest.mark.parametrize("overrides,words", [
    (["judge.coef=0.5"], ["judge.coef is set, but judge.enable=false"]),
    (["judge.model.path=/models/judge"], ["judge.model.path is set, but judge.enable=false"]),
    (["judge.enable=true", "judge.model.path=configs/models/tiny-qwen2-digits", "judge.tensor_parallel_size=2",
      DIGITS_TEMPLATE], ["judge.tensor_parallel_size=2 does not divide the judge pool's 1 devices"]),
    (["judge.enable=true", "judge.tensor_parallel_size=2", DIGITS_TEMPLATE, *FITS],
     ["judge.tensor_parallel_size is set, but judge.model.path=null", "no engines of its own"]),
])
def test_judge_keys_without_a_judge_are_named(overrides, words):
    message = config_error(*overrides)
    assert all(word in message for word in words), message


def test_the_judge_renders_with_its_own_tokenizer_and_generates_on_its_own_engines(judge_dir, tmp_path):
    """The samples are the policy's tokens: decoded with the policy's tokenizer, the message encoded with the judge's
    (here one with a chat template), the verdicts asked of the judge's engines where it has some."""
    chat_judge = tmp_path / "chat_judge"
    load_tokenizer(TOOLS_MODEL).save_pretrained(chat_judge)
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(judge_dir, name), chat_judge / name)
    cfg = load_config(DEMO, ["judge.enable=true", f"judge.model.path={judge_dir}", DIGITS_TEMPLATE,
                             "judge.max_tokens=2"])
    cfg.judge.model.path = str(chat_judge)  # the judge's tokenizer only: the digits policy's cannot write its markup
    policy = load_tokenizer(cfg.model.path)
    judge = Judge(cfg, policy)
    assert judge.tokenizer is not policy and judge.max_model_len == 64
    sample = Sample(policy.encode("3+4="), policy.encode("7", add_special_tokens=False), [0.0], "arithmetic", "7")
    assert judge.message(sample) == "3+4=7="
    own, policy_engines = types.SimpleNamespace(meshes=[{"rollout": (0, 3, True)}]), object()
    judge.connect(policy_engines, {Role.JUDGE: own})
    assert judge.engines.group is own and judge.engines.count == 3
    judge.connect(policy_engines, {})
    assert judge.engines is policy_engines


def test_with_partial_rollouts_a_weight_sync_waits_for_the_self_judges_verdicts():
    """With partial rollouts the generation thread does not hold the policy's engines for a whole rollout (each
    request pauses for a sync on its own): the judge's verdicts hold them through the gate meanwhile."""
    cfg = load_config(DEMO, ["judge.enable=true", DIGITS_TEMPLATE, *FITS])
    policy = load_tokenizer(cfg.model.path)
    judge, gate = Judge(cfg, policy), EngineGate()
    held = []

    class Engines:
        def generate(self, prompts, sampling):
            held.append(gate._users)
            return [Sample(p.ids, policy.encode("7", add_special_tokens=False), [0.0], "judge", None) for p in prompts]

    engines = Engines()
    engines.gate = gate
    judge.connect(engines, {})
    sample = Sample(policy.encode("3+4="), policy.encode("7", add_special_tokens=False), [0.0], "arithmetic", "7")
    scores = judge.scores([sample, sample], step=3)
    assert held == [1] and gate._users == 0  # the gate held while generating, let go after
    assert torch.allclose(scores.scores, torch.tensor([0.7, 0.7])) and scores.stats["judge/parse_failures"] == 0


def test_under_dynamic_sampling_each_round_is_judged_with_seeds_of_its_own():
    """The filter reads the rewards trained on: each round's verdicts join its rewards before the filter keeps its
    groups, sampled with the round's own request seeds (as the round's samples are)."""
    cfg = load_config(DEMO, ["judge.enable=true", DIGITS_TEMPLATE, *FITS, "judge.score_scale=10",
                             "algorithm.filter_groups.enable=true", "data.gen_batch_size=32"])
    policy = load_tokenizer(cfg.model.path)
    judge, purposes = Judge(cfg, policy), []

    class Engines:
        gate = None

        def generate(self, prompts, sampling):
            purposes.append((sampling.purpose, sampling.step))
            return [Sample(p.ids, policy.encode("8", add_special_tokens=False), [0.0], "judge", None) for p in prompts]

    judge.connect(Engines(), {})
    sample = Sample(policy.encode("3+4="), policy.encode("7", add_special_tokens=False), [0.0], "arithmetic", "7")
    rule = Rewards(torch.tensor([1.0, 0.0]), torch.tensor([1.0, 0.0]), None, {"reward/errors": 0.0})
    first, second = (rule.with_sources([judge.scores([sample, sample], 5, round_)]) for round_ in (1, 2))
    assert purposes == [("judge", 5), ("judge round 2", 5)]
    assert torch.allclose(first.scores, torch.tensor([1.8, 0.8])) and torch.equal(first.acc, rule.acc)
    assert torch.allclose(Rewards.cat([first, second]).sources["judge"], torch.full((4,), 0.8))
