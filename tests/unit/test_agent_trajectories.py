"""Training on multi-turn trajectories: the loss, lengths and metrics count the model's tokens only, never the tools'
(rl_megatron.agents.Trajectory -> Sample -> TrainBatch, as the trainer builds them)."""
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM

from rl_megatron.agents import Trajectory
from rl_megatron.algorithms import masked_mean
from rl_megatron.algorithms.losses import LossScale, policy_loss
from rl_megatron.batch import UNROUTED, Prompt, SampleStatus, TrainBatch
from rl_megatron.rollout.completions import Completion
from rl_megatron.trainer.metrics import length_metrics, multi_turn_metrics

PROMPT, TURN_1, TOOL_REPLY, TURN_2 = [1, 7, 14, 8, 16], [11, 2], [4, 5, 6, 17], [12, 13, 2]
PAD = 0


def two_turn_sample(log_probs_1=(-0.5, -1.0), log_probs_2=(-0.2, -0.3, -0.4)):
    trajectory = Trajectory(Prompt(PROMPT, "arithmetic", "7", messages=[{"role": "user", "content": "3+4="}]))
    trajectory.add_turn(Completion(TURN_1, list(log_probs_1), SampleStatus.OK), "7")
    trajectory.add_context(TOOL_REPLY, [{"role": "tool", "content": "7"}])
    trajectory.tool_stats.calls, trajectory.tool_stats.tokens = 1, len(TOOL_REPLY)
    trajectory.add_turn(Completion(TURN_2, list(log_probs_2), SampleStatus.OK), "89")
    return trajectory.sample(SampleStatus.OK)


def test_a_forked_episode_is_one_sample_of_its_segments_each_attending_to_itself():
    """A harness that rewrote its history: the second segment's prompt (rendered afresh) is context, masked out, and
    starts a span of its own; every model token keeps its log-prob, version and routing."""
    first = Trajectory(Prompt(PROMPT, "arithmetic", "7", messages=[{"role": "user", "content": "3+4="}]))
    first.add_turn(Completion(TURN_1, [-0.5, -1.0], SampleStatus.OK, versions=[3, 3],
                              routed_experts=np.full((len(PROMPT) + 1, 2, 1), 5, dtype=np.int16)), "7")
    summary = [1, 9, 8, 16]
    second = Trajectory(Prompt(summary, "arithmetic", "7", messages=[{"role": "user", "content": "7?"}]))
    second.add_turn(Completion(TURN_2, [-0.2, -0.3, -0.4], SampleStatus.OK, versions=[4, 4, 4],
                               routed_experts=np.full((len(summary) + 2, 2, 1), 6, dtype=np.int16)), "89")
    sample = first.sample(SampleStatus.OK, [second])
    assert sample.prompt_ids == PROMPT and sample.response_ids == TURN_1 + summary + TURN_2
    assert sample.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert sample.rollout_log_probs == [-0.5, -1.0, 0, 0, 0, 0, -0.2, -0.3, -0.4]
    assert sample.token_versions == [3, 3, 3, 3, 3, 3, 4, 4, 4] and sample.turns == 2
    assert sample.segment_starts == [len(PROMPT) + len(TURN_1)]
    assert sample.messages == second.messages  # the conversation the reward reads: the last segment's
    # Each segment's routing over all its positions (UNROUTED where its engine never fed one), back to back.
    routing = sample.routed_experts[:, 0, 0].tolist()
    assert routing == [5] * 6 + [UNROUTED] + [6] * 6 + [UNROUTED]
    batch = TrainBatch.from_samples([sample, two_turn_sample()], PAD)
    assert batch.position_ids[0].tolist() == [0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4, 5, 6]
    assert batch.position_ids[1].tolist() == list(range(14))
    assert TrainBatch.from_samples([two_turn_sample()], PAD).position_ids is None  # no fork, no positions


def label_log_probs(model, ids: list[int]) -> torch.Tensor:
    """log p(ids[t + 1] | ids[:t + 1]) for every t: the trainer's position convention."""
    logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:]).unsqueeze(-1)).squeeze(-1)


def test_the_trajectory_keeps_the_model_tokens_as_sampled_and_masks_the_rest():
    sample = two_turn_sample()
    assert sample.response_ids == TURN_1 + TOOL_REPLY + TURN_2
    assert sample.loss_mask == [1, 1, 0, 0, 0, 0, 1, 1, 1]
    assert sample.rollout_log_probs == [-0.5, -1.0, 0, 0, 0, 0, -0.2, -0.3, -0.4]
    assert sample.turns == 2 and sample.model_tokens() == 5
    assert [m["role"] for m in sample.messages] == ["user", "assistant", "tool", "assistant"]


def test_masked_loss_over_the_trajectory_equals_the_loss_of_the_model_tokens_alone(tiny_model_dir):
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = TrainBatch.from_samples([two_turn_sample()], PAD)
    old = torch.randn(batch.input_ids.shape) * 0.1 - 2.0  # any old log-probs: the same at the model tokens below
    advantages = torch.full((1,), 0.7)
    scale = LossScale(tokens=5, sequences=1, horizon=16)
    settings = dict(clip_ratio_low=0.2, clip_ratio_high=0.2, agg_mode="token-mean", scale=scale)

    # The trainer's way: one forward over the whole trajectory, the loss masked to the model's tokens.
    whole = torch.nn.functional.pad(label_log_probs(model, batch.input_ids[0].tolist()), (0, 1)).unsqueeze(0)
    masked, _ = policy_loss(whole, old, advantages, batch.response_mask, **settings)
    masked_grads = torch.autograd.grad(masked, list(model.parameters()))

    # Separately: each turn's tokens scored in the context that turn saw, nothing else in the loss.
    first = PROMPT + TURN_1
    second = first + TOOL_REPLY + TURN_2
    turn_1 = label_log_probs(model, first)[-len(TURN_1):]
    turn_2 = label_log_probs(model, second)[-len(TURN_2):]
    own = torch.cat([turn_1, turn_2]).unsqueeze(0)
    positions = batch.response_mask[0].nonzero().squeeze(-1)
    alone, _ = policy_loss(own, old[:, positions], advantages, torch.ones_like(own), **settings)
    alone_grads = torch.autograd.grad(alone, list(model.parameters()))

    assert masked.item() == pytest.approx(alone.item(), abs=1e-6)
    for a, b in zip(masked_grads, alone_grads):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    # And the batch's rollout log-probs sit under the same positions as the model's tokens.
    assert batch.rollout_log_probs[0, positions].tolist() == pytest.approx([-0.5, -1.0, -0.2, -0.3, -0.4])
    assert masked_mean(batch.rollout_log_probs, batch.response_mask).item() == pytest.approx(-2.4 / 5)


def test_lengths_count_the_model_tokens_and_the_multi_turn_metrics():
    sample = two_turn_sample()
    single = two_turn_sample()
    single.messages, single.tool_stats, single.turns = None, None, 1
    metrics = length_metrics([sample])
    assert metrics["response_length/mean"] == 5  # not 9: the tool's reply is no response length
    turns = multi_turn_metrics([sample, single])
    assert turns == pytest.approx({
        "multi_turn/turns/mean": 1.5, "multi_turn/turns/max": 2, "multi_turn/tool_tokens/mean": 2.0,
        "multi_turn/failed": 0.0, "tool/calls/mean": 0.5, "tool/call_rate": 0.5, "tool/errors": 0.0,
        "tool/timeouts": 0.0, "tool/seconds/mean": 0.0, "tool/slot_wait_s/mean": 0.0})
    assert multi_turn_metrics([single]) == {}
