"""Hot-path benchmarks: `python -m rl_megatron.bench {generate,log_probs,update,reshard} [--json]`.

Each prints its figure and the ratio to a limit measured in the same run on the same machine:
- generate, log_probs, update: model FLOP/s against the FLOP/s of a plain matrix multiply of the model's
  largest GEMM shape (an MFU measured against what this machine really does, not a datasheet); one process
  (world size 1, the colocated layout of a worker), a ~15M-parameter Qwen2 with random weights;
- reshard (Megatron -> vLLM weights, `--tp/--pp/--engine-tp`): bytes/s against a plain copy of the same bytes
  by the same processes; one process per rank, a ~38M-parameter (150 MB fp32) Qwen2 with random weights.
"""
from __future__ import annotations

import argparse
import json
import os
import tempfile
import time

import torch

BENCHES = ("generate", "log_probs", "update", "reshard")
# Resharding moves bytes: a model big enough (~150 MB fp32) that the figure is not per-call overhead.
MODEL_DEFAULTS = {"reshard": {"hidden": 1024, "layers": 2, "vocab": 8192}}


def bench_model_config(hidden: int, layers: int, vocab: int) -> dict:
    heads = hidden // 64
    return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": hidden,
            "intermediate_size": hidden * 11 // 4, "num_hidden_layers": layers, "num_attention_heads": heads,
            "num_key_value_heads": max(1, heads // 4), "head_dim": 64, "vocab_size": vocab,
            "max_position_embeddings": 2048, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
            "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
            "torch_dtype": "float32"}


def matmul_flops_per_s(m: int, k: int, n: int, seconds: float = 1.0) -> float:
    a, b = torch.randn(m, k), torch.randn(k, n)
    torch.mm(a, b)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.mm(a, b)
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - start)


def timed(fn, repeats: int) -> float:
    fn()  # warm-up
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl_megatron.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=BENCHES)
    parser.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    parser.add_argument("--hidden", type=int, help="model width (default 512; reshard 1024)")
    parser.add_argument("--layers", type=int, help="model depth (default 4; reshard 2)")
    parser.add_argument("--vocab", type=int, help="vocabulary (default 4096; reshard 8192)")
    parser.add_argument("--batch", type=int, default=32, help="sequences per call")
    parser.add_argument("--seq", type=int, default=256, help="tokens per sequence (prompt + response)")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    reshard = parser.add_argument_group("reshard")
    reshard.add_argument("--tp", type=int, default=2, help="trainer tensor-parallel size")
    reshard.add_argument("--pp", type=int, default=2, help="trainer pipeline-parallel size")
    reshard.add_argument("--engine-tp", type=int, help="vLLM engine tensor-parallel size (default: --tp)")
    reshard.add_argument("--bucket-mb", type=int, default=64, help="transfer bucket size in MiB")
    reshard.add_argument("--channel", default="auto", help="auto, process_group or shared_memory")
    reshard.add_argument("--repeats", type=int, default=5, help="syncs timed (the median is reported)")
    args = parser.parse_args(argv)
    defaults = {"hidden": 512, "layers": 4, "vocab": 4096, **MODEL_DEFAULTS.get(args.name, {})}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    torch.set_num_threads(args.threads)  # before vLLM starts: it freezes the thread count
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    model_dir = tempfile.mkdtemp(prefix="rl_megatron_bench_")
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(bench_model_config(args.hidden, args.layers, args.vocab), f)
    if args.name == "reshard":
        from rl_megatron.bench import reshard

        result = reshard.run(args, model_dir)
    else:
        result = run(args, model_dir)
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{result['bench']}: {result['value']:.4g} {result['unit']}  "
              f"({result['ratio']:.3f} of {result['limit_name']} {result['limit']:.4g})")


def run(args, model_dir: str) -> dict:
    from rl_megatron.config import load_config, read_hf_config
    from rl_megatron.workers.distributed import free_port, init_distributed
    from rl_megatron.workers.megatron_actor import MegatronActor

    hf = read_hf_config(model_dir)
    response = args.seq // 2
    cfg = load_config(None, [f"model.path={model_dir}", "model.random_init=true", "trainer.n_gpus_per_node=1",
                             f"rollout.max_tokens={response}", f"rollout.max_model_len={args.seq + 8}",
                             f"data.max_prompt_length={args.seq - response}", "rollout.n=1",
                             f"data.train_batch_size={args.batch}", f"actor.ppo_mini_batch_size={args.batch}",
                             f"actor.micro_batch_size={min(args.batch, 8)}", "actor.optim.lr=1e-5",
                             "model.make_vocab_size_divisible_by=1"])
    init_distributed(0, 1, "127.0.0.1", free_port(), 1, 1, seed=0)
    actor = MegatronActor(cfg, hf, optimizer_steps=100)
    params = sum(p.numel() for chunk in actor.chunks for name, p in chunk.named_parameters()
                 if "embedding" not in name)
    tokens = args.batch * args.seq
    g = torch.Generator().manual_seed(0)
    batch = {"input_ids": torch.randint(3, args.vocab, (args.batch, args.seq), generator=g),
             "response_mask": torch.zeros(args.batch, args.seq), "advantages": torch.randn(args.batch, generator=g)}
    batch["response_mask"][:, args.seq - response - 1:-1] = 1.0
    peak = matmul_flops_per_s(min(tokens, 2048), args.hidden, args.hidden * 11 // 4)
    compute = {"limit_name": "matmul FLOP/s", "limit": peak, "unit": "FLOP/s"}

    if args.name == "log_probs":
        seconds = timed(lambda: actor.log_probs({"input_ids": batch["input_ids"]}), repeats=3)
        value = 2 * params * tokens / seconds
        return {"bench": "log_probs", "value": value, "ratio": value / peak, "seconds": seconds,
                "tokens_per_s": tokens / seconds, **compute}
    if args.name == "update":
        batch["old_log_probs"] = actor.log_probs({"input_ids": batch["input_ids"]})["log_probs"]
        seconds = timed(lambda: actor.update(batch), repeats=3)
        value = 6 * params * tokens / seconds
        return {"bench": "update", "value": value, "ratio": value / peak, "seconds": seconds,
                "tokens_per_s": tokens / seconds, **compute}

    from rl_megatron.rollout.vllm_engine import VLLMEngine

    engine = VLLMEngine(model_dir, cfg.rollout, "float32", seed=0, eos_token_id=hf["eos_token_id"])
    prompts = batch["input_ids"][:, : args.seq - response].tolist()
    counts = []
    seconds = timed(lambda: counts.append(sum(len(g.response_ids) for g in engine.generate(prompts, n=1))), repeats=2)
    generated = sum(counts[1:]) / len(counts[1:])  # random weights rarely sample EOS: count what was made
    value = 2 * params * generated / seconds
    return {"bench": "generate", "value": value, "ratio": value / peak, "seconds": seconds,
            "tokens_per_s": generated / seconds, **compute}


if __name__ == "__main__":
    main()
