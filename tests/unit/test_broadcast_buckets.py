"""How separate engines' weight broadcasts are cut into buckets (the transport itself runs in
tests/integration/test_weight_sync.py, its memory bound in tests/e2e/test_bench_cli.py)."""
import torch

from rl_megatron.resharding.broadcast import bucket_manifest


def test_buckets_keep_name_order_alignment_and_their_bound():
    shapes = {"b": ((3,), torch.float32), "a": ((5,), torch.bfloat16), "c": ((100,), torch.float32),
              "d": ((2,), torch.int64)}
    buckets = bucket_manifest(shapes, bucket_bytes=64)
    assert [[e.name for e in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"]]  # c (400 B) alone
    a, b = buckets[0]
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 10, 16, 12)  # 16-byte aligned offsets
    assert all(e.offset % 16 == 0 for bucket in buckets for e in bucket)
    assert all(bucket[-1].offset + bucket[-1].nbytes <= 64 for bucket in buckets if len(bucket) > 1)
    assert [e.shape for bucket in buckets for e in bucket] == [(5,), (3,), (100,), (2,)]
