"""What the distributed tests run on each rank (through rl_megatron.workers.spawn.run_distributed: functions of an
importable module, so that the spawned ranks can unpickle them) and the checks several of them make: the actor's
log-probs, update and HF export; the trainer's weights resharded into real vLLM engines."""
import dataclasses

import torch

from helpers.parity import build_actor, config, hf_model
from helpers.routing import owned_outputs, router_choices
from rl_megatron.doctor.cycle import hf_greedy
from rl_megatron.doctor.parity import saved_checkpoint
from rl_megatron.models.family import table_for
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.roles import Role
from helpers.worlds import run_distributed

PROMPTS = [[1, 5, 6, 7], [1, 9, 3], [1, 4, 4, 4, 8, 2 + 3]]
NEW_TOKENS = 5


def sync_into_engine(cfg, channel: str, bucket_bytes: int):
    import torch.distributed as dist

    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.resharding import Resharder, engine_mismatches, export_hf_state_dict
    from rl_megatron.rollout.vllm_engine import VLLMEngine
    from rl_megatron.workers.megatron_actor import MegatronActor

    hf = read_hf_config(cfg.model.path)
    actor = MegatronActor(cfg, hf, optimizer_steps=10)
    engine_index = dist.get_rank() // cfg.rollout.tensor_parallel_size
    engine = VLLMEngine(cfg.model.path, cfg.rollout, "float32", seed=engine_index)
    try:
        # A first generation with the dummy weights: nothing the engine derives from its weights (packed copies,
        # cached KV) may outlive the sync.
        engine.generate(PROMPTS, n=1, temperature=0.0)
        resharder = Resharder(*actor.weight_sources(), engine.sync_targets(), bucket_bytes=bucket_bytes,
                              channel=channel, verify=True)
        stats = resharder.sync()
        resharder.close()
        engine.weights_updated()
        state = [export_hf_state_dict(actor.chunks, actor.table)]
        dist.broadcast_object_list(state, src=0)
        greedy = [g.response_ids for g in engine.generate(PROMPTS, n=1, temperature=0.0)]
        return engine_mismatches(engine.sync_targets(), state[0]), greedy, state[0], stats
    finally:
        engine.close()


def vllm_greedy(model_dir: str, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """vLLM's greedy answers on a model folder as any vLLM user loads it (its own safetensors)."""
    from rl_megatron.config.schema import RolloutConfig
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, RolloutConfig(max_tokens=new_tokens, max_model_len=32), "float32", seed=0,
                        load_format="auto")
    try:
        return [g.response_ids for g in engine.generate(prompts, n=1, temperature=0.0)]
    finally:
        engine.close()



def log_probs_and_export(cfg, batch):
    actor = build_actor(cfg)
    return actor.log_probs(batch), actor.hf_state_dict()


def update_and_export(cfg, batch):
    """One update in which each data-parallel rank takes its slice of `batch`."""
    from megatron.core import parallel_state

    actor = build_actor(cfg)
    batch = dataclasses.replace(batch, old_log_probs=actor_log_probs_everywhere(actor, batch))
    dp, rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    metrics = actor.update(batch.split(dp)[rank])
    return metrics, actor.hf_state_dict()


def actor_log_probs_everywhere(actor, batch):
    """Old log-probs for the update: computed on the owning ranks, shared so every rank has them."""
    import torch.distributed as dist

    out = actor.log_probs(batch)
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, out.log_probs if out is not None else None)
    return next(x for x in gathered if x is not None)


def check_engines_hold_the_trainer_weights(model_dir: str, tp: int, pp: int, vpp: int, ep: int, engine_tp: int,
                                           channel: str, etp: int | None = None) -> None:
    """Train layout TP x PP (x VPP) with `ep` data-parallel ranks that split the experts (over `etp` expert-TP ranks,
    default TP) -> engines of `engine_tp`."""
    same_layout = tp == engine_tp and pp == 1 and ep == 1
    # vLLM pads the vocabulary to a multiple of 64; with Megatron padding the same way, every rank already
    # holds its engine shard and nothing should cross ranks.
    padding = {"model.make_vocab_size_divisible_by": 64 // tp} if same_layout else {}
    cfg = config(model_dir, tp, pp, vpp, **{"rollout.tensor_parallel_size": engine_tp,
                                            "rollout.max_tokens": NEW_TOKENS, "actor.expert_model_parallel_size": ep,
                                            "trainer.n_gpus_per_node": tp * pp * ep, **padding,
                                            **({"actor.expert_tensor_parallel_size": etp} if etp else {})})
    # Small buckets: many of them, and pieces cut across bucket boundaries.
    results = run_distributed(sync_into_engine, tp * pp * ep, tp, pp, vpp, ep, args=(cfg, channel, 16 << 10), etp=etp)
    reference = hf_greedy(hf_model(model_dir), PROMPTS, NEW_TOKENS)
    saved = saved_checkpoint(model_dir)
    hf = read_hf_config(model_dir)
    exported = table_for(hf, hf["vocab_size"]).stored_tensors(results[0][2])  # as the family's folders store it
    assert set(exported) == set(saved) and all(torch.equal(exported[n], t) for n, t in saved.items())
    for rank, (mismatches, greedy, _, stats) in enumerate(results):
        assert mismatches == [], f"rank {rank}: {mismatches[:3]}"
        assert greedy == reference, f"rank {rank}"
        if same_layout:
            assert stats.bytes_received == 0 and stats.bytes_in_place > 0





def routing_replay_passes(cfg, batch, forced):
    """On one rank, with actor.router_replay=R2: the old log-prob pass's recorded routing and the routers' own
    choices in it; log-probs of a forward pass replaying `forced` routing, and the routers' choices in it; and the
    update replaying the recorded routing, with the routers' choices in its forward (metrics, exported weights)."""
    from functools import partial

    from rl_megatron.models.router_replay import Pass

    actor = build_actor(cfg)
    chosen = router_choices(actor.chunks)
    old = owned_outputs(actor.log_probs(batch))
    recorded_choices, chosen[:] = list(chosen), []
    with actor.routing_replay.running(Pass.REPLAY):
        forced_pass = actor.infer(dataclasses.replace(batch.select(), routed_experts=forced),
                                  partial(actor._token_outputs, with_entropy=False))
    forced_log_probs = forced_pass.log_probs if forced_pass is not None else None
    forced_choices, chosen[:] = list(chosen), []
    replayed = dataclasses.replace(batch, old_log_probs=old.log_probs, routed_experts=old.routed_experts)
    metrics = actor.update(replayed)
    return (old, recorded_choices, forced_log_probs, forced_choices, chosen, metrics, actor.hf_state_dict(),
            actor.micro_batches(batch))


def engine_routing_replayed(cfg, prompts: list[list[int]], new_tokens: int):
    """On one rank: a vLLM engine on the model folder's own weights (those the actor loads) samples two answers per
    prompt with moe.engine_routing; the actor's old log-prob pass replays the samples' engine routing (R3). Returns
    the completions, the batch, the routers' choices in that pass, its micro-batches, the agreement metrics and the
    pass's log-probs; and the agreement metrics of the old log-prob pass of an actor without replay."""
    from rl_megatron.batch import Sample, TrainBatch
    from rl_megatron.config.schema import RolloutConfig
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    actor = build_actor(cfg)
    chosen = router_choices(actor.chunks)
    engine = VLLMEngine(cfg.model.path, RolloutConfig(max_tokens=new_tokens, max_model_len=32), "float32", seed=0,
                        load_format="auto", routing=True)
    try:
        completions = engine.generate(prompts, n=2, temperature=cfg.rollout.temperature,
                                      seeds=list(range(len(prompts))))
        samples = [Sample(prompts[i // 2], c.response_ids, c.log_probs, "digits", None,
                          routed_experts=c.routed_experts) for i, c in enumerate(completions)]
        batch = TrainBatch.from_samples(samples, pad_id=0)
        old = owned_outputs(actor.log_probs(batch))
        metrics = actor.routing_replay.agreement_metrics()
        micros = actor.micro_batches(batch)
        chosen = list(chosen)
        # Without replay (actor.router_replay=disabled), the old log-prob pass measures the agreement as well.
        plain = build_actor(dataclasses.replace(cfg, actor=dataclasses.replace(cfg.actor, router_replay="disabled")))
        plain.log_probs(batch)
        return completions, batch, chosen, micros, metrics, old.log_probs, plain.routing_replay.agreement_metrics()
    finally:
        engine.close()


def policy_and_teacher_log_probs(cfg, batch, teacher_ids=None):
    """The actor and, in the same processes as a colocated teacher runs, the teacher (teacher.model.path: a model of
    its own, loaded by its role): each one's log-probs of `batch` (the teacher's top-k too with
    algorithm.distillation.top_k); with `teacher_ids` ([B, S, k]), also the actor's log-probs of those ids, as its
    update computes them to distil from a teacher's top-k."""
    import dataclasses
    from functools import partial

    from rl_megatron.models.hf_config import role_model_config
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = build_actor(cfg)
    teacher = MegatronActor(cfg, role_model_config(cfg, Role.TEACHER, actor.hf_config), role=Role.TEACHER)
    assert not any(p.requires_grad for chunk in teacher.chunks for p in chunk.parameters())  # forward only
    results = actor.log_probs(batch), teacher.log_probs(batch)
    if teacher_ids is None:
        return results
    probed = dataclasses.replace(batch, teacher_top_ids=teacher_ids)
    return *results, actor.infer(probed, partial(actor._token_outputs, with_entropy=False))


def reward_model_scores(cfg, batch):
    """A reward model (reward_model.model.path, a sequence classifier of its own) built as a colocated one is, in the
    actor's layout: its head's output at every position of `batch`."""
    from rl_megatron.models.hf_config import role_model_config
    from rl_megatron.workers.megatron_critic import MegatronRewardModel

    model = MegatronRewardModel(cfg, role_model_config(cfg, Role.REWARD_MODEL, read_hf_config(cfg.model.path)))
    assert not any(p.requires_grad for chunk in model.chunks for p in chunk.parameters())  # forward only
    return model.scores(batch)


def policy_and_reference_log_probs(cfg, batch):
    """The actor and its reference as the workers build one beside it (`Role.REF`: a frozen copy of the initial
    policy): each one's log-probs of `batch`."""
    from rl_megatron.workers.megatron_actor import MegatronActor

    actor = build_actor(cfg)
    reference = MegatronActor(cfg, actor.hf_config, role=Role.REF, initial=actor)
    assert not any(p.requires_grad for chunk in reference.chunks for p in chunk.parameters())
    return actor.log_probs(batch), reference.log_probs(batch)
