"""A reward model without workers: its scores mixed into the rewards against hand-computed values, the conversations
it scores rendered with its own tokenizer, its section's checks before anything starts (each a ConfigError naming the
key and the fix), where it is placed, the memory plan counting it, and its scores in every step's records."""
import json
import os

import pytest
import torch
from transformers import AutoTokenizer

from helpers.reward_models import reward_model_dir
from helpers.runs import REPO
from rl_megatron.batch import Sample, TrainBatch
from rl_megatron.config import ConfigError
from rl_megatron.config.pools import worker_pools
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.tokenizer import load_tokenizer
from rl_megatron.planning import build_plan
from rl_megatron.planning.memory import rank_parameters
from rl_megatron.preflight import load_config
from rl_megatron.roles import Role
from rl_megatron.trainer.reward_model import RewardModelScorer
from rl_megatron.trainer.rewards import ModelScores, Rewards
from rl_megatron.trainer.rollout_records import RolloutRecords, step_file

DEMO = os.path.join(REPO, "configs", "demo_cpu.yaml")
DEMO_MODEL = os.path.join(REPO, "configs", "models", "tiny-qwen2-digits")
# A reward model of its own: a 3-layer Llama classifier, wider than the demo's 2-layer Qwen2, the digits tokenizer.
WIDER = dict(hidden_size=128, intermediate_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'user' %}={% endif %}{% endfor %}"


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> str:
    return reward_model_dir(tmp_path_factory.mktemp("rm"), "llama", layers=3, **WIDER)


def load_demo(*overrides):
    return load_config(DEMO, [f"model.path={DEMO_MODEL}", *overrides])


def config_error(*overrides) -> str:
    with pytest.raises(ConfigError) as info:
        load_demo(*overrides)
    return str(info.value)


# ---------------------------------------------------------------------------------------------- the rewards

RULE = Rewards(scores=torch.tensor([1.0, 0.0, 1.0]), acc=torch.tensor([1.0, 0.0, 1.0]), penalty=None, stats={})
MODEL = torch.tensor([0.5, -2.0, 1.5])


def scored(cfg) -> list[ModelScores]:
    return [ModelScores("reward_model", MODEL, cfg.reward_model)]


def test_mixed_adds_coef_times_the_models_score_to_the_rules(rm_dir):
    cfg = load_demo(f"reward_model.model.path={rm_dir}", "reward_model.coef=0.5")
    rewards = RULE.with_sources(scored(cfg))
    assert torch.equal(rewards.scores, torch.tensor([1.25, -1.0, 1.75]))
    assert torch.equal(rewards.acc, RULE.acc)  # the rule's accuracy stays what reward/acc reports
    metrics = rewards.metrics()
    assert metrics["reward_model/score/mean"] == pytest.approx(0.0) and metrics["reward_model/score/max"] == 1.5
    assert torch.equal(rewards.select([2, 0]).sources["reward_model"], torch.tensor([1.5, 0.5]))
    assert torch.equal(Rewards.cat([rewards, rewards]).sources["reward_model"], torch.cat([MODEL, MODEL]))


def test_alone_the_models_score_is_the_reward_with_the_overlong_penalty_kept(rm_dir):
    cfg = load_demo(f"reward_model.model.path={rm_dir}", "reward_model.mode=alone", "reward_model.coef=2")
    shaped = Rewards(RULE.scores - 0.25, RULE.acc, torch.tensor([-0.25, -0.25, 0.0]), {})
    assert torch.equal(RULE.with_sources(scored(cfg)).scores, torch.tensor([1.0, -4.0, 3.0]))
    assert torch.equal(shaped.with_sources(scored(cfg)).scores, torch.tensor([0.75, -4.25, 3.0]))


# ------------------------------------------------------------------------------------ what the model reads


def test_a_plain_prompt_is_scored_on_its_text_encoded_by_the_reward_models_tokenizer(rm_dir):
    policy = load_tokenizer(DEMO_MODEL)
    scorer = RewardModelScorer(load_demo(f"reward_model.model.path={rm_dir}"), policy)
    def answer(text):
        return policy.encode(text, add_special_tokens=False)

    response = answer("7") + [policy.eos_token_id]
    samples = [Sample(policy.encode("3+4="), response, [0.0] * len(response), "arithmetic", "7"),
               Sample(policy.encode("12+30="), answer("42"), [0.0, 0.0], "arithmetic", "42")]
    rm_tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    assert scorer.encode(samples[0]) == rm_tokenizer("3+4=7")["input_ids"]  # the end of sequence is not text
    batch = scorer.batch(samples)
    lengths = [len(rm_tokenizer(text)["input_ids"]) for text in ("3+4=7", "12+30=42")]
    assert batch.lengths.tolist() == lengths and batch.pad_id == rm_tokenizer.pad_token_id
    assert batch.input_ids[0, lengths[0]:].eq(batch.pad_id).all()
    # The score is read at each row's last token.
    assert [row.nonzero().flatten().tolist() for row in batch.response_mask] == [[n - 1] for n in lengths]


def test_a_chat_prompt_is_rendered_with_the_reward_models_own_template(rm_dir, tmp_path):
    chat_rm = tmp_path / "chat_rm"
    tokenizer = AutoTokenizer.from_pretrained(rm_dir)
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(chat_rm)
    for name in ("config.json", "model.safetensors"):
        os.symlink(os.path.join(rm_dir, name), chat_rm / name)
    policy = load_tokenizer(DEMO_MODEL)
    scorer = RewardModelScorer(load_demo(f"reward_model.model.path={chat_rm}"), policy)
    sample = Sample(policy.encode("2+2="), policy.encode("4", add_special_tokens=False), [0.0], "arithmetic", "4",
                    prompt_messages=[{"role": "user", "content": "2+2"}])
    assert scorer.conversation(sample) == [{"role": "user", "content": "2+2"}, {"role": "assistant", "content": "4"}]
    assert scorer.encode(sample) == tokenizer.encode("2+2=4", add_special_tokens=False)
    # A multi-turn trajectory: the conversation its loop recorded.
    sample.messages = [{"role": "user", "content": "1+1"}, {"role": "assistant", "content": "2"}]
    assert scorer.encode(sample) == tokenizer.encode("1+1=2", add_special_tokens=False)


# ------------------------------------------------------------------------------------------------ the config


def test_a_reward_model_runs_in_the_actors_workers_or_its_own_pool(rm_dir):
    cfg = load_demo(f"reward_model.model.path={rm_dir}")
    assert [pool.roles for pool in worker_pools(cfg)] == [(Role.ACTOR, Role.ROLLOUT, Role.REWARD_MODEL)]
    separate = load_demo(f"reward_model.model.path={rm_dir}", "reward_model.placement=separate",
                         "reward_model.tensor_model_parallel_size=1")
    assert [(p.name, p.roles, p.world_size) for p in worker_pools(separate)[1:]] == [
        (Role.REWARD_MODEL, (Role.REWARD_MODEL,), 1)]
    assert worker_pools(separate)[1].nodes_key == "reward_model.nnodes"


@pytest.mark.parametrize("overrides,words", [
    (["reward_model.coef=0.5"], ["reward_model.coef", "reward_model.model.path"]),
    (["reward_model.placement=separate"], ["reward_model.placement", "no reward model"]),
    (["reward_model.mode=alone"], ["reward_model.mode", "reward_model.model.path"]),
])
def test_reward_model_keys_without_a_reward_model_are_named(overrides, words):
    message = config_error(*overrides)
    assert all(word in message for word in words), message


def test_the_reward_models_folder_and_schedule_are_checked_before_anything_starts(rm_dir, tmp_path):
    rm = f"reward_model.model.path={rm_dir}"
    # A causal LM is not a reward model.
    message = config_error(f"reward_model.model.path={DEMO_MODEL}")
    assert "is not a sequence classifier" in message and "ForSequenceClassification" in message
    # Two labels: a classifier, not a reward model.
    two = reward_model_dir(tmp_path / "two", "llama", layers=1, num_labels=2)
    assert "2 labels" in config_error(f"reward_model.model.path={two}")
    # Its score head must be in the weights.
    headless = tmp_path / "headless"
    headless.mkdir()
    config = json.load(open(os.path.join(rm_dir, "config.json")))
    json.dump(config, open(headless / "config.json", "w"))
    AutoTokenizer.from_pretrained(rm_dir).save_pretrained(headless)
    from safetensors.torch import load_file, save_file
    weights = load_file(os.path.join(rm_dir, "model.safetensors"))
    save_file({k: v for k, v in weights.items() if k != "score.weight"}, headless / "model.safetensors")
    message = config_error(f"reward_model.model.path={headless}")
    assert "reward_model.model.path" in message and "'score.weight'" in message
    # Colocated, it runs at the actor's layout, and scores after generation: not with groups scored while generating,
    # which a reward model on workers of its own serves (tests/e2e/test_algorithm_variants.py).
    message = config_error(rm, "reward_model.tensor_model_parallel_size=1")
    assert "reward_model.tensor_model_parallel_size=1" in message and "reward_model.placement=separate" in message
    for scored_early in ("algorithm.filter_groups.enable=true", "trainer.async_mode=streaming"):
        message = config_error(rm, scored_early)
        assert scored_early in message and "set reward_model.placement=separate" in message
    own_workers = ("reward_model.placement=separate", "reward_model.n_gpus_per_node=2")
    load_demo(rm, "algorithm.filter_groups.enable=true", *own_workers, "ray.num_cpus=4")
    load_demo(rm, "trainer.async_mode=streaming", "rollout.placement=separate", *own_workers, "ray.num_cpus=5")


# -------------------------------------------------------------------------------------------- the memory plan


def test_the_plan_counts_the_reward_models_weights_and_its_pass(rm_dir):
    cfg = load_config(DEMO, ["trainer.nnodes=2", "trainer.n_gpus_per_node=8", "actor.micro_batch_size=4",
                             "model.dtype=bfloat16", "actor.tensor_model_parallel_size=2",
                             "rollout.gpu_memory_utilization=0.4", f"reward_model.model.path={rm_dir}"])
    rm_params = rank_parameters(read_hf_config(rm_dir), tp=2, value_head=True).total
    pool = build_plan(cfg, gpu_memory_gib=80).pools[0]
    rm = next(role for role in pool.roles if role.name == Role.REWARD_MODEL)
    assert rm.memory_bytes == rm_params * 2 and rm.engine == "Megatron forward"
    assert [phase.name for phase in pool.phases] == ["training", "generation", "weight sync", "reward_model forward"]


# ------------------------------------------------------------------------------------------------ the records


def test_every_steps_records_hold_the_reward_models_score(tmp_path):
    tokenizer = load_tokenizer(DEMO_MODEL)
    samples = [Sample(tokenizer.encode("3+4="), [11, 2], [-0.1, -0.2], "arithmetic", "7")]
    rewards = Rewards(torch.tensor([1.5]), torch.tensor([1.0]), None, {}, {"reward_model": torch.tensor([0.5])})
    samples[0].reward = 1.5
    batch = TrainBatch.from_samples(samples, tokenizer.pad_token_id)
    batch.advantages = batch.response_mask.clone()
    with RolloutRecords(str(tmp_path), tokenizer, purge_after=-1) as records:
        records.write(3, samples, [0], rewards, batch)
    (record,) = [json.loads(line) for line in open(step_file(str(tmp_path), 3))]
    assert (record["score"], record["acc"], record["reward_model_score"]) == (1.5, 1.0, 0.5)
