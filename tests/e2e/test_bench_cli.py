"""Every hot-path benchmark runs and reports its figure against a limit measured in the same run."""
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench(*args: str) -> dict:
    cmd = [sys.executable, "-m", "rl_megatron.bench", *args, "--json"]
    done = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("name", ["generate", "log_probs", "update"])
def test_bench_prints_one_json_line(name):
    result = bench(name, "--hidden", "128", "--layers", "1", "--vocab", "256", "--batch", "4", "--seq", "32",
                   "--threads", "1")
    assert result["bench"] == name
    assert result["value"] > 0 and result["limit"] > 0
    assert result["ratio"] == pytest.approx(result["value"] / result["limit"])


def test_train_bench_reports_tokens_per_s_and_mfu():
    """Training steps of a small model on the CPU: both limits are reported, and the FLOP count is PaLM's
    6 * N + 12 * L * Hq * S per token (N: the weights of the matrix multiplies)."""
    result = bench("train", "--hidden", "128", "--layers", "1", "--vocab", "256", "--batch", "4", "--seq", "32",
                   "--threads", "1", "--repeats", "2")
    assert result["bench"] == "train" and result["dtype"] == "float32" and result["layers_impl"] == "local"
    for key in ("value", "limit", "tokens_per_s", "seconds", "flops_per_token"):
        assert result[key] > 0, key
    assert 0 < result["ratio"] <= 1.5
    assert result["ratio"] == pytest.approx(result["value"] / result["limit"])
    assert result["value"] == pytest.approx(result["flops_per_token"] * result["tokens_per_s"])
    # hidden 128 = 2 heads of 64, 1 KV head, MLP 352: QKV 128x256, output 128x128, MLP 128x704 + 352x128, head 128x256
    assert result["matmul_weights"] == 128 * 256 + 128 * 128 + 128 * 704 + 352 * 128 + 128 * 256
    assert result["flops_per_token"] == 6 * result["matmul_weights"] + 12 * 1 * 128 * 32
    # No nominal peak on a CPU: MFU is unknown, not a guess.
    assert result["mfu"] is None and result["nominal_peak_flops"] is None


# The shared_memory bucket channel moves the same buckets as process_group (exactness of both: test_resharding).
@pytest.mark.parametrize("channel", ["auto", "process_group"])
def test_reshard_is_exact_and_stays_within_its_memory_bound(channel):
    """TP=2 x PP=2 -> engines of TP=2, ~31 MB of weights, read in place (auto) or through 1 MiB buckets: a sync
    that gathered whole models (or whole layers) would blow the bound of one bucket plus the largest tensor
    (a 2.9 MB MLP shard)."""
    result = bench("reshard", "--tp", "2", "--pp", "2", "--hidden", "512", "--layers", "2", "--vocab", "2048",
                   "--bucket-mb", "1", "--channel", channel, "--repeats", "3")
    assert result["exact"] is True and result["channel"] == channel
    for key in ("bytes", "seconds", "gbps", "memcpy_gbps", "ratio", "peak_extra_bytes", "bucket_bytes"):
        assert key in result, key
    assert result["ratio"] == pytest.approx(result["gbps"] / result["memcpy_gbps"])
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
    assert result["ratio"] == pytest.approx(result["gbps"] / result["memcpy_gbps"])


def test_reshard_to_separate_engines_reports_the_same_fields():
    """Engines in a process of their own: the actor's rank 0 gathers and broadcasts (TP=2 -> one engine) a bucket
    at a time; every engine parameter equals the sender's export, with the dense benchmark's fields."""
    result = bench("reshard", "--placement", "separate", "--engines", "1", "--tp", "2", "--pp", "1", "--hidden", "512",
                   "--layers", "1", "--vocab", "512", "--repeats", "2", "--bucket-mb", "1")
    assert result["exact"] is True and result["channel"] == "broadcast" and result["in_place_fraction"] == 0.0
    assert result["layout"] == {"tp": 2, "pp": 1, "ep": 1, "engine_tp": 1, "engine_processes": 1}
    assert result["ratio"] == pytest.approx(result["gbps"] / result["memcpy_gbps"])
    # The sender holds one bucket (the largest tensor when it is bigger), not the 13 MB of weights.
    bound = max(result["bucket_bytes"], result["largest_tensor_bytes"]) + result["bucket_bytes"]
    assert result["peak_extra_bytes"] <= bound < result["bytes"]
