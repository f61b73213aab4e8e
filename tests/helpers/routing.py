"""MoE routing replay's checks, shared by the gloo tests (tests/distributed/test_router_replay.py) and the CUDA one
(tests/gpu): forced routing, transformers forced through it, and R3's passes checked against that reference."""
import dataclasses

import pytest
import torch

from helpers.parity import build_actor, config, family_model_dir, hf_model, hf_update_reference, make_batch
from rl_megatron.batch import UNROUTED
from rl_megatron.doctor.parity import hf_token_log_probs
from rl_megatron.models.router_replay import model_layout

EXPERTS, TOP_K = 4, 2


def forced_routing(batch) -> torch.Tensor:
    """Top-2 experts per token and layer, drawn at random (distinct per token): rarely the routers' own choice."""
    g = torch.Generator().manual_seed(7)
    rows, tokens = batch.input_ids.shape
    return torch.rand(rows, tokens, 2, EXPERTS, generator=g).argsort(-1)[..., :TOP_K].to(torch.int16)


def hf_forced_log_probs(model_dir: str, batch, routing: torch.Tensor, temperature: float,
                        own: list | None = None) -> torch.Tensor:
    """transformers' log-probs through `forced_model`."""
    with torch.no_grad():
        return hf_token_log_probs(forced_model(model_dir, batch, routing, own), batch.input_ids, temperature)[0]


def forced_model(model_dir: str, batch, routing: torch.Tensor, own: list | None = None):
    """transformers' model with each MoE layer's router made to pick `routing`'s experts for `batch` (their weights:
    the router's own probabilities at those experts, renormalised as the model's config says); `own` gets each
    layer's own top-k choice on the hidden states it sees ([rows, tokens, k], sorted)."""
    model = hf_model(model_dir)
    for index, layer in enumerate(model.model.layers):
        gate = layer.mlp.gate
        picked = routing[:, :, index].reshape(-1, TOP_K).long()  # transformers flattens batch-first

        def forward(hidden, gate=gate, picked=picked):
            logits = torch.nn.functional.linear(hidden.reshape(-1, gate.hidden_dim), gate.weight)
            if own is not None:
                own.append(logits.topk(TOP_K).indices.sort(-1).values.view(*batch.input_ids.shape, TOP_K))
            values = torch.softmax(logits, dim=-1, dtype=torch.float).gather(1, picked)
            if gate.norm_topk_prob:
                values = values / values.sum(-1, keepdim=True)
            return logits, values.to(logits.dtype), picked

        gate.forward = forward
    return model


def top_k_sets(choices: torch.Tensor) -> torch.Tensor:
    """[tokens, experts] routing maps -> each token's experts, sorted: [tokens, k]."""
    return choices.nonzero()[:, 1].view(choices.shape[0], TOP_K).cpu()  # the routers record on their device


def router_choices(chunks) -> list:
    """Each call of the routers of `chunks` (forward passes only: recomputation would repeat them): its [tokens,
    experts] routing map, appended to the list returned."""
    chosen = []

    def hook(module, inputs, output):
        if torch.is_grad_enabled() or not module.training:
            chosen.append(output[1].clone())

    for chunk in chunks:
        for layer in chunk.decoder.layers:
            if hasattr(layer.mlp, "router"):  # not a dense layer of a mixed model
                layer.mlp.router.register_forward_hook(hook)
    return chosen


def data_parallel_parts(outputs) -> list:
    """Every rank's `outputs` of its data-parallel slice, on every rank, in data-parallel order (None where a rank
    does not own its slice's outputs)."""
    import torch.distributed as dist
    from megatron.core import parallel_state

    from rl_megatron.workers.distributed import owns_dp_output

    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, (parallel_state.get_data_parallel_rank(), outputs if owns_dp_output() else None))
    return [outputs for _, outputs in sorted(every, key=lambda pair: pair[0])]


def owned_outputs(outputs):
    """A DP pass's outputs, from the rank that owns them, on every rank."""
    import torch.distributed as dist

    owned = [None] * dist.get_world_size()
    dist.all_gather_object(owned, outputs)
    return next(x for x in owned if x is not None)


def r3_passes(cfg, batch, engine):
    """On one rank, with actor.router_replay=R3 and `engine` as the batch's engine routing: the old log-prob pass's
    outputs and the routers' choices in it; the routers' own choices on the same batch (recorded, unreplayed); the
    reference's log-probs (it replays too); the update's metrics and the routers' choices in its forward."""
    from functools import partial

    import torch.distributed as dist

    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.models.router_replay import Pass
    from rl_megatron.roles import Role
    from rl_megatron.workers.megatron_actor import MegatronActor

    from megatron.core import parallel_state

    from rl_megatron.batch import TokenOutputs

    actor = build_actor(cfg)
    chosen = router_choices(actor.chunks)
    # This data-parallel rank's rows, as the workers' dispatch hands them out.
    part = dataclasses.replace(batch, routed_experts=engine).split(parallel_state.get_data_parallel_world_size())[
        parallel_state.get_data_parallel_rank()]
    routed = part.select("routed_experts")

    def whole(outputs) -> TokenOutputs:  # each data-parallel slice's, from the rank that owns it, in order
        return TokenOutputs.cat([x for x in data_parallel_parts(outputs) if x is not None])

    old = whole(actor.log_probs(routed))
    replayed, chosen[:] = list(chosen), []
    with actor.routing_replay.running(Pass.RECORD):
        actor.infer(part.select(), partial(actor._token_outputs, with_entropy=False))
    own, chosen[:] = list(chosen), []
    reference = whole(MegatronActor(cfg, read_hf_config(cfg.model.path), role=Role.REF).log_probs(routed))
    own_rows = old.split(parallel_state.get_data_parallel_world_size())[parallel_state.get_data_parallel_rank()]
    metrics = actor.update(dataclasses.replace(routed, old_log_probs=own_rows.log_probs, advantages=part.advantages))
    every = [None] * dist.get_world_size()  # the loss statistics come from the last pipeline stage
    dist.all_gather_object(every, metrics)
    metrics = {key: value for rank_metrics in every for key, value in rank_metrics.items()}
    return old, replayed, own, reference, metrics, chosen, actor.micro_batches(batch)


def r2_record_and_update(cfg, batch):
    """With actor.router_replay=R2 at any layout: the old log-prob pass's record (from the rank that owns the
    outputs), and the metrics of the update replaying it (every rank's together: the loss statistics come from the
    last pipeline stage)."""
    import torch.distributed as dist

    actor = build_actor(cfg)
    old = owned_outputs(actor.log_probs(batch))
    metrics = actor.update(dataclasses.replace(batch, old_log_probs=old.log_probs, routed_experts=old.routed_experts))
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, metrics)
    return old.routed_experts, {key: value for rank_metrics in every for key, value in rank_metrics.items()}


def check_r3_passes(tmp_path, run, log_prob_tolerance: float, agreement_tolerance: float, exact: bool,
                    grad_tolerance: float = 1e-4, tp: int = 1, pp: int = 1, ep: int = 1, **settings):
    """R3 at TP x PP (x EP, the data-parallel ranks). The batch carries the engine's routing (here drawn at
    random), UNROUTED at each row's last token (the engine never fed it) and padding. The old log-prob pass goes
    through exactly those experts (its log-probs are transformers' forced through them), the reference computes the
    same, the update's forward too (its first mini-batch's log-probs equal the old ones: ppo_kl 0) and its gradient
    norm is transformers' through the same experts (`grad_tolerance`, relative), and moe/routing_agreement is the
    share of the engine's (token, layer, slot) choices that the routers' own choice holds. On one rank, the routers'
    choices in each pass are checked one by one too.
    `run`: run_distributed; `settings`: config keys on top (e.g. the model's dtype); `exact`: the reference and the
    update's forward equal the old pass bit for bit (CPU), else to `log_prob_tolerance`."""
    model_dir = family_model_dir(tmp_path / "moe", "qwen3_moe", tied=False, norm_topk_prob=True)
    batch = make_batch()
    engine = forced_routing(batch)
    for row, length in enumerate(batch.sequence_lengths()):
        engine[row, length - 1:] = UNROUTED
    world = tp * pp * ep
    cfg = config(model_dir, tp, pp, **{"actor.optim.lr": 1e-3, "trainer.n_gpus_per_node": world,
                                       "actor.expert_model_parallel_size": ep, "actor.router_replay": "R3",
                                       **settings})
    old, replayed, own, reference, metrics, update_choices, micros = \
        run(r3_passes, world, tp, pp, 1, ep, args=(cfg, batch, engine))[0]
    per_router = [(micro, layer) for micro in micros for layer in range(2)] if world == 1 else []
    first_held = []
    for replay, mine, update, (micro, layer) in zip(replayed, own, update_choices, per_router):
        experts, routed = model_layout(micro, engine[micro.rows], TOP_K)
        theirs = experts[:, layer].sort(-1).values[routed]
        assert torch.equal(top_k_sets(replay)[routed], theirs) and torch.equal(top_k_sets(update)[routed], theirs)
        if layer == 0:  # the first layer's input is the same replayed or not: its own choice, unreplayed
            first_held.append((theirs.unsqueeze(-1) == top_k_sets(mine)[routed].unsqueeze(-2)).any(-1))
    mask = batch.response_mask.bool()
    filled = torch.where(engine == UNROUTED, torch.arange(TOP_K, dtype=torch.int16), engine)
    hf_own = []  # each layer's own choice on the hidden states of the replayed pass
    forced_reference = hf_forced_log_probs(model_dir, batch, filled, cfg.rollout.temperature, own=hf_own)
    assert (old.log_probs[mask] - forced_reference[mask]).abs().max() <= log_prob_tolerance, (old.log_probs[mask] - forced_reference[mask]).abs().max()
    # The update's gradient is transformers' through the same experts (the router's weights learn as well).
    _, grad_norm = hf_update_reference(forced_model(model_dir, batch, filled),
                                       dataclasses.replace(batch, old_log_probs=old.log_probs), cfg)
    assert metrics["actor/grad_norm"] == pytest.approx(grad_norm, rel=grad_tolerance)
    if exact:  # the same computation, bit for bit (on CPU)
        assert torch.equal(reference.log_probs, old.log_probs)
        assert metrics["actor/ppo_kl"] == 0.0  # one mini-batch: the update's forward is the old pass's
    else:
        assert (reference.log_probs[mask] - old.log_probs[mask]).abs().max() <= log_prob_tolerance
        assert abs(metrics["actor/ppo_kl"]) <= log_prob_tolerance

    # The agreement: per layer, the engine's slots that the router's own choice holds, on the hidden states of the
    # replayed pass (the layers below routed as the engine did), at the positions the engine fed.
    routed = engine[..., 0, 0] != UNROUTED
    expected = []
    for layer in range(2):
        theirs = engine[:, :, layer].long().sort(-1).values[routed]
        expected.append((theirs.unsqueeze(-1) == hf_own[layer][routed].unsqueeze(-2)).any(-1).double().mean().item())
        assert metrics[f"moe/layer{layer}/routing_agreement"] == pytest.approx(expected[layer], abs=agreement_tolerance)
    assert metrics["moe/routing_agreement"] == pytest.approx(sum(expected) / 2, abs=agreement_tolerance)
    assert 0 < metrics["moe/routing_agreement"] < 1
    if world == 1:
        assert len(replayed) == len(own) == len(update_choices) == len(per_router)
        unreplayed = torch.cat(first_held).double().mean().item()
        assert metrics["moe/layer0/routing_agreement"] == pytest.approx(unreplayed, abs=agreement_tolerance)


