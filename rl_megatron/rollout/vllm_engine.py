"""The rollout engine of rollout.engine=vllm (`rollout/engine.py::RolloutEngine`): vLLM, in-process inside the worker
that also holds the Megatron shards.

The engine starts with dummy weights; the trainer writes its own weights into the engine's parameters (in
place, see `rl_megatron.resharding`) before the first generation, so that the engine always samples from
exactly the policy being trained.
Log-probs are `processed_logprobs`: after temperature, which is what the trainer computes.
"""
from __future__ import annotations

import gc
import os
import re
import warnings

import torch

from rl_megatron import platform
from rl_megatron.batch import SampleStatus
from rl_megatron.rollout.completions import Completion, TurnRequest, completion_of, sampled
from rl_megatron.rollout.cpu_engine import keep_cpu_weights_in_place, name_cpu_shm_by_world, remove_stale_cpu_shm
from rl_megatron.rollout.moe_backend import check_engine_moe_kernels, engine_moe_arguments, pins_moe_backend
from rl_megatron.rollout.routing_capture import EngineRouting
from rl_megatron.rollout.vllm_allocator import vllm_allocator_settings
from rl_megatron.rollout.vllm_cpu_attention import check_cpu_attention
from rl_megatron.rollout.vllm_qwen3_5 import register_qwen3_5_text_models
from rl_megatron.config.schema import RolloutConfig
from rl_megatron.models.family import family_of
from rl_megatron.models.hf_config import end_of_sequence_ids, read_hf_config
from rl_megatron.models.mxfp4 import is_mxfp4_config, unquantized_engine_overrides
from rl_megatron.platform.cpu_compat import device_mode_off
from rl_megatron.platform.debugger import collective_timeout
from rl_megatron.resharding.specs import Held, zero_what_no_region_holds
from rl_megatron.rollout.engine import SLEEP_LEVELS, WAKE_TAGS
from rl_megatron.rollout.vllm_weights import rederive_after_sync, vllm_targets

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
    # The worker pins its own threads; vLLM's automatic OpenMP binding would put every engine on one core.
    "VLLM_CPU_OMP_THREADS_BIND": "nobind",
}
# Megatron and vLLM say these on any CPU machine; expected there (CUDA advice, TE/apex absent), so not shown.
CPU_NOTICES = ("Transformer Engine and Apex are not installed", "Apex is not installed", "full scope is deprecated",
               "When using async grad allreduce", "`torch.distributed.reduce_op` is deprecated")


def configure_engine_process() -> None:
    """This process's environment for vLLM (and its quiet CPU warnings), decided by this process's own device: it runs
    in each worker before vLLM or Megatron is imported, so that a driver without a GPU does not decide for GPU
    workers (it would give them VLLM_HOST_IP=127.0.0.1)."""
    cpu = not platform.has_cuda()
    for key, value in {**ENGINE_ENV, **(CPU_ENGINE_ENV if cpu else {})}.items():
        os.environ.setdefault(key, value)
    if cpu:
        for notice in CPU_NOTICES:
            warnings.filterwarnings("ignore", message=re.escape(notice))


CPU_STEP_TOKENS = 4096  # vLLM's default token budget of a scheduler step
ADAPTER_NAME, ADAPTER_ID = "policy", 1  # the one LoRA adapter an engine of a LoRA policy serves


def engine_arguments(model_path: str, cfg: RolloutConfig, dtype: str, seed: int, hf_overrides: dict | None,
                     load_format: str, cuda: bool, mla: bool, group_timeout_s: int | None,
                     routing: bool = False, lora_rank: int = 0, mxfp4_folder: bool = False,
                     linear_attention: bool = False) -> dict:
    """vLLM's `LLM(...)` arguments (fields of its EngineArgs) for an engine of `model_path` on a CUDA device or not;
    `mla`: the model's attention is DeepSeek's MLA; `group_timeout_s`: its process groups' timeout (None: vLLM's);
    `routing`: return each token's experts (`rollout/routing_capture.py`: vLLM's own on CUDA, which wants prefix
    caching; captured here on CPU, which wants every position computed by its own request); `lora_rank`: serve one
    LoRA adapter of up to this rank (0: none); `mxfp4_folder`: model_path's config.json declares MXFP4 weights
    (`models.mxfp4.is_mxfp4_config`: gpt-oss as released); `linear_attention`: the model has Gated DeltaNet layers,
    whose states vLLM caches by prefix only with chunked prefill, which CPU engines go without."""
    if mxfp4_folder:
        # vLLM would build MXFP4 expert layers from the folder's quantization_config, which the weight sync (the
        # trainer's bf16/fp32 tensors) cannot write: the engine is built unquantized, in `dtype`, as the trainer
        # holds the model (its experts dequantized on load).
        hf_overrides = unquantized_engine_overrides(hf_overrides, load_format)
    device = ({"gpu_memory_utilization": cfg.gpu_memory_utilization} if cuda
              else {"kv_cache_memory_bytes": cfg.kv_cache_bytes,
                    # A prompt split over two scheduler steps (chunked prefill) rewinds its seeded generator, which
                    # CPU generators cannot: "CPU Generator does not use offset". Whole prompts only, and a step's
                    # budget that holds the longest.
                    "enable_chunked_prefill": False,
                    "max_num_batched_tokens": max(cfg.max_model_len or 0, CPU_STEP_TOKENS)})
    if not cuda and mla:
        # On hosts with AMX, vLLM's AMX_MLA backend repacks kv_b_proj and frees it: a sync could not write it.
        device["attention_backend"] = "CPU_MLA"
    return dict(
        model=model_path,
        hf_overrides=hf_overrides,
        dtype=dtype,  # never "auto": on CPU vLLM would silently pick bf16
        load_format=load_format,
        skip_tokenizer_init=True,
        max_model_len=cfg.max_model_len,
        enforce_eager=not cuda,
        seed=seed,
        tensor_parallel_size=cfg.tensor_parallel_size,
        # TP=1: a whole engine per worker. TP>1: the engine's shards live in the workers that already form the
        # trainer's process group (vLLM's SPMD mode); every shard is given the same prompts.
        distributed_executor_backend="uni" if cfg.tensor_parallel_size == 1 else "external_launcher",
        # Each Ray worker sees one GPU, but vLLM's custom all-reduce takes the shards' group ranks for device
        # ordinals and opens IPC handles to GPUs the process cannot see: it fails at engine start for TP > 1.
        # NCCL's all-reduce is used instead (verl's SPMD rollout passes the same flag for the same reason).
        disable_custom_all_reduce=True,
        # vLLM 0.32 schedules step N+1 while step N runs on CUDA (its CPU platform never does). `serve`,
        # `interrupt` and the weight sync between bursts assume each engine.step() has finished its requests'
        # work (outputs, freed KV blocks) when it returns, as the CPU suite checks: off until a GPU test covers it.
        async_scheduling=False,
        logprobs_mode="processed_logprobs",
        enable_prefix_caching=cuda or not (routing or linear_attention),
        enable_return_routed_experts=cuda and routing,
        # GPU: lets the engine free its memory while the trainer computes (see `sleep`); CPU vLLM has none.
        enable_sleep_mode=cuda,
        distributed_timeout_seconds=group_timeout_s,
        cpu_distributed_timeout_seconds=group_timeout_s,
        # The policy's adapters, one at a time, replaced in place at each weight sync (`load_adapter`).
        **({"enable_lora": True, "max_lora_rank": lora_rank, "max_loras": 1} if lora_rank else {}),
        **engine_moe_arguments(model_path, cuda),  # CUDA MoE engines on Triton's experts (rollout/moe_backend.py)
        **device,
    )


def drop_prefix_cache(llm) -> None:
    """Forget every cached KV block of `llm` (a vLLM LLM), which was computed with the weights before a sync. vLLM
    only logs a warning and returns False when blocks are still in use: the stale blocks would then be reused."""
    if not llm.reset_prefix_cache():
        raise RuntimeError("vLLM could not reset its prefix cache after a weight update: KV blocks of running "
                           "requests are still in use, and cached KV computed with the old weights would be reused. "
                           "Finish or interrupt() every request before syncing weights.")


class VLLMEngine:
    process_env = ENGINE_ENV
    configure_process = staticmethod(configure_engine_process)
    check_model = staticmethod(check_cpu_attention)  # the head sizes its CPU attention kernels take
    lora_ranks = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's choices of max_lora_rank
    adapters_on_output_layer = False
    preload = "rl_megatron.rollout.vllm_import"

    def __init__(self, model_path: str, cfg: RolloutConfig, dtype: str, seed: int, hf_overrides: dict | None = None,
                 load_format: str = "dummy", routing: bool = False, lora_rank: int = 0):
        """`hf_overrides`: config.json fields to replace (the moe section's expert count and top-k), as the trainer's
        model has them. `load_format`: "dummy" (the trainer writes every weight before the first generation) or
        "auto" (the folder's own safetensors, as any vLLM user loads it). Generation stops at the folder's
        end-of-sequence ids (`end_of_sequence_ids`: the engine has no tokenizer to take them from). `routing`: each
        completion carries the experts of every position (moe.engine_routing). `lora_rank`: generate through the
        LoRA adapter that `load_adapter` loads (of up to this rank)."""
        configure_engine_process()
        from vllm import LLM  # after the environment is set: vLLM reads some of it at import
        from vllm.platforms import current_platform

        if not platform.has_cuda():
            # vLLM compiles a few small helpers (the rank of each sampled token among the logprobs, masks) with
            # inductor on their first use: a C++ build of about 2 s in each engine's first generation. Traced
            # eagerly (read when their modules load, during the engine's start) they compute the same integers as
            # fast on CPU.
            current_platform.simple_compile_backend = "eager"
            keep_cpu_weights_in_place()
            if cfg.tensor_parallel_size > 1:
                remove_stale_cpu_shm()
                name_cpu_shm_by_world()
        self.cfg = cfg
        hf = read_hf_config(model_path)
        self.stop_token_ids = end_of_sequence_ids(model_path, hf)
        self.in_proj_packing = family_of(hf).in_proj_packing  # how the folders store a Gated DeltaNet's in_proj
        register_qwen3_5_text_models(hf.get("architectures") or [])
        self.sleeps = platform.has_cuda()  # vLLM's sleep mode (see `sleep`); its CPU backend has none
        self.asleep: set[str] = set()  # the parts (WAKE_TAGS) that `sleep` freed and no `wake_up` has restored
        self.unfinished: dict[str, str] = {}  # `serve`'s requests not finished yet: vLLM's own id of each
        self.adapter = None  # the LoRARequest of the adapter every request goes through (`load_adapter`)
        # vLLM's own groups among an engine's TP shards: a day with Ray's debugger on (a shard may be paused at a
        # breakpoint), vLLM's default (None) otherwise.
        timeout = collective_timeout(None)
        group_timeout_s = None if timeout is None else int(timeout.total_seconds())
        # vLLM collects garbage several times while it starts. What lives now (torch, Megatron, the trainer's models)
        # lives for the whole run: frozen, the collections skip it (about 1 s less per engine on CPU). vLLM freezes
        # its own start-up objects the same way afterwards.
        gc.freeze()
        with vllm_allocator_settings():  # the engine allocates its weights and KV cache here
            try:
                self.llm = LLM(**engine_arguments(model_path, cfg, dtype, seed, hf_overrides, load_format,
                                                  cuda=platform.has_cuda(), mla=family_of(hf).mla,
                                                  group_timeout_s=group_timeout_s, routing=routing,
                                                  lora_rank=lora_rank, mxfp4_folder=is_mxfp4_config(hf),
                                                  linear_attention=family_of(hf).gated_delta_net))
            except ValueError as err:
                if lora_rank and "support LoRA" in str(err):
                    raise ValueError(f"{err} Set actor.lora.merge=true: the engines then receive the weights with "
                                     "the adapters merged.") from err
                raise
        if pins_moe_backend(model_path, platform.has_cuda()):  # the kernels vLLM chose, read back
            check_engine_moe_kernels(self.llm, self.model())
        if load_format == "dummy":  # the syncs write every region; what holds none must not stay random
            with torch.no_grad():
                zero_what_no_region_holds(self.sync_targets())
        self.routing = (EngineRouting(self._model_runner(), self.llm.llm_engine.output_processor.request_states,
                                      captured=not platform.has_cuda()) if routing else None)

    def _model_runner(self):
        return self.llm.llm_engine.model_executor.driver_worker.worker.model_runner

    def generate(self, prompts: list[list[int]], n: int, temperature: float | None = None,
                 seeds: list[int] | None = None, max_tokens: int | None = None) -> list[Completion]:
        """`n` samples for each prompt, prompt-major (sample j of prompt i is at i * n + j). With `seeds`, prompt
        i's samples are drawn from seeds[i] (vLLM seeds sample j with seeds[i] + j): they then depend on nothing
        else, not on earlier calls nor on which engine runs them, so a resumed run samples as the original did."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        settings = self._sampling(n=n, temperature=self.cfg.temperature if temperature is None else temperature,
                                  max_tokens=self.cfg.max_tokens if max_tokens is None else max_tokens)
        per_prompt = (SamplingParams(**settings) if seeds is None
                      else [SamplingParams(**settings, seed=seed) for seed in seeds])
        with device_mode_off():
            outputs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], per_prompt,
                                        use_tqdm=False, lora_request=self.adapter)
        return [completion_of(sample, self._routing(output, sample))
                for output in outputs for sample in sorted(output.outputs, key=lambda s: s.index)]

    def _routing(self, output, sample):
        """The routing of `sample` (a CompletionOutput of the RequestOutput `output`), with moe.engine_routing."""
        if self.routing is None:
            return None
        return self.routing.of(output, sample)

    def _sampling(self, **settings) -> dict:
        return dict(top_p=self.cfg.top_p, top_k=self.cfg.top_k, ignore_eos=self.cfg.ignore_eos,
                    stop_token_ids=[] if self.cfg.ignore_eos else self.stop_token_ids, logprobs=0, detokenize=False,
                    **settings)

    def serve(self, requests: list[TurnRequest], max_steps: int | None = None) -> list[tuple[str, Completion]]:
        """Continuous batching, driven by the controller: add `requests` to what the engine is decoding, then decode
        until at least one request finishes (or none is left, or `max_steps` scheduler steps passed); returns the
        finished ones by request id. Between calls the controller runs tools, adds the next turns of other
        trajectories (so no turn waits for a whole batch) and, with partial rollouts, interrupts the engine for a
        weight update (`interrupt`). The shards of an engine (rollout TP > 1) get the same calls in the same order
        and stay in step."""
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        engine = self.llm.llm_engine
        for request in requests:
            # Finished requests' outputs only, as vLLM's own offline `generate` asks: a cumulative output of every
            # running request at every step cost ~13% of a full decode step on CPU (docs/benchmarks.md, 2026-12-02).
            params = SamplingParams(**self._sampling(n=1, temperature=request.temperature,
                                                     max_tokens=request.max_tokens, seed=request.seed),
                                    output_kind=RequestOutputKind.FINAL_ONLY)
            self.unfinished[request.request_id] = engine.add_request(
                request.request_id, TokensPrompt(prompt_token_ids=request.token_ids), params,
                lora_request=self.adapter)
        finished, steps = [], 0
        while not finished and engine.has_unfinished_requests() and steps != max_steps:
            with device_mode_off():
                outputs = engine.step()
            for output in outputs:  # each one finished
                finished.append((output.request_id, completion_of(output.outputs[0],
                                                                  self._routing(output, output.outputs[0]))))
                self.unfinished.pop(output.request_id, None)
            steps += 1
        return finished

    def interrupt(self) -> list[tuple[str, Completion]]:
        """Abort every request `serve` has not finished; returns what each sampled so far (ABORTED), by request id,
        read from vLLM's record of the request before it goes. The controller continues them after a weight update
        as new requests (their tokens appended to the prompt), so their KV cache is recomputed with the new
        weights."""
        states = self.llm.llm_engine.output_processor.request_states  # by vLLM's own id
        cut = []
        for request_id, own_id in self.unfinished.items():
            state = states[own_id]
            tokens = state.detokenizer.output_token_ids
            routing = (None if self.routing is None else
                       self.routing.of_cut(request_id, len(state.prompt_token_ids) + len(tokens) - 1))
            cut.append((request_id, sampled(tokens, state.logprobs_processor.logprobs, SampleStatus.ABORTED,
                                            routing)))
        if self.unfinished:
            self.llm.llm_engine.abort_request(list(self.unfinished))
        self.unfinished = {}
        if self.routing is not None:
            self.routing.forget()  # the aborted requests' rows past what their outputs show
        return cut

    def model(self) -> torch.nn.Module:
        """The engine's model on this rank (its parameters are what a weight sync writes)."""
        return self._model_runner().get_model()

    def sync_targets(self) -> Held:
        """This rank's vLLM parameters and the HF regions each keeps (`rollout/vllm_weights.py`)."""
        return vllm_targets(self.model(), self.in_proj_packing)

    def sleep(self, level: int = 2) -> None:
        """Free the engine's device memory while the trainer uses the device (the hybrid engine, GPU).

        level 1: the weights go to host memory, the KV cache is dropped (for an engine serving LoRA adapters, whose
        frozen base no sync after the first resends); level 2: both are dropped (vLLM keeps the model's buffers,
        e.g. rotary tables), right when a weight sync rewrites every weight before the next generation; the worker's
        `PhaseMachine.sleep_level` chooses. The parameters keep their addresses (vLLM's CuMem allocator), so the
        resharding plan made at start stays valid; after level 2 they hold whatever the memory held, the parameters
        no sync writes too, which the worker zeroes again (`zero_what_no_region_holds`). A no-op while any part is
        asleep: wake it fully before sleeping again.
        A no-op on CPU: vLLM's CPU backend has no sleep mode, and its memory is host memory already; the trainer
        calls this unconditionally."""
        if level not in SLEEP_LEVELS:
            raise ValueError(f"sleep(level={level}): use 1 (weights to host memory) or 2 (weights dropped; the next "
                             "weight sync rewrites them).")
        if self.sleeps and not self.asleep:
            with vllm_allocator_settings():
                self.llm.sleep(level=level)
            self.asleep = set(WAKE_TAGS)

    def wake_up(self, tags: tuple[str, ...] = WAKE_TAGS) -> None:
        """Reallocate what `sleep` freed: "weights" before a weight sync writes them, "kv_cache" before generating
        (waking the weights first keeps the peak lower while the trainer's state is still leaving the device).
        Parts already awake are skipped (vLLM would skip the whole call). A no-op on CPU (see `sleep`)."""
        unknown = [tag for tag in tags if tag not in WAKE_TAGS]
        if unknown:
            raise ValueError(f"wake_up(tags={list(tags)}): {unknown} unknown; use any of {list(WAKE_TAGS)}.")
        waking = [tag for tag in tags if tag in self.asleep]
        if waking:
            with vllm_allocator_settings():
                self.llm.wake_up(waking)
            self.asleep -= set(waking)

    def weights_updated(self) -> None:
        """Drop cached KV computed with the previous weights, and remake what vLLM derives from the weights."""
        drop_prefix_cache(self.llm)
        rederive_after_sync(self.model())

    def load_adapter(self, folder: str) -> None:
        """The PEFT adapter folder `folder` (rewritten by each weight sync) as the adapter of every request from now
        on, replacing the one loaded before in place; cached KV computed through the old one is dropped. Call it
        with no request running (as a weight sync is)."""
        from vllm.lora.request import LoRARequest

        if not self.llm.llm_engine.add_lora(LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder, load_inplace=True)):
            raise RuntimeError(f"vLLM did not load the policy's LoRA adapter from {folder}.")
        self.adapter = LoRARequest(ADAPTER_NAME, ADAPTER_ID, folder)
        drop_prefix_cache(self.llm)

    def adapter_mismatches(self, tensors: dict[str, torch.Tensor], scale: float) -> list[str]:
        """The adapter tensors (`tensors`: PEFT's names without its prefix, as `load_adapter`'s folder holds them)
        that the engine's loaded adapter does not hold bit for bit. vLLM folds the scale alpha / r into B."""
        manager = self._model_runner().lora_manager._adapter_manager  # the worker's cache of loaded adapters
        loaded = manager.get_adapter(ADAPTER_ID)
        packed = manager.packed_modules_mapping
        held = {}
        for module, weights in loaded.loras.items():
            prefix, _, last = module.rpartition(".")
            parts = packed.get(last, [last]) if isinstance(weights.lora_a, list) else [last]
            pairs = zip(weights.lora_a, weights.lora_b) if isinstance(weights.lora_a, list) else [
                (weights.lora_a, weights.lora_b)]
            for part, (a, b) in zip(parts, pairs):
                if a is not None:
                    held[f"{prefix}.{part}.lora_A.weight"] = a
                    held[f"{prefix}.{part}.lora_B.weight"] = b
        bad = [name for name in tensors if name not in held]
        for name, tensor in tensors.items():
            expected = tensor * scale if ".lora_B." in name else tensor
            if name in held and not torch.equal(held[name].cpu(), expected.to(held[name].dtype)):
                bad.append(name)
        return bad + [f"{name} (not sent)" for name in held if name not in tensors]

    def release_process_groups(self) -> None:
        """What would outlive the process: a sharded engine's groups own /dev/shm segments that are only unlinked
        here (a killed process leaves them behind). A worker about to end needs only this; freeing the engine
        (`close`) costs seconds of garbage collection there (vLLM's shutdown collects twice, over Megatron's heap)."""
        from vllm.distributed.parallel_state import destroy_model_parallel

        destroy_model_parallel()

    def close(self) -> None:
        """Free the engine and its process groups, in a process that goes on (e.g. to start another engine)."""
        self.release_process_groups()
        del self.llm
        gc.collect()
