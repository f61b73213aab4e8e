"""A forked agent episode (its harness rewrote its history: `Trajectory.sample` with later segments) trains as one
sample whose segments attend to themselves only: Megatron's log-probs and entropy of its tokens equal those of each
segment computed as a sample of its own, packed, at TP=2 on a Qwen2 and at TP=1 on a Qwen3-Next (whose Gated DeltaNet
state must start afresh at the fork as attention does)."""
import pytest
import torch

from helpers.parity import config, family_model_dir
from helpers.ranks import build_actor
from helpers.worlds import run_distributed
from rl_megatron.batch import Prompt, SampleStatus, TrainBatch
from rl_megatron.agents import Trajectory
from rl_megatron.rollout.completions import Completion

PAD = 0


def segment(prompt: list[int], response: list[int]) -> Trajectory:
    trajectory = Trajectory(Prompt(prompt, "arithmetic", "7"))
    trajectory.add_turn(Completion(response, [-1.0] * len(response), SampleStatus.OK), "7")
    return trajectory


def both_ways(cfg, forked: TrainBatch, apart: TrainBatch):
    actor = build_actor(cfg)
    return actor.log_probs(forked), actor.log_probs(apart)


@pytest.mark.parametrize("model_type,tp", [("qwen2", 2), ("qwen3_next", 1)])
def test_a_forked_sample_scores_each_segment_as_a_sample_of_its_own(tmp_path, model_type, tp):
    model_dir = family_model_dir(tmp_path / model_type, model_type, tied=False)
    cfg = config(model_dir, tp, 1, **{"actor.micro_batch_size": 4})
    first, second = segment([1, 7, 14, 8, 16], [11, 2, 5]), segment([1, 9, 8, 3, 16, 4], [12, 13, 2])
    other = segment([1, 6, 6, 16], [10, 2])  # a sample of its own beside the fork, in the same packed row
    forked = TrainBatch.from_samples([first.sample(SampleStatus.OK, [second]), other.sample(SampleStatus.OK)], PAD)
    apart = TrainBatch.from_samples([first.sample(SampleStatus.OK), second.sample(SampleStatus.OK),
                                     other.sample(SampleStatus.OK)], PAD)
    assert forked.position_ids is not None and apart.position_ids is None
    joined, alone = run_distributed(both_ways, tp, tp, 1, args=(cfg, forked, apart))[0]
    cut = len(first.context())  # where the second segment starts in the forked row
    for name in ("log_probs", "entropy"):
        got, want = getattr(joined, name), getattr(alone, name)
        # The first segment's response tokens, the second's (its label positions shifted by the cut), the other's.
        pairs = [(got[0, 4:7], want[0, 4:7]), (got[0, cut + 5:cut + 8], want[1, 5:8]), (got[1, 3:5], want[2, 3:5])]
        for fork_part, own in pairs:
            assert (fork_part - own).abs().max() <= 1e-5, (name, fork_part, own)
    # The forked row's mask: the second segment's prompt is context (its labels join no loss).
    assert forked.response_mask[0].tolist()[cut - 1:cut + 5] == [0.0] * 6
