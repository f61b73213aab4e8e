"""Shared by the parity tests (tests/distributed on gloo, tests/gpu on CUDA): the doctor's parity pieces
(rl_megatron/doctor/parity.py: tiny HF models of each family, a batch of right-padded sequences, the actor's config
for them, what transformers computes on the same weights), and the long-tailed batch of the micro-batching tests."""
import torch

from rl_megatron.batch import TrainBatch
from rl_megatron.doctor.parity import (BATCH, PROMPT, SEQ, family_model_dir, hf_model, hf_reference,
                                       hf_token_log_probs, make_batch)
from rl_megatron.doctor.parity import actor_config

__all__ = ["BATCH", "SEQ", "build_actor", "config", "family_model_dir", "hf_model", "hf_reference",
           "hf_token_log_probs", "hf_update_reference", "largest_update_difference", "long_tailed_batch",
           "make_batch"]


def config(model_dir: str, tp: int, pp: int, vpp: int = 1, **overrides):
    """The doctor's `actor_config`, with sequence parallelism at TP > 1 as GPU runs have it by default (CPU runs
    leave it off for dense models, `models.activations.sequence_parallel_on`): the parity tests hold the layout GPU
    users train, unless a test sets actor.sequence_parallel itself."""
    return actor_config(model_dir, tp, pp, vpp, **{"actor.sequence_parallel": "true", **overrides})


def largest_update_difference(state: dict, other: dict) -> float:
    """The largest elementwise difference between two runs' weights after the same Adam steps, key projections'
    biases aside: a key bias adds the same q·b to every score of a query, which softmax ignores, so its gradient is
    zero in exact arithmetic and rounding noise in practice, which Adam's first step, lr·g / (|g| + eps), scales up
    to any size below the lr (2.2e-5 at lr 1e-3 on an Intel Xeon, where every other weight stayed within 1.6e-6)."""
    return max((state[name] - tensor).abs().max().item() for name, tensor in other.items()
               if not name.endswith("k_proj.bias"))


def long_tailed_batch(count: int = 16) -> TrainBatch:
    """Responses of 1 to 40 tokens, most short (a log-normal tail, as chains of thought), in random order."""
    g = torch.Generator().manual_seed(5)
    lengths = (torch.randn(count, generator=g) * 0.9 + 1.8).exp().round().clamp(1, 40).long()
    width = PROMPT + int(lengths.max())
    input_ids = torch.randint(3, 18, (count, width), generator=g)
    mask = torch.zeros(count, width)
    for row, length in enumerate(lengths.tolist()):
        mask[row, PROMPT - 1:PROMPT - 1 + length] = 1.0
        input_ids[row, PROMPT + length:] = 0
    noise = lambda scale: scale * torch.randn(mask.shape, generator=g)  # noqa: E731
    return TrainBatch(input_ids, mask, pad_id=0, lengths=PROMPT + lengths, advantages=noise(1.0) * mask)


def build_actor(cfg):
    from rl_megatron.models.hf_config import read_hf_config
    from rl_megatron.workers.megatron_actor import MegatronActor

    return MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=10)


def hf_update_reference(model, batch, cfg) -> tuple[float, float]:
    """transformers' loss and gradient norm (over every parameter of `model`, an HF model, that trains) for the
    update of `batch` as one mini-batch: the project's policy loss applied to the model's log-probs."""
    from rl_megatron.algorithms import LossScale, policy_loss

    log_probs, _ = hf_token_log_probs(model, batch.input_ids, cfg.rollout.temperature)
    mask = batch.response_mask
    scale = LossScale(tokens=mask.sum().item(), sequences=float(mask.shape[0]), horizon=cfg.rollout.max_tokens)
    loss, _ = policy_loss(log_probs, batch.old_log_probs, batch.advantages, mask,
                          clip_ratio_low=cfg.actor.clip_ratio_low, clip_ratio_high=cfg.actor.clip_ratio_high,
                          clip_ratio_c=cfg.actor.clip_ratio_c, agg_mode=cfg.actor.loss_agg_mode, scale=scale)
    loss.backward()
    grad_norm = torch.linalg.vector_norm(torch.stack([p.grad.norm() for p in model.parameters()
                                                      if p.grad is not None]))
    return loss.item(), grad_norm.item()
