"""Every hot-path benchmark: one small smoke run each, in a process of its own as users start it, checking its JSON
line's fields, that its figures are finite and positive, and what holds whatever the machine (exactness, memory
bounds, FLOP and token counts). No speed ratio is asserted: on shared cores timings are noise (the ratios belong in
the benchmarks' output and docs/benchmarks.md)."""
import json
import math
import subprocess
import sys

import pytest
from helpers.runs import REPO

from rl_megatron.bench.train import LADDER

# The model of the small benchmarks: hidden 128 = 2 heads of 64, 1 KV head, MLP 352, vocabulary 256, one layer.
# The weights outside the embedding: QKV 128x256 + bias 256, output 128x128, MLP 128x704 + 352x128, two norms of
# 128, the final norm, the output layer 128x256.
SMALL_MODEL_WEIGHTS = 128 * 256 + 256 + 128 * 128 + 128 * 704 + 352 * 128 + 2 * 128 + 128 + 128 * 256
# The ladder's rungs agree on the first update's gradient norm to a few float32 roundings (float32's epsilon 1.2e-7).
GRAD_NORM_ROUNDING = 1e-6
SMALL_ARGS = ("--hidden", "128", "--layers", "1", "--vocab", "256", "--batch", "4", "--seq", "32", "--threads", "1")


def bench(*args: str) -> dict:
    cmd = [sys.executable, "-m", "rl_megatron.bench", *args, "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def assert_positive(figures: dict, *keys: str) -> None:
    """Each of `keys` is in `figures`, a finite number above 0."""
    for key in keys:
        assert key in figures, key
        value = figures[key]
        assert isinstance(value, (int, float)) and math.isfinite(value) and value > 0, (key, value)


@pytest.mark.parametrize("name", ["generate", "log_probs", "update"])
def test_bench_prints_one_json_line(name):
    """The figure is the model's FLOP/s: 2 FLOPs per weight and token forward (log-probs, and each generated token),
    6 with the backward pass (update). generate also runs vLLM alone on the same prompts, seeds and sampling."""
    result = bench(name, *SMALL_ARGS, *(("--peer", "vllm") if name == "generate" else ()))
    assert result["bench"] == name
    assert_positive(result, "value", "limit", "ratio", "tokens_per_s", "seconds")
    flops_per_token = (6 if name == "update" else 2) * SMALL_MODEL_WEIGHTS
    assert result["value"] == pytest.approx(flops_per_token * result["tokens_per_s"])
    tokens = result["tokens_per_s"] * result["seconds"]
    if name == "generate":  # at most the 16 response tokens of each of the 4 prompts
        assert 0 < tokens <= 4 * 16 + 1e-6
        assert_vllm_peer(result, result["tokens_per_s"], sequences=4)
    else:  # the whole batch of 4 x 32 tokens
        assert tokens == pytest.approx(4 * 32)


def assert_vllm_peer(result: dict, tokens_per_s: float, sequences: int) -> None:
    """The figures of `--peer vllm` (not its speed: shared cores make timings noisy). The same seeds draw the same
    tokens, but the peer's kernels may round differently and move a near-tie: all but one of `sequences` agree."""
    assert result["peer"] == "vllm"
    assert_positive(result, "peer_tokens_per_s", "peer_seconds", "ratio_to_peer")
    assert result["ratio_to_peer"] == pytest.approx(tokens_per_s / result["peer_tokens_per_s"])
    assert result["peer_same_tokens"] >= (sequences - 1) / sequences, result


def test_train_bench_reports_tokens_per_s_and_mfu():
    """Training steps of a small model on the CPU: both limits are reported, and the FLOP count is PaLM's
    6 * N + 12 * L * Hq * S per token (N: the weights of the matrix multiplies). transformers' step on the same work
    follows once the project's model is freed (at a 7B width the two did not fit on an 80 GB GPU together). With
    --ladder, each lever's rung first (a fresh actor on the same weights): the first update's gradient the same on
    every rung to float32's rounding, and the figure the last rung's (every lever on)."""
    result = bench("train", *SMALL_ARGS, "--repeats", "2", "--peer", "transformers", "--ladder")
    rungs = result["ladder"]
    assert [r["rung"] for r in rungs] == [name for name, _ in LADDER] and len(rungs) > 1
    # Not bit for bit: Megatron's fused SwiGLU computes its backward by its own expression of the derivative, which
    # rounds apart from autograd's in the last bit on some CPUs (2.4994924 against 2.4994922 on an AMD EPYC with
    # AVX-512, equal on the earlier machines); a lever that changed the arithmetic would move the norm far more.
    assert rungs[0]["grad_norm"] > 0 and all(r["tokens_per_s"] > 0 for r in rungs)
    assert all(r["grad_norm"] == pytest.approx(rungs[0]["grad_norm"], rel=GRAD_NORM_ROUNDING) for r in rungs)
    assert all(r["mfu"] is None and r["peak_memory_bytes"] is None for r in rungs)  # no nominal peak, no CUDA
    assert result["tokens_per_s"] == rungs[-1]["tokens_per_s"]
    assert result["bench"] == "train" and result["dtype"] == "float32" and result["layers_impl"] == "local"
    assert_positive(result, "value", "limit", "ratio", "tokens_per_s", "seconds", "flops_per_token")
    # SMALL_MODEL_WEIGHTS' matrices (no biases, no norms): QKV 128x256, output 128x128, MLP 128x704 + 352x128, head
    # 128x256
    assert result["matmul_weights"] == 128 * 256 + 128 * 128 + 128 * 704 + 352 * 128 + 128 * 256
    assert result["flops_per_token"] == 6 * result["matmul_weights"] + 12 * 1 * 128 * 32
    assert result["value"] == pytest.approx(result["flops_per_token"] * result["tokens_per_s"])
    assert result["tokens_per_s"] * result["seconds"] == pytest.approx(4 * 32)  # one step takes the whole batch
    # No nominal peak on a CPU: MFU is unknown, not a guess.
    assert result["mfu"] is None and result["nominal_peak_flops"] is None
    assert result["peer"] == "transformers" and result["project_freed_before_peer"] is True
    assert_positive(result, "peer_tokens_per_s", "peer_seconds", "ratio_to_peer")
    assert result["ratio_to_peer"] == pytest.approx(result["peer_seconds"] / result["seconds"])


# The shared_memory bucket channel moves the same buckets as process_group (exactness of both:
# tests/distributed/test_resharding.py). Reading in place (auto) is also what the MoE benchmark below runs: `slow`.
# A LoRA policy's adapters at rank 8 on the reshard model (hidden 512 = 8 heads of 64, 2 KV heads, MLP 1408, 2
# layers): A [8, in] and B [out, 8] of q, k, v, o, gate, up and down, fp32.
ADAPTER_PARAMETERS = 2 * 8 * ((512 + 512) + 2 * (512 + 128) + (512 + 512) + 3 * (512 + 1408))


@pytest.mark.parametrize("channel", [pytest.param("auto", marks=pytest.mark.slow), "process_group"])
def test_reshard_is_exact_and_stays_within_its_memory_bound(channel):
    """TP=2 x PP=2 -> engines of TP=2, ~31 MB of weights, read in place (auto) or through 1 MiB buckets: a sync
    that gathered whole models (or whole layers) would blow the bound of one bucket plus the largest tensor
    (a 2.9 MB MLP shard). The policy has rank-8 LoRA adapters, which the engines load alone after the base: each of
    the 4 ranks' engines receives the whole adapter, under 4% of the model's bytes."""
    result = bench("reshard", "--tp", "2", "--pp", "2", "--hidden", "512", "--layers", "2", "--vocab", "2048",
                   "--bucket-mb", "1", "--channel", channel, "--repeats", "3", "--lora-rank", "8")
    assert result["adapter_bytes"] == 4 * 4 * ADAPTER_PARAMETERS and result["lora_rank"] == 8
    assert result["adapter_bytes_ratio"] == result["adapter_bytes"] / result["bytes"] < 0.04
    assert_positive(result, "adapter_seconds")
    assert result["exact"] is True and result["channel"] == channel
    assert_positive(result, "bytes", "seconds", "gbps", "memcpy_gbps", "ratio", "bucket_bytes", "largest_tensor_bytes")
    assert "peak_extra_bytes" in result
    assert result["bytes"] > 4 * (result["bucket_bytes"] + result["largest_tensor_bytes"])
    assert result["peak_extra_bytes"] <= result["bucket_bytes"] + result["largest_tensor_bytes"]
    assert (result["in_place_fraction"] == 1.0) == (channel == "auto")


def test_reshard_of_an_moe_model_reports_the_same_fields():
    """A Qwen3-MoE's experts split over 2 expert-parallel ranks -> a whole engine on each: exact, every byte read in
    place, and the same fields as the dense benchmark."""
    dense_fields = {"exact", "bytes", "seconds", "gbps", "memcpy_gbps", "ratio", "peak_extra_bytes", "bucket_bytes",
                    "largest_tensor_bytes", "in_place_fraction", "seconds_in_place", "channel", "bucket_channel",
                    "layout", "value", "unit", "limit_name", "limit"}
    result = bench("reshard", "--moe", "--ep", "2", "--hidden", "256", "--layers", "1", "--vocab", "512",
                   "--repeats", "2")
    assert dense_fields <= set(result) and result["model"] == "qwen3_moe"
    assert result["layout"] == {"tp": 1, "pp": 1, "ep": 2, "engine_tp": 1}
    assert result["exact"] is True and result["in_place_fraction"] == 1.0
    assert_positive(result, "bytes", "seconds", "gbps", "memcpy_gbps", "ratio", "value", "limit")


def test_reshard_to_separate_engines_reports_the_same_fields():
    """Engines in a process of their own: the actor's rank 0 gathers and broadcasts (TP=2 -> one engine) a bucket
    at a time; every engine parameter equals the sender's export, with the dense benchmark's fields."""
    result = bench("reshard", "--placement", "separate", "--engines", "1", "--tp", "2", "--pp", "1", "--hidden", "512",
                   "--layers", "1", "--vocab", "512", "--repeats", "2", "--bucket-mb", "1")
    assert result["exact"] is True and result["channel"] == "broadcast" and result["in_place_fraction"] == 0.0
    assert result["layout"] == {"tp": 2, "pp": 1, "ep": 1, "engine_tp": 1, "engine_processes": 1}
    assert_positive(result, "bytes", "seconds", "gbps", "memcpy_gbps", "ratio", "value", "limit")
    # The sender holds one bucket (the largest tensor when it is bigger), not the 13 MB of weights.
    bound = max(result["bucket_bytes"], result["largest_tensor_bytes"]) + result["bucket_bytes"]
    assert result["peak_extra_bytes"] <= bound < result["bytes"]


def test_variable_length_bench_compares_padded_budget_and_packed_micro_batches():
    """Long-tailed lengths three ways (each in its own process): packing computes no padding, token budgets less
    than right-padding to the batch's longest, and the figure is packed's real tokens/s over padded's."""
    result = bench("variable_length", "--hidden", "128", "--layers", "1", "--vocab", "256", "--batch", "8", "--seq",
                   "128", "--threads", "1", "--repeats", "1")
    ways = result["ways"]
    assert set(ways) == {"padded", "budget", "packed", "padded_longest_doubled", "packed_longest_doubled"}
    assert_positive(result, "value", "limit", "ratio", "max_tokens_per_micro_batch", "padded_micro_batch_size")
    for way in ways.values():
        assert_positive(way, "tokens_per_s", "seconds", "computed_tokens")
        assert math.isfinite(way["peak_memory_gib"]) and way["peak_memory_gib"] >= 0, way
    assert ways["packed"]["padding_ratio"] == ways["packed_longest_doubled"]["padding_ratio"] == 0.0
    assert 0 < ways["budget"]["padding_ratio"] < ways["padded"]["padding_ratio"]
    assert ways["padded"]["padding_ratio"] < ways["padded_longest_doubled"]["padding_ratio"]
    # Real tokens: both passes (log-probs, update) over the batch, prompts and responses.
    real = 2 * (sum(result["prompt_lengths"]) + sum(result["response_lengths"]))
    assert ways["packed"]["computed_tokens"] == pytest.approx(real)
    longest = max(p + r for p, r in zip(result["prompt_lengths"], result["response_lengths"]))
    assert ways["padded"]["computed_tokens"] == pytest.approx(2 * 8 * longest)
    assert result["ratio"] == ways["packed"]["tokens_per_s"] / ways["padded"]["tokens_per_s"]
    assert max(result["response_lengths"]) == 128 and min(result["response_lengths"]) >= 32


def test_recompute_bench_reports_saved_activations_and_step_time_per_mode():
    """Off / selective / full recomputation of the same model: full keeps the least for the backward pass (each
    layer's input: at most a few hidden-size tensors per layer), selective less than none (not the attention
    probabilities), and every mode's update is timed."""
    result = bench("recompute", "--hidden", "128", "--layers", "2", "--vocab", "256", "--batch", "2", "--seq", "128",
                   "--threads", "1", "--repeats", "1")
    modes = result["modes"]
    assert set(modes) == {"off", "selective", "full"}
    for mode in modes.values():
        assert_positive(mode, "step_s", "saved_bytes")
    assert_positive(result, "value", "limit", "ratio", "micro_batch_tokens")
    assert modes["full"]["saved_bytes"] < modes["selective"]["saved_bytes"] < modes["off"]["saved_bytes"]
    assert result["value"] == modes["full"]["saved_bytes"] and result["limit"] == modes["off"]["saved_bytes"]
    assert result["ratio"] == pytest.approx(result["value"] / result["limit"]) and result["ratio"] < 0.25
    hidden_tensor = result["micro_batch_tokens"] * 128 * 4  # [tokens, hidden] in fp32
    assert result["micro_batch_tokens"] == 2 * 128
    assert modes["full"]["saved_bytes"] <= (2 + 4) * hidden_tensor  # 2 layer inputs, the final norm and head's
    # Selective drops the attention probabilities the local attention keeps ([batch, heads, seq, seq] fp32 per layer,
    # 2 heads) and keeps instead what they are recomputed from (the fused QKV projection: less, at this length).
    attention_probs = 2 * 2 * 128 * 128 * 4
    assert modes["off"]["saved_bytes"] - modes["selective"]["saved_bytes"] >= attention_probs


def test_multi_turn_bench_runs_both_schedules_on_the_same_tokens():
    """Asynchronous turns overlap the tools' latency (0.05-0.5 s a call) with other trajectories' decoding (how much
    faster than the turn-synchronous schedule: `ratio`, in docs/benchmarks.md); both schedules sample from the same
    per-turn seeds, so they draw the same trajectories (as a resumed run must). vLLM alone generates the same turns
    directly."""
    result = bench("multi_turn", "--hidden", "128", "--layers", "1", "--vocab", "256", "--batch", "8", "--turns", "3",
                   "--threads", "1", "--peer", "vllm")
    assert result["bench"] == "multi_turn" and result["trajectories"] == 8 and result["turns"] == 3
    assert result["same_tokens"] == 1.0
    assert_positive(result, "value", "limit", "ratio", "asynchronous_s", "turn_synchronous_s", "model_tokens",
                    "serving_s", "serving_tokens_per_s")
    # ratio: turn-synchronous seconds / asynchronous seconds
    assert result["ratio"] == pytest.approx(result["turn_synchronous_s"] / result["asynchronous_s"])
    assert result["value"] == pytest.approx(8 / result["asynchronous_s"])
    assert_vllm_peer(result, result["serving_tokens_per_s"], sequences=8)


def test_async_bench_runs_synchronous_one_step_off_and_streaming_steps():
    """Three real runs of the CPU demo on a separate engine, synchronous, one-step-off and streaming, 3 steps each of
    answers of up to 24 tokens on the long-tailed workload (step 2 measured): generating batch k + 1 while training on
    batch k hides part of the generation (how much faster the one-step-off step is: `ratio`, and streaming's against
    it, in docs/benchmarks.md)."""
    result = bench("async", "--steps", "3", "--max-tokens", "24", "--workload", "long_tail")
    assert result["bench"] == "async" and result["steps"] == 3 and result["max_tokens"] == 24
    assert result["workload"] == "long_tail" and result["staleness"] == 1 and result["repeats"] == 1
    keys = {"step_s", "gen_s", "train_s", "wait_for_rollout_share", "wait_for_train_share", "overlap",
            "response_length_mean", "response_length_max", "steps", "measured_steps", "run_s", "samples_per_s",
            "trained_tokens_per_s", "engine_idle_share", "staleness_max", "dropped_samples"}
    modes = result["modes"]
    assert set(modes) == {"synchronous", "one_step_off", "streaming"}
    for mode in modes.values():
        assert keys <= set(mode), keys - set(mode)
        assert mode["steps"] == 3 and mode["measured_steps"] == [2]
        assert_positive(mode, "step_s", "gen_s", "train_s", "run_s", "response_length_mean", "response_length_max")
        assert 1 <= mode["response_length_mean"] <= mode["response_length_max"] <= 24
        # Long-tailed: lengths drawn log-normally around 2 tokens, the longest of 256 answers several times the mean.
        assert mode["response_length_max"] >= 4 * mode["response_length_mean"]
        assert mode["samples_per_s"] == pytest.approx(256 / mode["step_s"])
        assert_positive(mode, "trained_tokens_per_s")
        assert mode is modes["streaming"] or mode["engine_idle_share"] == mode["wait_for_train_share"]
    sync, one_off, streaming = modes["synchronous"], modes["one_step_off"], modes["streaming"]
    assert (sync["staleness_max"], one_off["staleness_max"]) == (0, 1) and streaming["staleness_max"] <= 1
    assert 0 <= streaming["engine_idle_share"] <= 1
    assert result["streaming_vs_one_step_off"] == pytest.approx(one_off["step_s"] / streaming["step_s"])
    assert result["streaming_vs_one_step_off_by_repeat"] == [result["streaming_vs_one_step_off"]]
    assert all(mode["samples_per_s_by_repeat"] == [mode["samples_per_s"]] for mode in modes.values())
    assert 0 <= one_off["wait_for_rollout_share"] <= 1 and 0 <= one_off["wait_for_train_share"] <= 1
    assert 0 < one_off["overlap"] <= 1 and sync["overlap"] == 0
    # Synchronous: the step is the generation plus the training, and each side idles through the other's part.
    assert sync["wait_for_rollout_share"] + sync["wait_for_train_share"] == pytest.approx(1)
    assert result["ideal_async_step_s"] == max(sync["gen_s"], sync["train_s"]) < sync["step_s"]
    assert_positive(result, "value", "limit", "ratio", "ideal_async_step_s")
    assert result["value"] == pytest.approx(1 / one_off["step_s"])
    assert result["ratio"] == pytest.approx(sync["step_s"] / one_off["step_s"])
    # The engines' limit: a decode step holding the step's 256 samples costs more than one holding a single sequence,
    # and streaming's samples/s stays under those of an engine decoding only full steps.
    engine = result["engine"]
    assert engine["width"] == 256 and 0 < engine["one_step_s"] < engine["full_step_s"]
    assert engine["full_vs_one"] == pytest.approx(engine["full_step_s"] / engine["one_step_s"])
    assert engine["full_samples_per_s"] == pytest.approx(256 / (streaming["response_length_mean"]
                                                                * engine["full_step_s"]))
    assert 0 < result["streaming_vs_full_engine"] < 1
    assert result["streaming_vs_full_engine"] == pytest.approx(streaming["samples_per_s"]
                                                               / engine["full_samples_per_s"])


def test_agent_bench_runs_the_gateway_and_the_in_process_loop_on_the_same_tokens():
    """The example `openai` agent through the gateway and the in-process tool loop on the same lookup rows, seeds and
    engine (how fast each, and the gateway's latency per call: in docs/benchmarks.md): every episode without a
    malformed call (which no OpenAI client sees, so the harness cannot answer it) has the in-process loop's tokens,
    loss mask and log-probs exactly, with 32 tokens a turn and with 1."""
    result = bench("agent", "--hidden", "128", "--layers", "1", "--batch", "4", "--n", "2", "--threads", "1",
                   "--repeats", "1")
    keys = {"episodes_per_s", "in_process_episodes_per_s", "ratio_to_in_process", "added_latency_ms_median",
            "added_latency_ms_p99", "calls", "same_tokens", "same_tokens_without_malformed_calls", "episodes"}
    assert result["bench"] == "agent" and result["unit"] == "episodes/s" and result["episodes"] == 8
    for figures in (result, result["one_token"]):
        assert keys <= set(figures), keys - set(figures)
        assert figures["same_tokens_without_malformed_calls"] == 1.0
        assert figures["calls"] > 0 and figures["unpaired_episodes"] == 0
        assert figures["failed_episodes"] == 0 and figures["prefix_breaks"] == 0
        assert 0 <= figures["same_tokens"] <= 1
        assert_positive(figures, "episodes_per_s", "in_process_episodes_per_s", "ratio_to_in_process")
        assert figures["ratio_to_in_process"] == pytest.approx(figures["episodes_per_s"]
                                                               / figures["in_process_episodes_per_s"])
    assert result["one_token"]["max_tokens"] == 1 and result["max_tokens"] == 32
    assert_positive(result, "value", "limit", "ratio", "lone_calls")
    assert result["value"] == result["episodes_per_s"] and result["limit"] == result["in_process_episodes_per_s"]
