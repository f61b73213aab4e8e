"""Chunked log-probs and entropy (rl_megatron/models/logprobs.py) against Megatron's vocab-parallel cross entropy on
the whole float32 logits and the entropy's formula, with autograd through both: the same bits at TP=1 (forward, and
the gradient of the log-probs), and at TP=2 (each rank a vocabulary slice, Megatron's padding masked) the same
figures within float32 rounding."""
import pytest
import torch

from helpers.worlds import run_distributed

ROWS, VOCAB, PADDED = 37, 1000, 1024  # 24 padding entries at the end of the vocabulary
TEMPERATURE = 0.7


def reference(logits, labels, with_entropy):
    """The whole-logits computation the chunked one replaces: float32 / T, padding masked, Megatron's cross entropy,
    the entropy from the same reductions, all through autograd."""
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel

    x = logits.float() / TEMPERATURE
    shard, rank = x.shape[-1], parallel_state.get_tensor_model_parallel_rank()
    padding = torch.arange(rank * shard, (rank + 1) * shard) >= VOCAB
    x = x.masked_fill(padding, torch.finfo(torch.float32).min)
    entropy = None
    if with_entropy:
        top = x.detach().max(dim=-1).values
        dist.all_reduce(top, op=dist.ReduceOp.MAX, group=parallel_state.get_tensor_model_parallel_group())
        exp = torch.exp(x - top.unsqueeze(-1))
        total = tensor_parallel.reduce_from_tensor_model_parallel_region(exp.sum(dim=-1))
        expected = tensor_parallel.reduce_from_tensor_model_parallel_region((exp * x).sum(dim=-1)) / total
        entropy = top + torch.log(total) - expected
    log_probs = -tensor_parallel.vocab_parallel_cross_entropy(x.clone(), labels)
    return log_probs, entropy


def both_ways(with_entropy):
    from megatron.core import parallel_state

    from rl_megatron.models.logprobs import token_log_probs_and_entropy

    g = torch.Generator().manual_seed(0)
    full = torch.randn(ROWS, PADDED, generator=g) * 4
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    weights = torch.randn(2, ROWS, generator=g)
    tp, rank = parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank()
    shard = PADDED // tp
    results = []
    for compute in (reference, lambda logits, labels, e: token_log_probs_and_entropy(logits, labels, TEMPERATURE,
                                                                                     VOCAB, e)[:2]):
        logits = full[:, rank * shard:(rank + 1) * shard].clone().requires_grad_()
        log_probs, entropy = compute(logits, labels, with_entropy)
        loss = (weights[0] * log_probs).sum() + ((weights[1] * entropy).sum() if with_entropy else 0)
        loss.backward()
        results.append((log_probs.detach(), None if entropy is None else entropy.detach(), logits.grad))
    return results


def with_and_without_entropy():
    return both_ways(False), both_ways(True)


def test_tp1_gives_the_same_bits_as_megatrons_cross_entropy():
    without, with_entropy = run_distributed(with_and_without_entropy, 1)[0]
    (ref_lp, _, ref_grad), (lp, _, grad) = without
    assert torch.equal(lp, ref_lp) and torch.equal(grad, ref_grad)
    (ref_lp, ref_ent, ref_grad), (lp, ent, grad) = with_entropy
    assert torch.equal(lp, ref_lp) and torch.equal(ent, ref_ent)
    # the entropy's gradient: its closed form against autograd's, float32 rounding apart
    assert (grad - ref_grad).abs().max() <= 1e-5 * ref_grad.abs().max()


def test_tp2_matches_the_whole_vocabulary():
    for rank in run_distributed(both_ways, 2, 2, 1, args=(True,)):
        (ref_lp, ref_ent, ref_grad), (lp, ent, grad) = rank
        assert (lp - ref_lp).abs().max() <= 1e-5 and (ent - ref_ent).abs().max() <= 1e-5
        assert (grad - ref_grad).abs().max() <= 1e-5 * ref_grad.abs().max()


TOP_K = 8


def more_labels_and_top_k():
    """A teacher's top-k and a policy's log-probs of k given ids per position (with their gradient), from the chunked
    function, and the same from log_softmax over the whole float32 vocabulary through autograd."""
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from rl_megatron.models.logprobs import token_log_probs_and_entropy, top_k_log_probs

    g = torch.Generator().manual_seed(1)
    full = torch.randn(ROWS, PADDED, generator=g) * 4
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    more = torch.randint(0, VOCAB, (ROWS, 5), generator=g)
    weights = torch.randn(2, ROWS, 5, generator=g)
    shard = PADDED // parallel_state.get_tensor_model_parallel_world_size()
    mine = slice(parallel_state.get_tensor_model_parallel_rank() * shard, None)
    logits = full[:, mine][:, :shard].clone().requires_grad_()
    log_probs, _, more_log_probs = token_log_probs_and_entropy(logits, labels, TEMPERATURE, VOCAB, False, more)
    ((weights[0, :, 0] * log_probs).sum() + (weights[1] * more_log_probs).sum()).backward()
    whole = full[:, :VOCAB].clone().requires_grad_()
    reference = F.log_softmax(whole / TEMPERATURE, dim=-1)
    ((weights[0, :, 0] * reference.gather(-1, labels[:, None])[:, 0]).sum()
     + (weights[1] * reference.gather(-1, more)).sum()).backward()
    top, ids = top_k_log_probs(logits.detach(), TOP_K, TEMPERATURE, VOCAB)
    reference_top, reference_ids = reference.detach().topk(TOP_K, dim=-1)
    return ((more_log_probs.detach(), reference.detach().gather(-1, more)),
            (logits.grad, F.pad(whole.grad, (0, PADDED - VOCAB))[:, mine][:, :shard]),
            (top, reference_top), (ids, reference_ids))


@pytest.mark.parametrize("tp", [1, 2])
def test_more_labels_and_a_teachers_top_k_match_the_whole_vocabulary(tp):
    """The log-probs of k ids per position and their gradient (a policy distilled from a teacher's top-k), and the
    teacher's top-k itself (the same ids, best first, each rank proposing its slice's best), at TP=1 and TP=2."""
    for (more, more_ref), (grad, grad_ref), (top, top_ref), (ids, ids_ref) in run_distributed(
            more_labels_and_top_k, tp, tp, 1):
        assert (more - more_ref).abs().max() <= 1e-5
        assert (grad - grad_ref).abs().max() <= 1e-5 * grad_ref.abs().max()
        assert (top - top_ref).abs().max() <= 1e-5 and torch.equal(ids.long(), ids_ref) and ids.dtype == torch.int32


def fused_and_unfused():
    """Every output and the gradient through all three, each chunk's work compiled (fused) and as is."""
    from megatron.core import parallel_state

    from rl_megatron.models.logprobs import token_log_probs_and_entropy

    g = torch.Generator().manual_seed(2)
    full = torch.randn(ROWS, PADDED, generator=g) * 4
    labels = torch.randint(0, VOCAB, (ROWS,), generator=g)
    more = torch.randint(0, VOCAB, (ROWS, 3), generator=g)
    weights = torch.randn(5, ROWS, generator=g)
    shard = PADDED // parallel_state.get_tensor_model_parallel_world_size()
    start = parallel_state.get_tensor_model_parallel_rank() * shard
    results = []
    for fused in (False, True):
        logits = full[:, start:start + shard].clone().requires_grad_()
        log_probs, entropy, more_log_probs = token_log_probs_and_entropy(logits, labels, TEMPERATURE, VOCAB, True,
                                                                         more, fused)
        ((weights[0] * log_probs).sum() + (weights[1] * entropy).sum() + (weights[2:].T * more_log_probs).sum()
         ).backward()
        results.append((log_probs.detach(), entropy.detach(), more_log_probs.detach(), logits.grad))
    return results


def test_fused_log_probs_match_the_unfused_ones():
    """actor.fused_log_probs (on with CUDA): the same figures within float32 rounding, and the same gradient, at TP=2
    (each rank's slice compiled, the sums all-reduced as unfused)."""
    for unfused, fused in run_distributed(fused_and_unfused, 2, 2, 1):
        for got, want in zip(fused, unfused):
            assert (got - want).abs().max() <= 1e-5 * max(1.0, want.abs().max().item())
