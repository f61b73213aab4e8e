"""`--peer vllm` (bench generate, bench multi_turn): the project's rollout work again through vLLM alone, after the
project's, and the ratio of the project's tokens/s to vLLM's.

The peer (`vllm_alone.py`) runs in a process of its own, once the project's engine is closed: `vllm.LLM` built with
the arguments the project's engine is built with (`engine_arguments`, the call `VLLMEngine` makes), the same token
prompts, turns and tool replies, and the SamplingParams the project's engine asks for (its `_sampling`: top-p/k,
stop tokens, the sampled token's log-prob) with the same n, temperature, max_tokens and per-request seeds. So both
sample the same tokens (`peer_same_tokens`: the share of identical responses; the engines' kernels may differ, see
`vllm_alone.py`, and move a near-tie). Each side is timed after a warm-up.
"""
from __future__ import annotations

import torch

from rl_megatron import platform
from rl_megatron.bench.vllm_alone import Conversation, Work, run_in_own_process
from rl_megatron.models.hf_config import read_hf_config
from rl_megatron.models.family import family_of
from rl_megatron.models.mxfp4 import is_mxfp4_config
from rl_megatron.rollout.vllm_engine import VLLMEngine, engine_arguments


def compare_with_vllm(engine: VLLMEngine, model_path: str, dtype: str, seed: int, temperature: float,
                      conversations: list[Conversation], tokens_per_s: float, response_ids: list[list[int]],
                      repeats: int, threads: int) -> dict:
    """Close `engine` (built as `VLLMEngine(model_path, engine.cfg, dtype, seed)`), run `conversations` through
    vLLM alone, and compare with the project's `tokens_per_s` and responses (one per conversation)."""
    hf = read_hf_config(model_path)
    arguments = engine_arguments(model_path, engine.cfg, dtype, seed, hf_overrides=None, load_format="dummy",
                                 cuda=platform.has_cuda(), mla=family_of(hf).mla, group_timeout_s=None,
                                 mxfp4_folder=is_mxfp4_config(hf), linear_attention=family_of(hf).gated_delta_net)
    # Read off the project's engine, so that a sampling setting added there reaches the peer.
    sampling = engine._sampling(n=1, temperature=temperature)
    engine.close()  # on a GPU both engines would not fit
    if platform.has_cuda():
        torch.cuda.empty_cache()  # what the engine held goes back to the device, for the peer's process
    timing = run_in_own_process(Work(arguments, sampling, conversations, repeats, threads))
    peer_tokens_per_s = timing.model_tokens / timing.seconds
    same = sum(a == b for a, b in zip(response_ids, timing.response_ids)) / len(conversations)
    return {"peer": "vllm", "peer_tokens_per_s": peer_tokens_per_s, "ratio_to_peer": tokens_per_s / peer_tokens_per_s,
            "peer_seconds": timing.seconds, "peer_same_tokens": same}
