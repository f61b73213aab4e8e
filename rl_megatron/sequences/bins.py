"""Which samples go together: micro-batches of a rank's samples (a fixed count each, or a token budget), and the
order that gives every data-parallel rank the same share of tokens. Pure functions over sample lengths.

A bin is a list of sample indices (ascending); a plan is a list of bins covering every sample exactly once.
"""
from __future__ import annotations


def fixed_bins(count: int, size: int) -> list[list[int]]:
    """Consecutive runs of `size` samples (the last may be shorter): micro-batches of a sample count."""
    return [list(range(start, min(start + size, count))) for start in range(0, count, size)]


def token_budget_bins(lengths: list[int], budget: int) -> list[list[int]]:
    """First-fit decreasing: the longest sample first, each into the first bin its tokens fit in, so that every bin
    holds at most `budget` tokens. A sample longer than the budget gets a bin of its own (samples are never cut)."""
    bins: list[list[int]] = []
    loads: list[int] = []
    for index in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        target = next((b for b, load in enumerate(loads) if load + lengths[index] <= budget), None)
        if target is None:
            bins.append([])
            loads.append(0)
            target = len(bins) - 1
        bins[target].append(index)
        loads[target] += lengths[index]
    return sorted(sorted(b) for b in bins)


def split_to_count(bins: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """`bins` split until there are `count` of them (no bin grows, so a budget still holds): the bin with the most
    tokens among those of two samples or more is halved into two of near-equal tokens. Every rank of a model must
    run the same number of micro-batches (pipeline stages, expert-parallel collectives), so a rank with fewer bins
    splits some of them."""
    if count > len(lengths):
        raise ValueError(f"{len(lengths)} samples cannot fill {count} micro-batches")
    bins = [list(b) for b in bins]
    while len(bins) < count:
        largest = max((b for b in bins if len(b) > 1), key=lambda b: sum(lengths[i] for i in b))
        bins.remove(largest)
        halves: tuple[list[int], list[int]] = ([], [])
        for index in sorted(largest, key=lambda i: (-lengths[i], i)):
            lighter = min(halves, key=lambda h: sum(lengths[i] for i in h))
            lighter.append(index)
        bins += [sorted(h) for h in halves]
    return sorted(bins)


def round_up(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


def balanced_order(lengths: list[int], parts: int, group_size: int) -> list[int]:
    """A permutation of the samples after which `parts` equal contiguous slices (the data-parallel ranks') carry
    near-equal tokens, without changing which samples share an optimizer step.

    The batch is cut into mini-batches of `group_size` samples per rank: rank r's k-th mini-batch is its slice's
    k-th run of `group_size` samples, and optimizer step k takes the k-th mini-batch of every rank. Within each
    step's samples, the longest sample goes to the rank with the fewest tokens that still has room (greedy LPT with
    equal counts), so every rank's share of every step is balanced and the steps see the same samples as before."""
    count = len(lengths)
    if count % parts or (count // parts) % group_size:
        raise ValueError(f"{count} samples do not split into {parts} ranks x mini-batches of {group_size}")
    per_rank = count // parts
    slots: list[list[int]] = [[] for _ in range(parts)]
    for start in range(0, per_rank, group_size):
        step = [rank * per_rank + start + j for rank in range(parts) for j in range(group_size)]
        ranks: list[list[int]] = [[] for _ in range(parts)]
        loads = [0] * parts
        for index in sorted(step, key=lambda i: (-lengths[i], i)):
            rank = min((r for r in range(parts) if len(ranks[r]) < group_size), key=lambda r: (loads[r], r))
            ranks[rank].append(index)
            loads[rank] += lengths[index]
        for rank in range(parts):
            slots[rank] += sorted(ranks[rank])
    return [index for rank_slots in slots for index in rank_slots]
