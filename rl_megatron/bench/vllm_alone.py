"""vLLM alone, as anyone runs it: one `vllm.LLM` in a process of its own, fed token prompts turn by turn with
`LLM.generate` (the peer of `bench generate --peer vllm` and `bench multi_turn --peer vllm`, see `vllm_peer.py`).

This module is what that process imports: nothing of the project, so none of the project's process-wide settings
reach the engine (on CPU: its kernel choice, `rollout.cpu_engine.keep_cpu_weights_in_place`; Megatron's CUDA-to-CPU
function mode, `platform.cpu_compat`; frozen garbage). The process is spawned and inherits the environment, which
the project's engines run in too (`rollout.vllm_engine.ENGINE_ENV`: the engine core in-process; on CPU no thread
binding).
"""
from __future__ import annotations

import multiprocessing
import time
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Conversation:
    """A prompt and the model turns that follow it, each followed by `reply_ids` (a tool's reply; none for a
    single-turn rollout)."""
    prompt_ids: list[int]
    turns: list[tuple[int, int]]  # (max_tokens, seed) of each model turn
    reply_ids: list[int]


@dataclass(frozen=True)
class Work:
    engine_args: dict  # vllm.LLM(**engine_args)
    sampling: dict  # the SamplingParams fields every request shares (max_tokens and seed are per turn)
    conversations: list[Conversation]
    repeats: int  # timed runs of all the conversations, after one untimed
    threads: int


@dataclass(frozen=True)
class Timing:
    seconds: float  # per run of all the conversations (the mean of the timed runs)
    model_tokens: int  # generated per run
    response_ids: list[list[int]]  # each conversation's tokens after its prompt: turns and replies


def run_in_own_process(work: Work) -> Timing:
    """`measure(work)` in a freshly spawned process (it ends with the call)."""
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(measure, work).result()


def measure(work: Work) -> Timing:
    torch.set_num_threads(work.threads)  # before vLLM starts: it freezes the thread count
    from vllm import LLM  # vLLM reads the environment when it is imported: only in the spawned process

    llm = LLM(**work.engine_args)
    converse(llm, work)  # warm-up
    start = time.perf_counter()
    for _ in range(work.repeats):
        tokens, responses = converse(llm, work)
    return Timing((time.perf_counter() - start) / work.repeats, tokens, responses)


def converse(llm, work: Work) -> tuple[int, list[list[int]]]:
    """Every conversation's turn k in one `generate` call, then turn k + 1; returns the tokens generated and each
    conversation's response."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    conversations = work.conversations
    responses: list[list[int]] = [[] for _ in conversations]
    tokens = 0
    for turn in range(max(len(c.turns) for c in conversations)):
        live = [i for i, c in enumerate(conversations) if turn < len(c.turns)]
        prompts = [TokensPrompt(prompt_token_ids=conversations[i].prompt_ids + responses[i]) for i in live]
        params = [SamplingParams(**work.sampling, max_tokens=conversations[i].turns[turn][0],
                                 seed=conversations[i].turns[turn][1]) for i in live]
        for i, output in zip(live, llm.generate(prompts, params, use_tqdm=False)):
            ids = list(output.outputs[0].token_ids)
            tokens += len(ids)
            responses[i] += ids + conversations[i].reply_ids
    return tokens, responses
