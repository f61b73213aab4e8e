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


@pytest.mark.parametrize("channel", ["auto", "process_group", "shared_memory"])
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
