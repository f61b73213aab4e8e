"""The resharding module end to end on gloo: Megatron shards at every layout of the grid -> real vLLM engines
(TP 1 and 2), of the dense families. The engines' weights equal the trainer's HF export bit for bit, and they
generate what `transformers` generates with those weights."""
import pytest
import torch

from helpers.parity import config, family_model_dir
from helpers.ranks import check_engines_hold_the_trainer_weights
from rl_megatron.models.tiny import QWEN2_5_YARN
from helpers.worlds import run_distributed

# (train TP, PP, VPP) -> engine TP, tied embeddings or not; auto reads peers' shards in place, the two channels
# send buckets. Besides Qwen2: Llama 3.2 (tied, Llama 3.1's rope scaling), Mistral with a sliding window shorter
# than the prompts and answers, and Qwen2.5's YaRN (its attention factor scales vLLM's rotary embedding).
# (The process_group channel's exactness: test_moe's engine tests and the reshard benchmark's test.)
LLAMA3_2 = {"rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                             "original_max_position_embeddings": 16}}
GRID = [(2, 1, 1, 2, True, "shared_memory", "llama", LLAMA3_2),
        (1, 2, 1, 1, True, "auto", "mistral", {"sliding_window": 4}),
        (2, 2, 1, 2, False, "shared_memory", "qwen2", QWEN2_5_YARN),
        (1, 2, 2, 2, False, "auto", "qwen2", {})]


@pytest.mark.parametrize("tp,pp,vpp,engine_tp,tied,channel,family,extra", GRID)
def test_engines_hold_the_trainer_weights_exactly(tmp_path, tp, pp, vpp, engine_tp, tied, channel, family, extra):
    model_dir = family_model_dir(tmp_path / family, family, tied, layers=2 * vpp, **extra)
    check_engines_hold_the_trainer_weights(model_dir, tp, pp, vpp, 1, engine_tp, channel)


def plan_errors_leave_the_engine_untouched(cfg, engine_model_dir: str, drop_from_table: str | None):
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.resharding import PlanError, Resharder
    from rl_megatron.rollout.vllm_engine import VLLMEngine
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=10)
    if drop_from_table:
        del actor.table.layer[drop_from_table]
    engine = VLLMEngine(engine_model_dir, cfg.rollout, "float32", seed=0)
    try:
        before = {n: p.clone() for n, p in engine.model().named_parameters()}
        with pytest.raises(PlanError) as error:
            Resharder(*actor.weight_sources(), engine.sync_targets(), bucket_bytes=1 << 20)
        untouched = all(torch.equal(before[n], p) for n, p in engine.model().named_parameters())
        return str(error.value), untouched
    finally:
        engine.close()


# The plan's shape check itself: tests/unit/test_resharding_plan.py; here through a real engine, one case in CI.
@pytest.mark.parametrize("case", ["table misses a parameter",
                                  pytest.param("engine model of another shape", marks=pytest.mark.slow)])
def test_a_plan_that_does_not_fit_fails_before_any_byte_moves(tmp_path, case):
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied=False)
    cfg = config(model_dir, 1, 1)
    if case == "table misses a parameter":
        engine_dir, drop = model_dir, "mlp.linear_fc2.weight"
    else:
        import json

        engine_dir, drop = family_model_dir(tmp_path / "wider", "qwen2", tied=False), None
        with open(f"{engine_dir}/config.json") as f:
            wider = dict(json.load(f), intermediate_size=192)
        with open(f"{engine_dir}/config.json", "w") as f:
            json.dump(wider, f)
    message, untouched = run_distributed(plan_errors_leave_the_engine_untouched, 1,
                                         args=(cfg, engine_dir, drop))[0]
    if drop:
        assert "decoder.layers.0.mlp.linear_fc2.weight" in message
    else:  # both shapes, and the tensor
        assert "model.layers.0.mlp.down_proj.weight" in message and "(64, 128)" in message and "(64, 192)" in message
    assert untouched


def syncs_while_the_sources_move() -> list[bool]:
    """One rank: two sources (the rows of one HF tensor) into a target, synced as they are, after one is given other
    memory (`param.data = ...`), and after the other's storage is freed and reallocated in place (as offloading
    does). Whether the target then holds what the sources hold, at each sync."""
    from rl_megatron.models.weight_layouts import along, whole
    from rl_megatron.resharding import Resharder
    from rl_megatron.resharding.plan import TensorSpec

    shape, f32 = (8, 4), torch.float32
    top, bottom = torch.arange(16.).view(4, 4), torch.arange(16., 32.).view(4, 4)
    sources = {key: (tensor, TensorSpec(key, (4, 4), f32, (along("w", shape, 0, start, start + 4, 0),)))
               for key, tensor, start in (("top", top, 0), ("bottom", bottom, 4))}
    target = torch.zeros(shape)
    resharder = Resharder(sources, [], {"w": (target, TensorSpec("w", shape, f32, (whole("w", shape),)))},
                          bucket_bytes=1 << 20)
    holds = []
    for move in (None, lambda: setattr(top, "data", top.data + 100),
                 lambda: (bottom.untyped_storage().resize_(0), bottom.untyped_storage().resize_(64),
                          bottom.fill_(-1))):
        if move is not None:
            move()
        resharder.sync()
        holds.append(torch.equal(target, torch.cat([top, bottom])))
    resharder.close()
    return holds


def test_a_sync_copies_what_the_sources_hold_after_they_moved():
    """The copies' views are made once and kept while the tensors stay where they are."""
    assert run_distributed(syncs_while_the_sources_move, 1)[0] == [True, True, True]
