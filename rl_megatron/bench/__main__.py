"""Hot-path benchmarks: `python -m rl_megatron.bench {generate,log_probs,update,reshard,train,variable_length,recompute,
multi_turn,agent,async} [--json]`.

Each prints its figure and the ratio to a limit measured in the same run on the same machine:
- generate, log_probs, update: model FLOP/s against the FLOP/s of a plain matrix multiply of the model's
  largest GEMM shape (an MFU measured against what this machine really does, not a datasheet); one process
  (world size 1, the colocated layout of a worker), a ~15M-parameter Qwen2 with random weights;
- reshard (Megatron -> vLLM weights, `--tp/--pp/--engine-tp`): bytes/s against a plain copy of the same bytes
  by the same processes; one process per rank, a ~38M-parameter (150 MB fp32) Qwen2 with random weights; with
  `--moe --ep N` a Qwen3-MoE of the same width (8 experts of width 512, top-2; ~47M parameters, 190 MB fp32)
  whose experts are split over N ranks; with `--placement separate --engines N` the weights go by broadcast from
  the actor's rank 0 to N engine processes of their own (the limit: a copy of the model's bytes); with
  `--lora-rank R` the policy's LoRA adapters alone, after the base (their bytes against the model's);
- train (forward + backward + optimizer step): tokens/s and model FLOP/s against a plain matrix multiply of the
  model's largest GEMM in the same dtype, and MFU against the device's nominal bf16 peak; on GPU Qwen2.5-0.5B's
  shape in bfloat16 (rl_megatron/bench/train.py documents the FLOP count);
- variable_length (old log-probs + one update over long-tailed response lengths): real tokens/s of packed
  token-budget micro-batches against right-padded fixed ones, with padding ratios and peak memory of each, and
  again with the longest sample doubled (rl_megatron/bench/variable_length.py documents the distribution).
- recompute (activation recomputation off / selective / full): the bytes autograd saves for the backward pass of one
  micro-batch and the update's step time per mode, full recomputation's bytes against those without, measured in
  the same run; one process, a ~5M-parameter Qwen2 (hidden 256, 4 layers), 4 x 1024 tokens
  (rl_megatron/bench/recompute.py).
- multi_turn (agent loops with tool latency): trajectories/s with asynchronous turns against the turn-synchronous
  schedule on the same batch, one in-process vLLM engine, a 256-wide 2-layer Qwen2 (rl_megatron/bench/multi_turn.py).
- agent (a user's agent through the OpenAI-compatible gateway): episodes/s of the example `openai` agent
  (examples/agents/lookup_openai.py) against the in-process tool loop on the same lookup rows, seeds and engine, the
  gateway's added latency per call, and the share of episodes with identical tokens (rl_megatron/bench/agent.py).
- async (asynchronous RL): steps/s of the trainer one-step-off against the synchronous run, and streaming's against
  one-step-off's, on the same separate vLLM engine, all real runs of the CPU demo (`--steps`, `--max-tokens`,
  `--staleness`; `--workload long_tail`: answer lengths drawn log-normally, a few ~10x the median), with each mode's
  generation and training times, wait shares, overlap, engine idle share, samples and trained tokens per second and
  the staleness reached, the ideal step max(gen, train), and the engine's limit: its decode step at one sequence and
  at a whole step's samples, and the samples/s of only full steps (rl_megatron/bench/async_rl.py, engine_steps.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import tempfile
import weakref

import torch

from rl_megatron import platform
from rl_megatron.bench.host_syncs import count_syncs
from rl_megatron.bench.measure import build_actor_and_batch, matmul_flops_per_s, peak_extra_memory, timed
from rl_megatron.bench.peer import TransformersPeer, project_freed
from rl_megatron.models.tiny import DIGITS, TOOLS, build_tokenizer

BENCHES = ("generate", "log_probs", "update", "reshard", "train", "variable_length", "recompute", "multi_turn",
           "agent", "async")
PEER_BENCHES = {"transformers": ("train", "log_probs"), "vllm": ("generate", "multi_turn")}  # --peer: who runs it
# Model and batch defaults per benchmark over the common ones. Resharding moves bytes: a model big enough (~150 MB
# fp32) that the figure is not per-call overhead. train's depend on the device (rl_megatron/bench/train.py).
COMMON_DEFAULTS = {"hidden": 512, "layers": 4, "vocab": 4096, "batch": 32, "seq": 256, "threads": os.cpu_count(),
                   "repeats": 5}
MODEL_DEFAULTS = {"reshard": {"hidden": 1024, "layers": 2, "vocab": 8192},
                  "variable_length": {"hidden": 256, "layers": 2, "vocab": 4096},
                  # A few thousand tokens per micro-batch (one micro-batch), long enough sequences that the attention
                  # probabilities count, on a model small enough for seconds per mode on 2 cores.
                  "recompute": {"hidden": 256, "batch": 4, "seq": 1024},
                  "multi_turn": {"hidden": 256, "layers": 2, "batch": 32},
                  # The tool demo's tokenizer (its vocabulary) and chat template; --batch: lookup rows. One engine
                  # thread: the other cores are left to the event loop of the gateway, the agents and the scheduler,
                  # as the trainer's controller has cores of its own beside the engines' workers.
                  "agent": {"hidden": 256, "layers": 2, "vocab": len(TOOLS.tokens), "batch": 16, "threads": 1}}
# variable_length's batch: on a GPU 16 chains of thought of up to 2048 tokens; on CPU 8 of up to 256, 103 s of CPU time
# in all its processes on the 2-core machine (under 2 minutes even one core at a time), where the GPU's batch runs past
# 15 minutes.
VARIABLE_LENGTH_BATCH = {"gpu": {"batch": 16, "seq": 2048}, "cpu": {"batch": 8, "seq": 256}}
MOE_EXPERTS = 8  # reshard --moe
# Set by a benchmark's defaults beside the width: they hold only while --hidden is not given.
WIDTH_KEYS = ("heads", "kv_heads", "intermediate")


def bench_defaults(name: str) -> dict:
    if name == "train":
        from rl_megatron.bench import train

        return {**COMMON_DEFAULTS, **train.default_model()}
    defaults = {**COMMON_DEFAULTS, **MODEL_DEFAULTS.get(name, {})}
    if name == "variable_length":
        defaults.update(VARIABLE_LENGTH_BATCH["gpu" if platform.has_cuda() else "cpu"])
    return defaults


def bench_model_config(hidden: int, layers: int, vocab: int, heads: int | None = None, kv_heads: int | None = None,
                       intermediate: int | None = None, tied: bool = False, max_positions: int = 2048,
                       experts: int = 0) -> dict:
    """A Qwen2 config.json of head_dim 64; the widths not given follow from `hidden`. With `experts`, a Qwen3-MoE
    of that many experts (top-2), each half as wide as the model (a multiple of 32, as vLLM's CPU kernel needs)."""
    heads = heads or hidden // 64
    config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
            "intermediate_size": intermediate or hidden * 11 // 4, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads or max(1, heads // 4), "head_dim": 64,
            "vocab_size": vocab, "max_position_embeddings": max_positions, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": tied, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": "float32"}
    if experts:
        config.update(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", num_experts=experts,
                      num_experts_per_tok=2, moe_intermediate_size=hidden // 2,
                      norm_topk_prob=True)
    return config


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m rl_megatron.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=BENCHES)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    parser.add_argument("--hidden", type=int, help="model width (default 512; reshard 1024; recompute 256; train on "
                                                    "GPU 896)")
    parser.add_argument("--layers", type=int, help="model depth (default 4; reshard 2; train on GPU 24)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default 4096; reshard 8192; train on GPU 151936)")
    parser.add_argument("--batch", type=int, help="sequences per call (default 32; train on CPU 4; recompute 4; "
                                                   "variable_length 16 on GPU, 8 on CPU)")
    parser.add_argument("--seq", type=int, help="tokens per sequence, prompt + response (default 256; train on GPU "
                                                 "1024; recompute 1024); variable_length: the longest response "
                                                 "(default 2048 on GPU, 256 on CPU)")
    parser.add_argument("--max-tokens", type=int,
                        help="variable_length: the token budget of a micro-batch (default: twice the longest "
                             "sample); async: rollout.max_tokens, the longest response (default 64); agent: "
                             "rollout.max_tokens, the tokens of a model turn (default 32)")
    parser.add_argument("--steps", type=int, help="async: training steps of each run (default 8)")
    parser.add_argument("--staleness", type=int, default=1,
                        help="async: trainer.rollout_staleness of the one-step-off and streaming runs (default 1)")
    parser.add_argument("--workload", choices=("demo", "long_tail"), default="demo",
                        help="async: the demo's answers as its random model ends them, or long_tail: lengths drawn "
                             "log-normally, a few ~10x the median (rl_megatron/bench/long_tail.py)")
    parser.add_argument("--turns", type=int, default=4, help="multi_turn: model turns per trajectory")
    parser.add_argument("--n", type=int, default=4, help="agent: samples (episodes) per prompt")
    parser.add_argument("--threads", type=int, help="torch threads (default: the machine's cores; agent 1)")
    parser.add_argument("--repeats", type=int,
                        help="timed repeats (default 5; async 1): reshard syncs (the median is reported), train steps "
                             "(the mean), recompute updates per mode (the median), agent runs of each loop (the "
                             "median), generate and multi_turn --peer vllm runs of each side (the mean), async runs of "
                             "each mode, interleaved (the median)")
    parser.add_argument("--peer", choices=tuple(PEER_BENCHES),
                        help="run a peer on the same work after the project and report ratio_to_peer (the project's "
                             "tokens/s over the peer's). transformers (train, log_probs): Hugging Face transformers, "
                             "in the same process; vllm (generate, multi_turn): vllm.LLM.generate alone, in a process "
                             "of its own (rl_megatron/bench/vllm_peer.py)")
    parser.add_argument("--ladder", action="store_true",
                        help="train: apply the step's levers one after another (fused AdamW, ...), each rung's "
                             "tokens/s, MFU, peak memory and gradient norm; then --peer's step, if given")
    parser.add_argument("--dtype", choices=("bfloat16", "float32"),
                        help="the actor's parameter dtype, not reshard's (default bfloat16 on GPU, float32 on CPU)")
    reshard = parser.add_argument_group("reshard")
    reshard.add_argument("--tp", type=int, help="trainer tensor-parallel size (default 2; 1 with --moe)")
    reshard.add_argument("--pp", type=int, help="trainer pipeline-parallel size (default 2; 1 with --moe)")
    reshard.add_argument("--moe", action="store_true", help="a Qwen3-MoE model (8 experts, top-2)")
    reshard.add_argument("--ep", type=int, default=1, help="trainer expert-parallel size (with --moe)")
    reshard.add_argument("--engine-tp", type=int, help="vLLM engine tensor-parallel size (default: --tp)")
    reshard.add_argument("--bucket-mb", type=int, default=64, help="transfer bucket size in MiB")
    reshard.add_argument("--channel", default="auto", help="auto, process_group or shared_memory")
    reshard.add_argument("--placement", choices=("colocated", "separate"), default="colocated",
                         help="separate: engines in processes of their own, sent the weights by broadcast")
    reshard.add_argument("--engines", type=int, default=1,
                         help="engine processes with --placement separate (engine TP: --engine-tp, default 1)")
    reshard.add_argument("--lora-rank", type=int, default=0,
                         help="a LoRA policy (adapters of this rank on every linear layer of the decoder), colocated: "
                              "also times the sync of the adapters alone (a vLLM LoRA adapter) and reports its bytes "
                              "against the whole model's")
    args = parser.parse_args(argv)
    if args.peer is not None and args.name not in PEER_BENCHES[args.peer]:
        parser.error(f"--peer {args.peer} runs with {' and '.join(PEER_BENCHES[args.peer])} only")
    if args.name == "agent" and args.vocab not in (None, len(TOOLS.tokens)):
        parser.error(f"--vocab: the agent bench's model has the tool demo's tokenizer, {len(TOOLS.tokens)} tokens")
    if args.ladder and args.name != "train":
        parser.error("--ladder runs with train only")
    if args.lora_rank and (args.name != "reshard" or args.placement != "colocated" or args.moe):
        parser.error("--lora-rank runs with reshard of a dense model and colocated engines only (separate engines "
                     "receive the adapters merged: docs/lora.md)")
    return args


def prepare(args) -> str:
    """Fill in the benchmark's defaults of what `args` leaves out, set the thread count, and write the benchmark's
    model (random weights are made when it loads); returns its folder."""
    defaults = bench_defaults(args.name)
    widths = {key: defaults.pop(key) for key in WIDTH_KEYS if key in defaults}
    tied = defaults.pop("tied", False)
    if args.hidden is not None:  # a width given on the command line: heads and MLP width follow from it
        widths = {}
    for key, value in defaults.items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    for key in ("tp", "pp"):
        if getattr(args, key) is None:
            setattr(args, key, 1 if args.moe else 2)
    if args.dtype is None:
        args.dtype = "bfloat16" if platform.has_cuda() else "float32"
    torch.set_num_threads(args.threads)  # before vLLM starts: it freezes the thread count
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    model_dir = tempfile.mkdtemp(prefix="rl_megatron_bench_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(bench_model_config(args.hidden, args.layers, args.vocab, tied=tied,
                                     max_positions=max(2048, 2 * args.seq + 256),
                                     experts=MOE_EXPERTS if args.moe else 0,
                                     **widths), f)
    # The benchmarks feed random token ids; the config's pre-flight check wants a tokenizer (the demo's fits any
    # vocabulary of at least its 18 tokens). agent's: the tool demo's, with its chat template (tokenizer_config.json).
    build_tokenizer(TOOLS if args.name == "agent" else DIGITS).save_pretrained(model_dir, save_jinja_files=False)
    return model_dir


def run_bench(args, model_dir: str) -> dict:
    """The benchmark `args.name` on the model `prepare` wrote: its figures."""
    if args.name == "reshard":
        from rl_megatron.bench import reshard

        return reshard.run(args, model_dir)
    if args.name == "train":
        from rl_megatron.bench import train

        return train.run(args, model_dir)
    if args.name == "variable_length":
        from rl_megatron.bench import variable_length

        return variable_length.run(args, model_dir)
    if args.name == "recompute":
        from rl_megatron.bench import recompute

        return recompute.run(args, model_dir)
    if args.name == "multi_turn":
        from rl_megatron.bench import multi_turn

        return multi_turn.run(args, model_dir)
    if args.name == "agent":
        from rl_megatron.bench import agent

        return agent.run(args, model_dir)
    return run(args, model_dir)


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.name == "async":  # real training runs of the demo's model, each in a subprocess: no bench model
        from rl_megatron.bench import async_rl

        report(async_rl.run(args), args.json)
        return
    report(run_bench(args, prepare(args)), args.json)


def report(result: dict, as_json: bool) -> None:
    if as_json:
        print(json.dumps(result))
        return
    print(f"{result['bench']}: {result['value']:.4g} {result['unit']}  "
          f"({result['ratio']:.3f} of {result['limit_name']} {result['limit']:.4g})")
    if result["bench"] == "train":
        mfu = (f"{result['mfu']:.3f} of {result['nominal_peak_flops']:.4g}" if result["mfu"] is not None else
               f"unknown (no nominal {result['dtype']} peak for {result['device']})")
        print(f"  {result['tokens_per_s']:.4g} tokens/s, MFU {mfu}")
    if "ratio_to_peer" in result:
        print(f"  {result['ratio_to_peer']:.3f} x {result['peer']} ({result['peer_tokens_per_s']:.4g} tokens/s) "
              f"on the same work")
    for key in ("host_syncs_per_update", "host_syncs_per_call"):
        if key in result:
            print(f"  host syncs: {result[key]} per {key.rsplit('_', 1)[1]}")
    if "peak_extra_memory_gib" in result:
        print(f"  peak extra memory {result['peak_extra_memory_gib']:.3f} GiB "
              f"({result['peak_extra_memory_gib'] / result['response_logits_gib']:.2f} x the fp32 logits of one "
              f"micro-batch's response tokens)")
    if result["bench"] == "variable_length":
        for way, figures in result["ways"].items():
            print(f"  {way:<24} {figures['tokens_per_s']:9.4g} tokens/s  padding {figures['padding_ratio']:.3f}  "
                  f"peak memory {figures['peak_memory_gib']:.3f} GiB")
    if result["bench"] == "multi_turn":
        print(f"  {result['trajectories']} trajectories x {result['turns']} turns: asynchronous "
              f"{result['asynchronous_s']:.2f} s, turn-synchronous {result['turn_synchronous_s']:.2f} s")
    if result["bench"] == "agent":
        for name, figures in (("", result), ("1 token a turn: ", result["one_token"])):
            print(f"  {name}{figures['episodes']} episodes x {figures['repeats']} of up to {figures['max_tokens']} "
                  f"tokens a turn: gateway {figures['episodes_per_s']:.4g}/s, in-process "
                  f"{figures['in_process_episodes_per_s']:.4g}/s; added latency per call median "
                  f"{figures['added_latency_ms_median']:.2f} ms, p99 {figures['added_latency_ms_p99']:.2f} ms "
                  f"({figures['calls']} calls); same tokens {figures['same_tokens']:.3f}, "
                  f"{figures['same_tokens_without_malformed_calls'] or float('nan'):.3f} without malformed calls")
        print(f"  one episode at a time: added latency per call median {result['lone_added_latency_ms_median']:.2f} "
              f"ms, p99 {result['lone_added_latency_ms_p99']:.2f} ms ({result['lone_calls']} calls)")
    if result["bench"] == "recompute":
        for mode, figures in result["modes"].items():
            print(f"  {mode}: {figures['saved_bytes'] / 2**20:.1f} MiB saved for the backward, "
                  f"{figures['step_s']:.3f} s per update")
    if result["bench"] == "async":
        for mode, figures in result["modes"].items():
            print(f"  {mode:<12} step {figures['step_s']:.3f} s  gen {figures['gen_s']:.3f} s  train "
                  f"{figures['train_s']:.3f} s  waits: trainer {figures['wait_for_rollout_share']:.2f}, engines "
                  f"{figures['wait_for_train_share']:.2f} of the step  overlap {figures['overlap']:.2f}  responses "
                  f"mean {figures['response_length_mean']:.1f} max {figures['response_length_max']:.0f} tokens  "
                  f"{figures['samples_per_s']:.0f} samples/s, {figures['trained_tokens_per_s']:.0f} trained "
                  f"tokens/s, engines idle {figures['engine_idle_share']:.2f}, staleness max "
                  f"{figures['staleness_max']:.0f}")
        print(f"  ideal one-step-off step max(gen, train) of the synchronous run: {result['ideal_async_step_s']:.3f} s "
              f"({result['ideal_ratio']:.2f}x), measured {result['async_step_s']:.3f} s ({result['ratio']:.2f}x); "
              f"streaming {result['streaming_vs_one_step_off']:.2f}x one-step-off's samples/s")
        engine = result["engine"]
        print(f"  engine: a decode step of 1 sequence {engine['one_step_s'] * 1e3:.2f} ms, of {engine['width']} "
              f"{engine['full_step_s'] * 1e3:.2f} ms ({engine['full_vs_one']:.1f}x); every step full: "
              f"{engine['full_samples_per_s']:.0f} samples/s, streaming reaches "
              f"{result['streaming_vs_full_engine']:.2f} of it")


def run(args, model_dir: str) -> dict:
    actor, hf, batch = build_actor_and_batch(args, model_dir, dtype=args.dtype)
    cfg, response = actor.cfg, args.seq // 2
    params = sum(p.numel() for chunk in actor.chunks for name, p in chunk.named_parameters()
                 if "embedding" not in name)
    tokens = args.batch * args.seq
    peak = matmul_flops_per_s(min(tokens, 2048), hf["hidden_size"], hf["intermediate_size"],
                              device=platform.device(), dtype=getattr(torch, args.dtype))
    compute = {"limit_name": "matmul FLOP/s", "limit": peak, "unit": "FLOP/s"}

    if args.name == "log_probs":
        seconds = timed(lambda: actor.log_probs(batch), repeats=3)
        value = 2 * params * tokens / seconds
        actor.update(dataclasses.replace(batch, old_log_probs=actor.log_probs(batch).log_probs))  # optimizer state
        micro_response = max(int(m.samples.response_mask.sum()) for m in actor.micro_batches(batch))
        figures = {"host_syncs_per_call": count_syncs(actor, lambda: actor.log_probs(batch)).count,
                   "peak_extra_memory_gib": peak_extra_memory(lambda: actor.log_probs(batch)) / 2**30,
                   # the target's unit: fp32 logits of one micro-batch's response tokens
                   "response_logits_gib": micro_response * hf["vocab_size"] * 4 / 2**30}
        if args.peer == "transformers":
            model = weakref.ref(actor.chunks[0])
            del actor
            figures["project_freed_before_peer"] = project_freed(model)
            peer = TransformersPeer(cfg, model_dir, args.dtype)
            peer_seconds = timed(lambda: peer.log_probs(batch), repeats=3)
            figures.update(peer="transformers", peer_tokens_per_s=tokens / peer_seconds,
                           ratio_to_peer=peer_seconds / seconds)
        return {"bench": "log_probs", "value": value, "ratio": value / peak, "seconds": seconds,
                "tokens_per_s": tokens / seconds, **compute, **figures}
    if args.name == "update":
        batch.old_log_probs = actor.log_probs(batch).log_probs
        seconds = timed(lambda: actor.update(batch), repeats=3)
        value = 6 * params * tokens / seconds
        return {"bench": "update", "value": value, "ratio": value / peak, "seconds": seconds,
                "tokens_per_s": tokens / seconds, **compute}

    from rl_megatron.batch import Prompt, Sample
    from rl_megatron.bench.vllm_alone import Conversation
    from rl_megatron.bench.vllm_peer import compare_with_vllm
    from rl_megatron.rollout.engine import request_seeds
    from rl_megatron.rollout.vllm_engine import VLLMEngine

    engine_dtype, engine_seed = "float32", 0
    engine = VLLMEngine(model_dir, cfg.rollout, engine_dtype, seed=engine_seed)
    prompts = [Prompt(ids, "bench", None) for ids in batch.input_ids[:, : args.seq - response].tolist()]
    # The trainer's sampling: a seed per prompt (RolloutEngines.generate's), the same in every call, so that every
    # call makes the same tokens.
    seeds = request_seeds(cfg.trainer.seed, "train", 0, len(prompts))
    samples = []

    def generate():  # a rollout worker's `generate` (EngineHost.generate), in this process: no Ray call around it
        completions = engine.generate([p.ids for p in prompts], n=1, temperature=cfg.rollout.temperature, seeds=seeds)
        samples[:] = [Sample.answering(prompt, c.response_ids, c.log_probs, status=c.status)
                      for prompt, c in zip(prompts, completions)]

    seconds = timed(generate, repeats=args.repeats)
    generated = sum(len(s.response_ids) for s in samples)  # random weights rarely sample EOS: count what was made
    value = 2 * params * generated / seconds
    figures = {}
    if args.peer == "vllm":
        conversations = [Conversation(p.ids, [(cfg.rollout.max_tokens, seed)], []) for p, seed in zip(prompts, seeds)]
        figures = compare_with_vllm(engine, model_dir, engine_dtype, engine_seed, cfg.rollout.temperature,
                                    conversations, generated / seconds, [s.response_ids for s in samples],
                                    repeats=args.repeats, threads=args.threads)
    return {"bench": "generate", "value": value, "ratio": value / peak, "seconds": seconds,
            "tokens_per_s": generated / seconds, **compute, **figures}


if __name__ == "__main__":
    main()
