"""The resharding module end to end on gloo: Megatron shards at every layout of the grid -> real vLLM engines
(TP 1 and 2). The engines' weights equal the trainer's HF export bit for bit, and they generate what
`transformers` generates with those weights."""
import glob

import pytest
import torch
from safetensors.torch import load_file

from parity import config, family_model_dir, hf_greedy, hf_model
from rl_megatron.workers.spawn import run_distributed

PROMPTS = [[1, 5, 6, 7], [1, 9, 3], [1, 4, 4, 4, 8, 2 + 3]]
NEW_TOKENS = 5


def sync_into_engine(cfg, channel: str, bucket_bytes: int):
    import torch.distributed as dist

    from rl_megatron.config import read_hf_config
    from rl_megatron.resharding import Resharder, engine_mismatches, export_hf_state_dict, vllm_targets
    from rl_megatron.rollout.vllm_engine import VLLMEngine
    from rl_megatron.workers.megatron_actor import MegatronActor

    hf = read_hf_config(cfg.model.path)
    actor = MegatronActor(cfg, hf, optimizer_steps=10)
    engine_index = dist.get_rank() // cfg.rollout.tensor_parallel_size
    engine = VLLMEngine(cfg.model.path, cfg.rollout, "float32", seed=engine_index, eos_token_id=hf["eos_token_id"])
    try:
        # A first generation with the dummy weights: nothing the engine derives from its weights (packed copies,
        # cached KV) may outlive the sync.
        engine.generate(PROMPTS, n=1, temperature=0.0)
        resharder = Resharder(*actor.weight_sources(), vllm_targets(engine.model()), bucket_bytes=bucket_bytes,
                              channel=channel, verify=True)
        stats = resharder.sync()
        resharder.close()
        engine.weights_updated()
        state = [export_hf_state_dict(actor.chunks, actor.table)]
        dist.broadcast_object_list(state, src=0)
        greedy = [g.response_ids for g in engine.generate(PROMPTS, n=1, temperature=0.0)]
        return engine_mismatches(engine.model(), state[0]), greedy, state[0], stats
    finally:
        engine.close()




# (train TP, PP, VPP) -> engine TP, tied embeddings or not; auto reads peers' shards in place, the two channels
# send buckets.
# (The process_group channel's exactness: test_moe's engine tests and the reshard benchmark's test.)
GRID = [(1, 1, 1, 1, False, "auto"), (2, 1, 1, 2, True, "shared_memory"),
        (1, 2, 1, 1, True, "auto"), (2, 2, 1, 2, False, "shared_memory"), (1, 2, 2, 2, False, "auto")]


def saved_checkpoint(model_dir: str) -> dict[str, torch.Tensor]:
    """The tensors transformers' save_pretrained wrote: the HF names a trainer export must reproduce (per-expert
    tensors for MoE models, where the loaded model fuses them; no lm_head with tied embeddings)."""
    tensors = {}
    for path in glob.glob(f"{model_dir}/*.safetensors"):
        tensors.update(load_file(path))
    return tensors


@pytest.mark.parametrize("tp,pp,vpp,engine_tp,tied,channel", GRID)
def test_engines_hold_the_trainer_weights_exactly(tmp_path, tp, pp, vpp, engine_tp, tied, channel):
    model_dir = family_model_dir(tmp_path / "qwen2", "qwen2", tied, layers=2 * vpp)
    check_engines_hold_the_trainer_weights(model_dir, tp, pp, vpp, 1, engine_tp, channel)


def check_engines_hold_the_trainer_weights(model_dir: str, tp: int, pp: int, vpp: int, ep: int, engine_tp: int,
                                           channel: str) -> None:
    """Train layout TP x PP (x VPP) with `ep` data-parallel ranks that split the experts -> engines of `engine_tp`."""
    same_layout = tp == engine_tp and pp == 1 and ep == 1
    # vLLM pads the vocabulary to a multiple of 64; with Megatron padding the same way, every rank already
    # holds its engine shard and nothing should cross ranks.
    padding = {"model.make_vocab_size_divisible_by": 64 // tp} if same_layout else {}
    cfg = config(model_dir, tp, pp, vpp, **{"rollout.tensor_parallel_size": engine_tp,
                                            "rollout.max_tokens": NEW_TOKENS, "actor.expert_model_parallel_size": ep,
                                            "trainer.n_gpus_per_node": tp * pp * ep, **padding})
    # Small buckets: many of them, and pieces cut across bucket boundaries.
    results = run_distributed(sync_into_engine, tp * pp * ep, tp, pp, vpp, ep, args=(cfg, channel, 16 << 10))
    reference = hf_greedy(hf_model(model_dir), PROMPTS, NEW_TOKENS)
    saved = saved_checkpoint(model_dir)
    exported = results[0][2]
    assert set(exported) == set(saved) and all(torch.equal(exported[n], t) for n, t in saved.items())
    for rank, (mismatches, greedy, _, stats) in enumerate(results):
        assert mismatches == [], f"rank {rank}: {mismatches[:3]}"
        assert greedy == reference, f"rank {rank}"
        if same_layout:
            assert stats.bytes_received == 0 and stats.bytes_in_place > 0


def plan_errors_leave_the_engine_untouched(cfg, engine_model_dir: str, drop_from_table: str | None):
    from rl_megatron.config import read_hf_config
    from rl_megatron.resharding import PlanError, Resharder, vllm_targets
    from rl_megatron.rollout.vllm_engine import VLLMEngine
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=10)
    if drop_from_table:
        del actor.table.layer[drop_from_table]
    engine = VLLMEngine(engine_model_dir, cfg.rollout, "float32", seed=0, eos_token_id=2)
    try:
        before = {n: p.clone() for n, p in engine.model().named_parameters()}
        with pytest.raises(PlanError) as error:
            Resharder(*actor.weight_sources(), vllm_targets(engine.model()), bucket_bytes=1 << 20)
        untouched = all(torch.equal(before[n], p) for n, p in engine.model().named_parameters())
        return str(error.value), untouched
    finally:
        engine.close()


@pytest.mark.parametrize("case", ["table misses a parameter", "engine model of another shape"])
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
