"""The rollout engine: vLLM, in-process inside the worker that also holds the Megatron shards.

The engine starts with dummy weights; the trainer pushes its own weights before the first generation
(`load_weights`), so that the engine always samples from exactly the policy being trained.
Log-probs are `processed_logprobs`: after temperature, which is what the trainer computes.
"""
from __future__ import annotations

import contextlib
import gc
import glob
import logging
import os
from dataclasses import dataclass
from typing import Iterable

import torch

from rl_megatron import platform
from rl_megatron.config.schema import RolloutConfig

# Set before vLLM is imported: an in-process engine (no engine-core subprocess) with its sockets on loopback.
ENGINE_ENV = {
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
    "TOKENIZERS_PARALLELISM": "false",
    # vLLM's start-up notices (and per-sync INFO lines) would drown the progress bar; set
    # VLLM_LOGGING_LEVEL in the environment to see them.
    "VLLM_LOGGING_LEVEL": os.environ.get("VLLM_LOGGING_LEVEL", "ERROR"),
}
CPU_ENGINE_ENV = {
    "VLLM_HOST_IP": "127.0.0.1",
    # Megatron and vLLM say these on any CPU machine; expected there (CUDA advice, TE/apex absent), so not shown.
    "PYTHONWARNINGS": "ignore:Transformer Engine and Apex are not installed,ignore:Apex is not installed,"
                      "ignore:full scope is deprecated,ignore:When using async grad allreduce,"
                      "ignore:`torch.distributed.reduce_op` is deprecated",
    # The worker pins its own threads; vLLM's automatic OpenMP binding would put every engine on one core.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}


def _is_rotary_reload_notice(record: logging.LogRecord) -> bool:
    # reload_weights finds no checkpoint tensor for the rotary embedding's computed buffers and keeps them,
    # as it should, but warns on every sync.
    return record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def remove_stale_cpu_shm() -> None:
    """A sharded CPU engine all-reduces through /dev/shm segments whose names are the same in every run
    ('-tp:0-[0-1]-cpushm_0', ...). A run that was killed leaves them behind, and the next engine then
    fails with 'create shm in SHMManager failed. errno: 17'. Remove those that no live process maps."""
    leftovers = set(glob.glob("/dev/shm/*-cpushm_*"))
    if not leftovers:
        return
    for maps in glob.glob("/proc/[0-9]*/maps"):
        try:
            with open(maps) as f:
                leftovers -= {line.split(maxsplit=5)[-1].strip() for line in f if "cpushm_" in line}
        except OSError:  # the process ended, or is not ours to read
            continue
    for path in leftovers:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


@dataclass
class Generation:
    prompt_ids: list[int]
    response_ids: list[int]
    response_log_probs: list[float]


class VLLMEngine:
    def __init__(self, model_path: str, cfg: RolloutConfig, dtype: str, seed: int, eos_token_id: int):
        for key, value in {**ENGINE_ENV, **({} if platform.has_cuda() else CPU_ENGINE_ENV)}.items():
            os.environ.setdefault(key, value)
        from vllm import LLM

        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").addFilter(
            lambda record: not _is_rotary_reload_notice(record))

        if cfg.tensor_parallel_size > 1 and not platform.has_cuda():
            remove_stale_cpu_shm()
        memory = ({"gpu_memory_utilization": cfg.gpu_memory_utilization} if platform.has_cuda()
                  else {"kv_cache_memory_bytes": cfg.kv_cache_bytes})
        self.cfg, self.eos_token_id = cfg, eos_token_id
        self.llm = LLM(
            model=model_path,
            dtype=dtype,  # never "auto": on CPU vLLM would silently pick bf16
            load_format="dummy",
            skip_tokenizer_init=True,
            max_model_len=cfg.max_model_len,
            enforce_eager=not platform.has_cuda(),
            seed=seed,
            tensor_parallel_size=cfg.tensor_parallel_size,
            # TP=1: a whole engine per worker. TP>1: the engine's shards live in the workers that already
            # form the trainer's process group (vLLM's SPMD mode); every shard is given the same prompts.
            distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1 else "external_launcher",
            logprobs_mode="processed_logprobs",
            enable_prefix_caching=True,
            **memory,
        )

    def _model_runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def generate(self, prompts: list[list[int]], n: int, temperature: float | None = None) -> list[Generation]:
        """`n` samples for each prompt, prompt-major (sample j of prompt i is at i * n + j)."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        params = SamplingParams(
            n=n,
            temperature=self.cfg.temperature if temperature is None else temperature,
            top_p=self.cfg.top_p,
            top_k=self.cfg.top_k,
            max_tokens=self.cfg.max_tokens,
            stop_token_ids=[self.eos_token_id],
            logprobs=0,
            detokenize=False,
        )
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        generations = []
        for prompt, output in zip(prompts, outputs):
            for sample in sorted(output.outputs, key=lambda s: s.index):
                ids = list(sample.token_ids)
                log_probs = [step[token].logprob for step, token in zip(sample.logprobs, ids)]
                generations.append(Generation(prompt, ids, log_probs))
        return generations

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Replace the engine's weights in place (HF names and layouts) and drop cached KV of the old ones."""
        # Not `model.load_weights`: on CPU vLLM repacks linear weights at load, and reload redoes that.
        self._model_runner().reload_weights(weights_iterator=iter(named_tensors), is_checkpoint_format=True)
        self.llm.reset_prefix_cache()

    def readable_weights(self) -> dict[str, torch.Tensor]:
        """The engine's parameters by vLLM name, except those vLLM repacked for the CPU kernels (size 0)."""
        model = self._model_runner().get_model()
        return {name: p.detach().cpu().clone() for name, p in model.named_parameters() if p.numel() > 0}

    def close(self) -> None:
        """Free the engine and its process groups; a sharded engine's groups own /dev/shm segments that are
        only unlinked here (a killed process leaves them behind)."""
        from vllm.distributed.parallel_state import destroy_model_parallel

        del self.llm
        destroy_model_parallel()
        gc.collect()
