"""The factor each micro-batch's loss is handed to Megatron's schedule with: whatever the micro-batch, DP and CP sizes,
the gradient every rank holds after DDP is the mini-batch loss's. Each step of the gradient's path is simulated in one
process on a linear model: the schedule's CP / micro-batches, the CP all-gather (whose backward sums the CP ranks'
gradients) and DDP's mean over the DP x CP ranks."""
import pytest
import torch

from rl_megatron.algorithms import megatron_loss_factor

HIDDEN, ROWS, TOKENS = 3, 2, 8  # TOKENS: a multiple of every CP size below


def mini_batch(micro_batches: int, data_parallel: int):
    generator = torch.Generator().manual_seed(0)
    inputs = torch.randn(data_parallel, micro_batches, ROWS, TOKENS, HIDDEN, generator=generator, dtype=torch.float64)
    targets = torch.randn(data_parallel, micro_batches, ROWS, TOKENS, generator=generator, dtype=torch.float64)
    weight = torch.randn(HIDDEN, generator=generator, dtype=torch.float64)
    return inputs, targets, weight


def micro_batch_loss(outputs, targets, mini_batch_tokens: int):
    """A micro-batch's share of the mini-batch's token-mean loss (divided by the mini-batch's token count)."""
    return ((outputs - targets) ** 2).sum() / mini_batch_tokens


def gradient_after_ddp(micro_batches: int, data_parallel: int, context_parallel: int) -> torch.Tensor:
    inputs, targets, weight = mini_batch(micro_batches, data_parallel)
    ranks = [[weight.clone().requires_grad_() for _ in range(context_parallel)] for _ in range(data_parallel)]
    for dp_rank, cp_ranks in enumerate(ranks):
        for micro in range(micro_batches):
            # Each CP rank computes its share of the tokens; each gathers all shares. In one process every rank's
            # gathered row is the same tensor, so the backward of each rank's loss reaches every rank's share: the sum
            # the all-gather's backward makes.
            shares = inputs[dp_rank, micro].chunk(context_parallel, dim=1)
            gathered = torch.cat([share @ params for share, params in zip(shares, cp_ranks)], dim=1)
            for _ in cp_ranks:  # every CP rank's loss covers the whole row
                loss = micro_batch_loss(gathered, targets[dp_rank, micro], targets.numel())
                handed = loss * megatron_loss_factor(micro_batches, data_parallel, context_parallel)
                scheduled = handed * context_parallel / micro_batches  # Megatron 0.16.1's forward_step_calc_loss
                scheduled.backward(retain_graph=True)
    return torch.stack([params.grad for cp_ranks in ranks for params in cp_ranks]).mean(0)  # DDP: over DP x CP


def mini_batch_gradient(micro_batches: int, data_parallel: int) -> torch.Tensor:
    inputs, targets, weight = mini_batch(micro_batches, data_parallel)
    weight.requires_grad_()
    micro_batch_loss(inputs @ weight, targets, targets.numel()).backward()
    return weight.grad


@pytest.mark.parametrize("micro_batches,data_parallel,context_parallel",
                         [(1, 1, 1), (4, 1, 1), (1, 2, 1), (3, 2, 1), (1, 1, 2), (3, 2, 2), (2, 1, 4)])
def test_the_gradient_after_ddp_is_that_of_the_mini_batch_loss(micro_batches, data_parallel, context_parallel):
    torch.testing.assert_close(gradient_after_ddp(micro_batches, data_parallel, context_parallel),
                               mini_batch_gradient(micro_batches, data_parallel))
