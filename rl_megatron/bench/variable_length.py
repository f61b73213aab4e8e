"""`python -m rl_megatron.bench variable_length --json`: long-tailed response lengths, three ways of batching them.

One old-log-prob pass and one update (one optimizer step over the whole batch) of the actor, one process, over a
batch whose lengths look like chains of thought:

- prompts: uniform in [32, 128] tokens;
- responses: log-normal, median --seq / 8, sigma 1 (so about 2% of a batch would pass --seq), clamped to
  [32, --seq], and the longest set to --seq (a response that ran into rollout.max_tokens, as every real batch
  has). Defaults: a 256-wide 2-layer Qwen2 (vocabulary 4096); on GPU --seq 2048 and 16 samples; on CPU --seq 256
  and 8 samples, in float32 (`VARIABLE_LENGTH_BATCH` in rl_megatron/bench/__main__.py).

Three ways, each in a process of its own (so that each one's peak memory is its own):

- `padded`: today's layout: every row right-padded to the batch's longest sample, micro-batches of a fixed count
  (as many of the longest sample as the token budget holds);
- `budget`: micro-batches binned by tokens within the budget (--max-tokens; default twice the longest possible
  sample), each right-padded to its own longest;
- `packed`: the token budget's micro-batches packed into one row each.

Each reports real tokens per second (the batch's tokens, not the padding, over both passes), `padding_ratio`
(padded / computed tokens) and peak memory (CUDA: max allocated; CPU: the process's peak resident set, VmHWM,
above what it held before the passes). `padded` and `packed` run again with the longest sample doubled: the
padded layout's memory follows the longest sample, the packed one's the budget. The figure is packed's tokens/s,
the ratio its speed-up over `padded`.
"""
from __future__ import annotations

import time

import torch

from rl_megatron import platform
from rl_megatron.batch import TrainBatch
from rl_megatron.bench.measure import synchronize
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.preflight import load_config
from rl_megatron.workers.megatron_actor import MegatronActor
from rl_megatron.workers.spawn import run_distributed

PROMPT_RANGE = (32, 128)
# (name, token budget or not, packing, rows padded to the whole batch's longest)
WAYS = {"padded": (False, False, True), "budget": (True, False, False), "packed": (True, True, False)}


def lengths(count: int, longest: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt lengths, response lengths) of the module docstring's distribution."""
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(PROMPT_RANGE[0], PROMPT_RANGE[1] + 1, (count,), generator=g)
    median = longest / 8
    responses = (torch.randn(count, generator=g) + torch.log(torch.tensor(median))).exp().round().long()
    responses = responses.clamp(32, longest)
    responses[responses.argmax()] = longest
    return prompts, responses


def long_tailed_batch(prompts: torch.Tensor, responses: torch.Tensor, vocab: int, pad_to_longest: bool) -> TrainBatch:
    g = torch.Generator().manual_seed(1)
    total = prompts + responses
    width = int(total.max())
    input_ids = torch.randint(3, vocab, (len(total), width), generator=g)
    mask = torch.zeros(len(total), width)
    for row, (p, r) in enumerate(zip(prompts.tolist(), responses.tolist())):
        mask[row, p - 1:p - 1 + r] = 1.0
        input_ids[row, p + r:] = 0
    # Without lengths every row counts as full: today's layout, padded to the batch's longest.
    return TrainBatch(input_ids, mask, pad_id=0, lengths=None if pad_to_longest else total,
                      advantages=torch.randn(len(total), generator=g).unsqueeze(1) * mask)


def _peak_memory_since(start: int) -> float:
    """GiB above `start` at the peak (see `_memory_now`)."""
    if platform.has_cuda():
        return (torch.cuda.max_memory_allocated() - start) / 2 ** 30
    with open("/proc/self/status") as status:
        peak_kib = next(int(line.split()[1]) for line in status if line.startswith("VmHWM:"))
    return (peak_kib * 1024 - start) / 2 ** 30


def _memory_now() -> int:
    """Bytes in use now, and the peak reset to it: CUDA's allocated memory, or the process's resident set (Linux
    resets VmHWM when 5 is written to clear_refs)."""
    if platform.has_cuda():
        torch.cuda.reset_peak_memory_stats()
        return torch.cuda.memory_allocated()
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:")) * 1024


def one_way(cfg, batch: TrainBatch, real_tokens: int, repeats: int) -> dict:
    """Old log-probs + one update, once for memory (cold) then `repeats` times for speed."""
    actor = MegatronActor(cfg, read_hf_config(cfg.model.path), optimizer_steps=100)

    def step() -> float:
        """The tokens the two passes computed (the actor counts the tokens of the rows it is given as real)."""
        batch.old_log_probs = actor.log_probs(batch).log_probs
        padding = actor.update(batch)["perf/padding_ratio"]
        return 2 * sum(batch.sequence_lengths()) / (1 - padding)

    start = _memory_now()
    computed = step()
    synchronize()
    peak_gib = _peak_memory_since(start)
    began = time.perf_counter()
    for _ in range(repeats):
        step()
    synchronize()
    seconds = (time.perf_counter() - began) / repeats
    return {"tokens_per_s": 2 * real_tokens / seconds, "seconds": seconds, "peak_memory_gib": peak_gib,
            "padding_ratio": 1 - 2 * real_tokens / computed, "computed_tokens": computed}


def run(args, model_dir: str) -> dict:
    hf = read_hf_config(model_dir)
    longest_sample = PROMPT_RANGE[1] + 2 * args.seq  # with the longest response doubled
    budget = args.max_tokens or 2 * (PROMPT_RANGE[1] + args.seq)
    micro = max(1, budget // (PROMPT_RANGE[1] + args.seq))  # as many of the longest sample as the budget holds
    prompts, original = lengths(args.batch, args.seq)
    responses = original
    results = {}
    for doubled in (False, True):
        if doubled:
            responses = responses.clone()
            responses[responses.argmax()] *= 2
        real = int((prompts + responses).sum())
        for way, (with_budget, packing, pad_to_longest) in WAYS.items():
            if doubled and way == "budget":
                continue
            cfg = load_config(None, [
                f"model.path={model_dir}", "model.random_init=true", f"model.dtype={args.dtype}",
                "trainer.n_gpus_per_node=1", f"rollout.max_tokens={2 * args.seq}", "rollout.n=1",
                f"rollout.max_model_len={longest_sample + 8}", f"data.max_prompt_length={PROMPT_RANGE[1]}",
                f"data.train_batch_size={args.batch}", f"actor.ppo_mini_batch_size={args.batch}",
                f"actor.micro_batch_size={micro}", f"actor.sequence_packing={packing}",
                f"actor.max_tokens_per_micro_batch={budget if with_budget else 'null'}", "actor.optim.lr=1e-5",
                "model.make_vocab_size_divisible_by=1"])
            batch = long_tailed_batch(prompts, responses, hf["vocab_size"], pad_to_longest)
            [result] = run_distributed(one_way, 1, args=(cfg, batch, real, args.repeats))
            results[way + ("_longest_doubled" if doubled else "")] = result
    packed, padded = results["packed"], results["padded"]
    return {"bench": "variable_length", "value": packed["tokens_per_s"], "unit": "tokens/s",
            "ratio": packed["tokens_per_s"] / padded["tokens_per_s"], "limit_name": "right-padded tokens/s",
            "limit": padded["tokens_per_s"], "max_tokens_per_micro_batch": budget, "padded_micro_batch_size": micro,
            "samples": args.batch, "longest_response": args.seq, "response_lengths": original.tolist(),
            "prompt_lengths": prompts.tolist(),
            "ways": results}
