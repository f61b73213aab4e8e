"""`python -m rl_megatron.bench train --json`: tokens/s and MFU of Megatron training steps, one process.

With `--peer transformers`, Hugging Face transformers' step on the same work follows in the same process
(bench/peer.py), and `ratio_to_peer` is the project's tokens/s over transformers'. With `--ladder`, the step's levers
(LADDER) are applied one after another, each rung a fresh actor on the same weights and batch: its tokens/s, MFU,
peak device memory and the first update's gradient norm (which no lever may change beyond float32's rounding),
and the figure is the last rung's, every lever on. Every run also counts the host syncs of one update
(`host_syncs_per_update`, bench/host_syncs.py; on a GPU beside CUDA's own count).

A step is the actor's update over one mini-batch: forward, backward and optimizer step (PPO loss on the response
tokens, every token forwarded). Default model: on GPU Qwen2.5-0.5B's shape (hidden 896, 24 layers, 14 heads, 2 KV
heads, MLP 4864, vocabulary 151936, tied embeddings) in bfloat16; on CPU the ~15M-parameter Qwen2 of the other
benchmarks in float32. Random weights, built from a config here: nothing is downloaded.

Model FLOPs per token of a training step (PaLM, Chowdhery et al. 2022, appendix B):

    6 * N + 12 * L * Hq * S

N: weights of the matrix multiplies (QKV, attention output, gated MLP, and the output layer, which multiplies even
when tied to the embedding; the embedding lookup, norms and biases are not matrix multiplies); L layers; Hq = heads
x head_dim; S tokens per sequence. 6 = 2 FLOPs per multiply-add x (forward + backward's two products). The second
term is attention's QK^T and AV over the full S x S square (not halved for the causal mask, as PaLM and Megatron
count). The optimizer step and the element-wise work count nothing, so MFU charges them to the step's time.

The figure is compared with two limits: the FLOP/s of a plain matrix multiply of the model's largest GEMM shape on
the same device, dtype and run (`ratio`, as every benchmark reports), and the device's nominal dense bf16 peak
(`mfu`; null where the device is not in the table or the model does not run in bfloat16).
"""
from __future__ import annotations

import weakref

import torch
from megatron.core import tensor_parallel

from rl_megatron import platform
from rl_megatron.bench.host_syncs import count_syncs, gpu_sync_warnings
from rl_megatron.bench.measure import build_actor_and_batch, matmul_flops_per_s, timed
from rl_megatron.bench.peer import TransformersPeer, project_freed
from rl_megatron.models.family import head_dim
from rl_megatron.models.gpt import uses_transformer_engine
from rl_megatron.platform.device_stats import nominal_bf16_flops

# The levers of the step's memory traffic, in the order `--ladder` applies them (each rung adds one to those before):
# (name, config overrides). The first rung has every lever off.
LADDER = (("unfused", ("actor.optim.fused=false", "actor.fused_swiglu=false", "actor.fused_log_probs=false",
                       "actor.gradient_accumulation_fusion=false")),
          ("fused AdamW", ("actor.optim.fused=true",)),  # torch's fused kernel where Megatron took torch's AdamW
          ("fused SwiGLU", ("actor.fused_swiglu=true",)),  # Megatron's bias_activation_fusion, compiled
          ("fused log-probs", ("actor.fused_log_probs=true",)),  # each chunk of logits' work compiled
          ("wgrad into main grads", ("actor.gradient_accumulation_fusion=true",)))  # no bf16 weight gradients

# Qwen2.5-0.5B's shape: the default model on GPU.
QWEN2_5_0_5B = {"hidden": 896, "layers": 24, "vocab": 151936, "heads": 14, "kv_heads": 2, "intermediate": 4864,
                "tied": True}


def default_model() -> dict:
    """The model (hidden/layers/vocab, plus widths) and batch this device benchmarks by default: the 0.5B shape on
    GPU; on CPU a small model and batch, so that the run takes seconds."""
    if platform.has_cuda():
        return {**QWEN2_5_0_5B, "batch": 32, "seq": 1024}
    return {"hidden": 512, "layers": 4, "vocab": 4096, "batch": 4, "seq": 256}


def _attention_width(hf: dict) -> int:
    return hf["num_attention_heads"] * head_dim(hf)


def layer_gemms(hf: dict) -> list[tuple[int, int]]:
    """(in, out) features of each weight matrix one token goes through in a layer: QKV, attention output, the
    gated MLP's fused gate and up projection, its down projection."""
    hidden, ffn = hf["hidden_size"], hf["intermediate_size"]
    q = _attention_width(hf)
    kv = hf["num_key_value_heads"] * (q // hf["num_attention_heads"])
    return [(hidden, q + 2 * kv), (q, hidden), (hidden, 2 * ffn), (ffn, hidden)]


def matmul_weights(hf: dict) -> int:
    """N of the FLOP count: the weights of every matrix multiply, the output layer included."""
    per_layer = sum(k * n for k, n in layer_gemms(hf))
    return hf["num_hidden_layers"] * per_layer + hf["hidden_size"] * hf["vocab_size"]


def training_flops_per_token(hf: dict, seq: int) -> float:
    """6 * N + 12 * L * Hq * S (module docstring)."""
    return 6 * matmul_weights(hf) + 12 * hf["num_hidden_layers"] * _attention_width(hf) * seq


def largest_gemm(hf: dict) -> tuple[int, int]:
    """(in, out) features of the model's largest weight matrix (the output layer's, for a large vocabulary)."""
    return max(layer_gemms(hf) + [(hf["hidden_size"], hf["vocab_size"])], key=lambda shape: shape[0] * shape[1])


def nominal_peak(dtype: str) -> tuple[float | None, str]:
    """(the device's nominal dense bf16 FLOP/s or None, the device's name)."""
    if not platform.has_cuda():
        return None, "cpu"
    name = torch.cuda.get_device_name()
    return (nominal_bf16_flops(name) if dtype == "bfloat16" else None), name


def rung(args, model_dir: str, overrides: tuple[str, ...]) -> tuple:
    """A fresh actor with `overrides` on the bench's weights and batch, its steps timed: (actor, HF config, batch,
    seconds a step, the first update's metrics, peak device memory in bytes, None on a CPU)."""
    actor, hf, batch = build_actor_and_batch(args, model_dir, dtype=args.dtype, overrides=overrides)
    batch.old_log_probs = actor.log_probs(batch).log_probs
    if platform.has_cuda():
        torch.cuda.reset_peak_memory_stats()
    first = actor.update(batch)
    # Each update is one optimizer step on the whole batch (build_actor_and_batch makes it one mini-batch).
    seconds = timed(lambda: actor.update(batch), repeats=args.repeats, warmup=1)
    peak = torch.cuda.max_memory_allocated() if platform.has_cuda() else None
    return actor, hf, batch, seconds, first, peak


def model_flops(hf: dict, args, seconds: float) -> tuple[float, float | None]:
    """The model FLOP/s of a step of `seconds` on the bench's batch, and its MFU (None without a nominal peak)."""
    value = training_flops_per_token(hf, args.seq) * args.batch * args.seq / seconds
    peak, _ = nominal_peak(args.dtype)
    return value, (value / peak if peak else None)


def ladder(args, model_dir: str) -> tuple:
    """Every rung of LADDER, each actor freed before the next; the last rung's actor and the rungs' figures."""
    rungs, levers = [], []
    for name, overrides in LADDER:
        levers.extend(overrides)
        if rungs:  # the previous rung's actor freed, and the first rung's random weights (its world's seed) again
            del actor
            tensor_parallel.model_parallel_cuda_manual_seed(0)
            torch.manual_seed(0)
        actor, hf, batch, seconds, first, peak = rung(args, model_dir, tuple(levers))
        rungs.append({"rung": name, "adds": list(overrides), "tokens_per_s": args.batch * args.seq / seconds,
                      "seconds": seconds, "mfu": model_flops(hf, args, seconds)[1], "peak_memory_bytes": peak,
                      "grad_norm": first["actor/grad_norm"]})
    return actor, hf, batch, rungs[-1]["seconds"], rungs


def run(args, model_dir: str) -> dict:
    if args.ladder:
        actor, hf, batch, seconds, rungs = ladder(args, model_dir)
    else:
        actor, hf, batch, seconds, _, _ = rung(args, model_dir, ())
        rungs = None
    tokens = args.batch * args.seq
    syncs = count_syncs(actor, lambda: actor.update(batch))
    figures = {"host_syncs_per_update": syncs.count, "host_sync_sites": syncs.report(5),
               "micro_batches": len(actor.micro_batches(batch)), **({"ladder": rungs} if rungs else {})}
    if platform.has_cuda():  # what CUDA itself reports, to check the count against
        figures["cuda_sync_warnings_per_update"] = gpu_sync_warnings(lambda: actor.update(batch))
    cfg, micro_batch = actor.cfg, actor.batching.micro_batch_size
    params = sum(p.numel() for chunk in actor.chunks for p in chunk.parameters())
    if args.peer == "transformers":
        model = weakref.ref(actor.chunks[0])
        del actor
        figures["project_freed_before_peer"] = project_freed(model)
        peer = TransformersPeer(cfg, model_dir, args.dtype)
        peer_seconds = timed(lambda: peer.update(batch), repeats=args.repeats, warmup=2)
        figures.update(peer="transformers", peer_tokens_per_s=tokens / peer_seconds, peer_seconds=peer_seconds,
                       ratio_to_peer=peer_seconds / seconds)
    flops_per_token = training_flops_per_token(hf, args.seq)
    value, mfu = model_flops(hf, args, seconds)

    micro_tokens = micro_batch * args.seq
    gemm = (min(micro_tokens, 8192), *largest_gemm(hf))
    limit = matmul_flops_per_s(*gemm, device=platform.device(), dtype=getattr(torch, args.dtype))
    peak, device_name = nominal_peak(args.dtype)
    return {"bench": "train", "value": value, "unit": "FLOP/s", "ratio": value / limit,
            "limit_name": "matmul FLOP/s", "limit": limit, "tokens_per_s": tokens / seconds, "seconds": seconds,
            "mfu": mfu, "nominal_peak_flops": peak, "device": device_name,
            "dtype": args.dtype, "layers_impl": "transformer_engine" if uses_transformer_engine() else "local",
            "batch": args.batch, "seq": args.seq, "micro_batch": micro_batch,
            "flops_per_token": flops_per_token, "matmul_weights": matmul_weights(hf),
            "params": params,
            "matmul_shape": list(gemm), **figures}
