"""Token log-probs and entropy from vocabulary-parallel logits, in chunks, without gathering the full logits and
without a float32 copy of them.

Each TP rank holds logits for a contiguous slice of the (padded) vocabulary. Per position, with x = logits / T (the
sampling temperature; Megatron's vocabulary padding masked out) and m = max x over the whole vocabulary:

    log p(label) = (x_label - m) - log S,    S = sum exp(x - m)
    entropy      = m + log S - sum exp(x - m) x / S

The maximum is one reduction over the logits as they are (the float32 cast and the division by T keep their
order). The sums are taken a chunk of positions at a time (`CHUNKS` per call), each chunk cast to float32 and
scaled on its own, so the float32 temporaries are a sixteenth of the logits; one all-reduce over the TP group
combines the ranks' partial sums. The backward pass recomputes each chunk's softmax from the saved logits (the
pattern of NeMo-RL's chunked distributed log-probs): the gradient of log p is Megatron's vocab-parallel cross
entropy's, computed the same way, so the figures are the same bits as `vocab_parallel_cross_entropy` on the whole
float32 logits.

More labels per position (a distillation teacher's k likeliest tokens, `top_k_log_probs`) ride in the same pass and
the same all-reduce: log p(label_j) for each, and in the backward pass sum_j (onehot_j - softmax) x d loss_j.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from megatron.core import parallel_state

CHUNKS = 16  # float32 temporaries: about three chunks, 3/16 of the logits' size


def _tp() -> tuple[int, int, object]:
    return (parallel_state.get_tensor_model_parallel_world_size(), parallel_state.get_tensor_model_parallel_rank(),
            parallel_state.get_tensor_model_parallel_group())


class _TokenStatistics(torch.autograd.Function):
    """(log p(labels), entropy or an empty tensor, log p(more_labels)) of logits [N, V/TP] (module docstring);
    `fused`: each chunk's work in one compiled kernel (`_chunk_work`)."""

    @staticmethod
    def forward(ctx, logits, labels, temperature, vocab_size, with_entropy, more_labels, fused):
        world, rank, group = _tp()
        rows, shard = logits.shape
        start = rank * shard
        valid = max(0, min(shard, vocab_size - start))  # this rank's real vocabulary (the rest is padding)
        if valid:
            top = logits[:, :valid].max(dim=-1).values.float()
            if temperature != 1.0:
                top = top / temperature
        else:
            top = logits.new_full((rows,), torch.finfo(torch.float32).min, dtype=torch.float32)
        if world > 1:
            dist.all_reduce(top, op=dist.ReduceOp.MAX, group=group)
        local, inside = _local(labels, start, shard)
        more_local, more_inside = _local(more_labels, start, shard)
        first_more = 3 if with_entropy else 2  # sums: total, label, [entropy's], then the more labels' (k rows)
        sums = torch.empty(first_more + more_labels.shape[1], rows, dtype=torch.float32, device=logits.device)
        chunk_sums = _chunk_work(_chunk_sums, fused)
        for part in _chunks(rows):
            sums[:, part] = chunk_sums(logits[part], top[part], local[part], inside[part], more_local[part],
                                       more_inside[part], temperature, valid, with_entropy)
        if world > 1:
            dist.all_reduce(sums, group=group)
        log_total = torch.log(sums[0])
        log_probs = -(log_total - sums[1])
        more_log_probs = (sums[first_more:] - log_total).T
        expected = sums[2] / sums[0] if with_entropy else None
        entropy = top + log_total - expected if with_entropy else logits.new_empty(0, dtype=torch.float32)
        ctx.save_for_backward(logits, local, inside, top, sums[0], expected if with_entropy else top, more_local,
                              more_inside)
        ctx.temperature, ctx.valid, ctx.with_entropy, ctx.fused = temperature, valid, with_entropy, fused
        # An output no loss reads (the entropy an update computes for its metric) gets None, not a zero gradient to
        # back-propagate.
        ctx.set_materialize_grads(False)
        return log_probs, entropy, more_log_probs

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy, grad_more):
        logits, local, inside, top, total, expected, more_local, more_inside = ctx.saved_tensors
        grad_entropy = grad_entropy if ctx.with_entropy else None
        grad_more = grad_more if more_local.shape[1] else None
        grad_logits = torch.zeros_like(logits)
        chunk_grad = _chunk_work(_chunk_grad, ctx.fused)
        for part in _chunks(logits.shape[0]):
            grad_logits[part] = chunk_grad(
                logits[part], top[part], total[part], expected[part], local[part], inside[part], more_local[part],
                more_inside[part], *(None if g is None else g[part] for g in (grad_log_probs, grad_entropy, grad_more)),
                ctx.temperature, ctx.valid)
        return grad_logits, None, None, None, None, None, None


def _chunk_sums(logits, top, local, inside, more_local, more_inside, temperature: float, valid: int,
                with_entropy: bool) -> torch.Tensor:
    """A chunk's partial sums over this rank's vocabulary slice, [2 (3 with_entropy) + k, rows]: sum exp(x - m),
    x_label - m, [sum exp(x - m) x,] and x_label_j - m for the k more labels (0 where a label is another rank's)."""
    x = _scaled(logits, temperature, valid)
    shifted = x - top.unsqueeze(-1)
    picked = torch.where(inside, shifted.gather(-1, local.unsqueeze(-1)).squeeze(-1), 0.0)
    more = torch.where(more_inside, shifted.gather(-1, more_local), 0.0).T
    exp = shifted.exp_()
    parts = [exp.sum(dim=-1), picked, *([(exp * x).sum(dim=-1)] if with_entropy else [])]
    return torch.cat([torch.stack(parts), more])


def _chunk_grad(logits, top, total, expected, local, inside, more_local, more_inside, grad_log_probs, grad_entropy,
                grad_more, temperature: float, valid: int) -> torch.Tensor:
    """A chunk's gradient in the logits (their dtype) from those of log p(label), the entropy and log p(more labels),
    each None where no loss reads it."""
    x = _scaled(logits, temperature, valid)
    softmax = torch.exp(x - top.unsqueeze(-1)).div_(total.unsqueeze(-1))
    grad = torch.zeros_like(softmax)
    if grad_log_probs is not None:  # as Megatron's cross entropy: (softmax - onehot) x d loss, loss = -log p
        ce = softmax.clone()
        rows = torch.arange(ce.shape[0], device=ce.device)
        ce[rows, local] -= inside.float()
        grad = grad + ce.mul_(-grad_log_probs.unsqueeze(-1))
    if grad_entropy is not None:  # d entropy / d x = -p (x - E[x])
        grad = grad - grad_entropy.unsqueeze(-1) * softmax * (x - expected.unsqueeze(-1))
    if grad_more is not None:  # sum over labels j of (onehot_j - softmax) x d loss_j
        more = softmax * -grad_more.sum(dim=-1, keepdim=True)
        grad = grad + more.scatter_add_(-1, more_local, grad_more * more_inside)
    if temperature != 1.0:
        grad = grad / temperature
    if valid < grad.shape[-1]:
        grad[:, valid:] = 0.0
    return grad.to(logits.dtype)


_COMPILED: dict = {}


def _chunk_work(function, fused: bool):
    """`function` as is, or fused: compiled once per process for any chunk shape (torch.compile, dynamic shapes), so
    that a chunk's casts, shifts, exponentials and sums are one or two kernels reading the logits once instead of a
    pass each (verl compiles its entropy from logits the same way)."""
    if not fused:
        return function
    if function not in _COMPILED:
        compiled = torch.compile(function, dynamic=True)

        def run(*args):  # traced and run under no torch function mode (the CPU build's device mode, the bench's
            with torch._C.DisableTorchFunction():  # host-sync counter): nothing in it is theirs to see
                return compiled(*args)
        _COMPILED[function] = run
    return _COMPILED[function]


def _local(labels: torch.Tensor, start: int, shard: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Vocabulary ids as indices into this rank's slice (0 where outside it), and where they are inside."""
    local = labels - start
    inside = (local >= 0) & (local < shard)
    return torch.where(inside, local, 0), inside


def _chunks(rows: int) -> list[slice]:
    step = max(1, -(-rows // CHUNKS))
    return [slice(start, min(start + step, rows)) for start in range(0, rows, step)]


def _scaled(logits: torch.Tensor, temperature: float, valid: int) -> torch.Tensor:
    """A chunk of logits as float32 / T, the vocabulary padding at float32's minimum (its exp is 0, and 0 x min is
    0 in the entropy's sum), as a tensor of its own."""
    x = logits.float()
    if temperature != 1.0:
        x = x / temperature
    if valid < x.shape[-1]:
        x = x.clone() if x is logits else x  # float32 logits at T = 1: still the model's tensor
        x[:, valid:] = torch.finfo(torch.float32).min
    return x


def token_log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor, temperature: float, vocab_size: int,
                                with_entropy: bool, more_labels: torch.Tensor | None = None, fused: bool = False
                                ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """log p(labels), (with_entropy) the entropy and (with `more_labels` [..., k]: k vocabulary ids per position, e.g.
    a teacher's top-k) log p of each of `more_labels`, at each position under softmax(logits / temperature), float32,
    differentiable; logits [..., V/TP] (this TP rank's vocabulary slice, Megatron's padding beyond `vocab_size`),
    labels [...]; `fused`: each chunk's work compiled (actor.fused_log_probs)."""
    shape, rows = labels.shape, labels.numel()
    more = labels.new_zeros(rows, 0) if more_labels is None else more_labels.reshape(rows, -1).long()
    log_probs, entropy, more_log_probs = _TokenStatistics.apply(logits.reshape(-1, logits.shape[-1]),
                                                                labels.reshape(-1), float(temperature), vocab_size,
                                                                with_entropy, more, fused)
    return (log_probs.view(shape), entropy.view(shape) if with_entropy else None,
            None if more_labels is None else more_log_probs.view(more_labels.shape))


@torch.no_grad()
def top_k_log_probs(logits: torch.Tensor, k: int, temperature: float, vocab_size: int, fused: bool = False
                    ) -> tuple[torch.Tensor, torch.Tensor]:
    """The k likeliest tokens at each position under softmax(logits / temperature): (log-probs [..., k] float32,
    vocabulary ids [..., k] int32), best first; logits [..., V/TP] as `token_log_probs_and_entropy` takes them. Each
    TP rank's k best of its slice are gathered (one all-gather of ids), their log-probs computed as any label's, and
    the k best of the candidates kept, as a distillation teacher's top-k logits are taken (NeMo-RL)."""
    world, rank, group = _tp()
    k = min(k, vocab_size)  # a vocabulary of fewer tokens: all of them
    flat = logits.reshape(-1, logits.shape[-1])
    start = rank * flat.shape[-1]
    valid = max(0, min(flat.shape[-1], vocab_size - start))
    ranked = min(k, valid)  # the scaling by 1 / T keeps the order: the raw logits rank the same
    candidates = flat[:, :valid].topk(ranked, dim=-1).indices + start
    if world > 1:  # every rank proposes k (a rank with fewer real ids repeats its best; duplicates rank last)
        candidates = F.pad(candidates, (0, k - ranked), value=start) if ranked < k else candidates
        gathered = [torch.empty_like(candidates) for _ in range(world)]
        dist.all_gather(gathered, candidates.contiguous(), group=group)
        candidates = torch.cat(gathered, dim=-1)
    _, _, log_probs = token_log_probs_and_entropy(flat, candidates[:, 0], temperature, vocab_size, False, candidates,
                                                  fused)
    if world > 1:  # a repeated id stands for one token: keep its first place only
        repeated = (candidates.unsqueeze(-1) == candidates.unsqueeze(-2)).tril(diagonal=-1).any(dim=-1)
        log_probs = log_probs.masked_fill(repeated, float("-inf"))
    best, order = log_probs.topk(min(k, log_probs.shape[-1]), dim=-1)
    shape = (*logits.shape[:-1], best.shape[-1])
    return best.view(shape), candidates.gather(-1, order).to(torch.int32).view(shape)


class OutputPositions:
    """A model's output layer computing only the positions a pass reads (the response tokens), not the whole row:
    with `index` set (positions flattened sequence-first, on the device), a forward pre-hook hands the layer those
    hidden states only, and the model returns logits [1, n, V/TP] for them (slime computes response logits only, for
    the same reason: the prompt's logits are the largest tensor of a pass and nothing reads them). Layers that
    gather their input over the sequence (sequence parallelism) keep every position."""

    def __init__(self, output_layer: torch.nn.Module):
        self.index: torch.Tensor | None = None
        output_layer.register_forward_pre_hook(self._select)

    def _select(self, layer, args):
        if self.index is None:
            return None
        hidden, *rest = args  # [tokens, rows, hidden]
        return (hidden.flatten(0, 1).index_select(0, self.index).unsqueeze(1), *rest)
