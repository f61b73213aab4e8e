"""Activation recomputation and sequence parallelism change what is kept between the forward and the backward pass,
and how the sequence is split between layers, never the numbers: the gradients of one PPO update with each
recompute mode equal those without (<= 1e-6, fp32), and a dense model at TP=2 gives the same log-probs, losses,
gradients and updated weights with sequence parallelism as without (<= 1e-5). Each run also measures what autograd
saved (`rl_megatron.bench.recompute.saved_activation_bytes`), so that a mode that silently did nothing fails.

One spawned run per layout checks every mode, building one actor per mode in the same processes."""
import dataclasses

import pytest
import torch

from helpers.parity import SEQ, config, family_model_dir, make_batch
from rl_megatron.batch import TrainBatch
from helpers.worlds import run_distributed

FULL_UNIFORM_1 = {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
RECOMPUTE_MODES = {  # over a 4-layer model: groups of 2, and 3 of the 4 layers recomputed (the 4th kept)
    "off": {},
    "full_uniform": {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 2},
    "full_block": {"recompute_granularity": "full", "recompute_method": "block", "recompute_num_layers": 3},
    "selective": {"recompute_granularity": "selective"},
}
# Adam's first step is ~lr * sign(gradient); a large epsilon makes it proportional to the gradient, so that the
# updated weights reflect the gradients themselves (as in test_ppo_invariance).
OPTIMIZER = {"actor.optim.lr": 1e-2, "actor.optim.eps": 1e-2, "critic.optim.lr": 1e-2, "critic.optim.eps": 1e-2}


def ppo_batch() -> TrainBatch:
    """11 tokens (odd: sequence parallelism at TP=2 pads them and crops the outputs), per-token advantages and old
    log-probs near a tiny random model's (about log(1/vocab)), so that part of the ratios clip; values and returns
    for the critic."""
    batch = make_batch(18).truncated(SEQ - 1)
    mask, g = batch.response_mask, torch.Generator().manual_seed(2)
    noise = lambda: torch.randn(mask.shape, generator=g) * mask  # noqa: E731
    return dataclasses.replace(batch, advantages=batch.advantages[:, None] * mask,
                               old_log_probs=-3.0 * mask + 0.3 * noise(), values=0.5 * noise(),
                               returns=0.5 * noise() + mask)


def with_keys(cfg, section: str, keys: dict):
    """`cfg` with `keys` set in one of its sections after loading (every combination here passes the load-time
    checks, tests/unit/test_activation_config.py)."""
    return dataclasses.replace(cfg, **{section: dataclasses.replace(getattr(cfg, section), **keys)})


def grads(model) -> dict[str, torch.Tensor]:
    """This rank's gradients of its last update (Megatron's DDP keeps them in main_grad until the next one)."""
    return {name: param.main_grad.clone() for chunk in model.model for name, param in chunk.named_parameters()
            if param.requires_grad}


def update_each_mode(batch: TrainBatch, runs: dict) -> dict:
    """`runs`: name -> (config, the actor's modes, the critic's modes), a mode being the keys it sets in the role's
    section. Per (run, role, mode): the settings as Megatron got them, what one training forward saved, and the
    metrics, gradients and updated weights of one update (the whole batch: one mini-batch)."""
    from rl_megatron.bench.recompute import saved_activation_bytes
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.megatron_actor import MegatronActor
    from rl_megatron.workers.megatron_critic import MegatronCritic

    out = {}
    for run, (cfg, actor_modes, critic_modes) in runs.items():
        hf = read_hf_config(cfg.model.path)
        for role, modes in (("actor", actor_modes), ("critic", critic_modes)):
            for mode, keys in modes.items():
                model = (MegatronActor if role == "actor" else MegatronCritic)(with_keys(cfg, role, keys), hf,
                                                                                optimizer_steps=10)
                config, actor = model.chunks[0].config, role == "actor"
                saved = saved_activation_bytes(model, batch)
                log_probs = model.log_probs(batch) if actor else None
                metrics = model.update(batch)
                out[run, role, mode] = {
                    "megatron": (config.sequence_parallel, config.recompute_granularity, config.recompute_method),
                    "saved": saved, "log_probs": log_probs, "metrics": metrics, "grads": grads(model),
                    "weights": model.hf_state_dict() if actor else {}}
    return out


def max_difference(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[name] - b[name]).abs().max().item() for name in a)


def check_same_update(result: dict, reference: dict, tolerance: float) -> None:
    assert max_difference(result["grads"], reference["grads"]) <= tolerance
    for key, value in reference["metrics"].items():
        if key != "perf/padding_ratio":  # sequence parallelism pads rows to a multiple of TP: more, by design
            assert abs(result["metrics"][key] - value) <= tolerance, key
    if reference["weights"]:  # the actor's, on rank 0 (the export is empty elsewhere)
        assert max_difference(result["weights"], reference["weights"]) <= tolerance


def test_recompute_modes_give_the_gradients_of_no_recompute(tmp_path):
    """TP=1, 4 layers: every recompute mode of the actor, and full recomputation of the critic."""
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False, layers=4)
    cfg = config(model_dir, 1, 1, **OPTIMIZER, **{"trainer.n_gpus_per_node": 1, "algorithm.adv_estimator": "gae"})
    runs = {"tp1": (cfg, RECOMPUTE_MODES, {"off": {}, "full": FULL_UNIFORM_1})}
    results = run_distributed(update_each_mode, 1, args=(ppo_batch(), runs))[0]
    off = results["tp1", "actor", "off"]
    assert 0 < off["metrics"]["actor/pg_clipfrac"] < 1 and off["metrics"]["actor/grad_norm"] > 0
    for mode, keys in RECOMPUTE_MODES.items():
        result = results["tp1", "actor", mode]
        assert result["megatron"] == (False, keys.get("recompute_granularity"), keys.get("recompute_method"))
        check_same_update(result, off, tolerance=1e-6)
        if mode != "off":  # it recomputed: less was kept for the backward pass
            assert result["saved"] < off["saved"], mode
    # Full recomputation in groups of 2 keeps two layers' inputs; block keeps the 4th layer's activations too.
    assert results["tp1", "actor", "full_uniform"]["saved"] < results["tp1", "actor", "full_block"]["saved"]
    critic_off, critic_full = results["tp1", "critic", "off"], results["tp1", "critic", "full"]
    assert critic_full["megatron"] == (False, "full", "uniform") and critic_off["megatron"][1] is None
    check_same_update(critic_full, critic_off, tolerance=1e-6)
    assert critic_full["saved"] < critic_off["saved"] / 2


@pytest.fixture(scope="module")
def tp2_results(tmp_path_factory):
    """One run of two ranks at TP=2: a dense Qwen2 with sequence parallelism off, on (GPU's default), and on with full
    recomputation; a Qwen3-MoE (sequence parallelism on, its experts split over the TP ranks) without and with full
    recomputation. Per rank: `update_each_mode`'s results."""
    folder = tmp_path_factory.mktemp("tp2")
    dense, moe = (config(family_model_dir(folder / family, family, tied=False), 2, 1, **OPTIMIZER)
                  for family in ("qwen2", "qwen3_moe"))
    runs = {"dense": (dense, {"sp_off": {"sequence_parallel": False}, "sp_on": {"sequence_parallel": True},
                              "sp_full": {"sequence_parallel": True, **FULL_UNIFORM_1}}, {}),
            "moe": (moe, {"off": {}, "full": FULL_UNIFORM_1}, {})}
    return run_distributed(update_each_mode, 2, 2, args=(ppo_batch(), runs))


def test_sequence_parallelism_at_tp2_equals_no_sequence_parallelism(tp2_results):
    """A dense model at TP=2: sequence parallelism on against off, and full recomputation under it."""
    mask = ppo_batch().response_mask.bool()
    for rank, results in enumerate(tp2_results):
        off, on, full = (results["dense", "actor", mode] for mode in ("sp_off", "sp_on", "sp_full"))
        assert (off["megatron"], on["megatron"], full["megatron"]) == ((False, None, None), (True, None, None),
                                                                      (True, "full", "uniform"))
        check_same_update(on, off, tolerance=1e-5)
        check_same_update(full, on, tolerance=1e-6)
        # Each rank keeps half of the sequence between the layers: less saved for the backward pass.
        assert on["saved"] < off["saved"]
        if rank == 0:  # the first TP rank returns the log-probs (cropped back to the batch's 11 positions)
            assert on["log_probs"].log_probs.shape == mask.shape
            for name in ("log_probs", "entropy"):
                a, b = getattr(on["log_probs"], name), getattr(off["log_probs"], name)
                assert (a[mask] - b[mask]).abs().max() <= 1e-5, name
    assert tp2_results[0]["dense", "actor", "sp_off"]["weights"], "rank 0 exports the updated weights"


def test_full_recompute_of_an_moe_model_counts_the_routing_once(tp2_results):
    """Qwen3-MoE at TP=2: the same gradients with full recomputation, and the router metrics count each routed
    token once although every layer runs forward twice (without a graph, then again in the backward pass)."""
    for results in tp2_results:
        off, full = results["moe", "actor", "off"], results["moe", "actor", "full"]
        assert full["megatron"] == (True, "full", "uniform")
        check_same_update(full, off, tolerance=1e-6)  # the moe/* metrics too
        assert full["saved"] < off["saved"]
        assert off["metrics"]["moe/load_max"] > 0
