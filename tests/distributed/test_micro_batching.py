"""How a rank's samples are grouped into micro-batches changes nothing but the work: fixed sample counts against
token budgets, right-padded rows against packed ones, at every parallel layout. Log-probs, entropy, the loss, the
gradient norm and the updated weights agree (fp32, 1e-5) with the reference grouping (fixed count, padded rows)
computed by the same ranks, and the padding each grouping computes is what it should be."""
import pytest
import torch

from helpers.parity import config, family_model_dir, long_tailed_batch
from helpers.ranks import build_actor
from helpers.worlds import run_distributed

# reference first: (actor.max_tokens_per_micro_batch, actor.sequence_packing)
GROUPINGS = [(None, False), (None, True), (40, False), (40, True)]


def every_grouping(cfgs, batch):
    """For each config: log-probs of the whole batch, then one update (every DP rank on its slice) from the same
    initial weights, its metrics and the weights after."""
    import dataclasses

    from megatron.core import parallel_state

    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    results = []
    for cfg in cfgs:
        actor = build_actor(cfg)
        outputs = actor.log_probs(batch.split(dp)[rank])
        # Old log-probs near the policy's (shared by every grouping, so the losses compare) with some clipping.
        old = batch.advantages.abs() * 0.1 - 0.5 * batch.response_mask
        metrics = actor.update(dataclasses.replace(batch, old_log_probs=old).split(dp)[rank])
        results.append((outputs, metrics, actor.hf_state_dict()))
    return results


LAYOUTS = {  # name: (family, layers, tp, pp, vpp, ep); MoE at EP=2 on 2 ranks is also DP=2
    "tp2": ("qwen2", 2, 2, 1, 1, 1), "pp2": ("qwen2", 2, 1, 2, 1, 1),
    "pp2-vpp2": ("qwen2", 4, 1, 2, 2, 1), "moe-ep2": ("qwen3_moe", 2, 1, 1, 1, 2),
}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_groupings_agree_at_every_layout(tmp_path, layout):
    family, layers, tp, pp, vpp, ep = LAYOUTS[layout]
    world = 2 if layout == "moe-ep2" else tp * pp
    model_dir = family_model_dir(tmp_path / family, family, tied=False, layers=layers)
    batch = long_tailed_batch()
    cfgs = [config(model_dir, tp, pp, vpp, **{
        "trainer.n_gpus_per_node": world, "actor.expert_model_parallel_size": ep, "actor.micro_batch_size": 2,
        "actor.ppo_mini_batch_size": 8, "rollout.n": 2, "data.train_batch_size": 8, "actor.optim.lr": 1e-2,
        "actor.optim.eps": 1e-2, "actor.entropy_coeff": 0.01, "actor.loss_agg_mode": "seq-mean-token-mean",
        "actor.max_tokens_per_micro_batch": budget or "null", "actor.sequence_packing": packing})
        for budget, packing in GROUPINGS]
    ranks = run_distributed(every_grouping, world, tp, pp, vpp, ep, args=(cfgs, batch))
    owners = [r for r in ranks if r[0][0] is not None]  # the ranks that own DP outputs, in DP order
    mask = batch.response_mask.bool()
    per_grouping = []
    for g in range(len(GROUPINGS)):
        log_probs = torch.cat([r[g][0].log_probs for r in owners])
        entropy = torch.cat([r[g][0].entropy for r in owners])
        per_grouping.append((log_probs, entropy, owners[-1][g][1], ranks[0][g][2]))
    ref_log_probs, ref_entropy, ref_metrics, ref_state = per_grouping[0]
    for (budget, packing), (log_probs, entropy, metrics, state) in zip(GROUPINGS[1:], per_grouping[1:]):
        where = f"{layout}, budget={budget}, packing={packing}"
        assert (log_probs[mask] - ref_log_probs[mask]).abs().max() <= 1e-5, where
        assert (entropy[mask] - ref_entropy[mask]).abs().max() <= 1e-5, where
        for key in ("actor/pg_loss", "actor/entropy_loss", "actor/pg_clipfrac", "actor/grad_norm"):
            assert abs(metrics[key] - ref_metrics[key]) <= 1e-5, (where, key)
        assert max((ref_state[n] - t).abs().max().item() for n, t in state.items()) <= 1e-5, where
    assert 0 < ref_metrics["actor/pg_clipfrac"] < 1
    # Padding: packed rows compute only real tokens, padded rows of a token budget fewer pads than fixed counts.
    # MoE's all-gather dispatcher runs every micro-batch of its expert-parallel peers in one shape: less so there.
    padding = {grouping: per_grouping[i][2]["perf/padding_ratio"] for i, grouping in enumerate(GROUPINGS)}
    assert max(padding[(None, True)], padding[(40, True)]) < min(padding[(None, False)], padding[(40, False)])
    if layout != "moe-ep2":
        assert padding[(40, False)] < padding[(None, False)]
        # Sequence parallelism (on at TP 2) pads each packed row to a multiple of the TP size.
        assert padding[(None, True)] == padding[(40, True)] == 0.0 if tp == 1 else padding[(40, True)] < 0.05
