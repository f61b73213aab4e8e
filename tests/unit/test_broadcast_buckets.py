"""How separate engines' weight broadcasts are cut into buckets (the transport itself runs in
tests/integration/test_weight_sync.py)."""
import torch

from rl_megatron.resharding.broadcast import bucket_manifest


def test_buckets_keep_name_order_alignment_and_their_bound():
    tensors = {"b": torch.zeros(3, dtype=torch.float32), "a": torch.zeros(5, dtype=torch.bfloat16),
               "c": torch.zeros(100, dtype=torch.float32), "d": torch.zeros(2, dtype=torch.int64)}
    buckets = bucket_manifest(tensors, bucket_bytes=64)
    assert [[e.name for e in bucket] for bucket in buckets] == [["a", "b"], ["c"], ["d"]]  # c (400 B) alone
    a, b = buckets[0]
    assert (a.offset, a.nbytes, b.offset, b.nbytes) == (0, 10, 16, 12)  # 16-byte aligned offsets
    assert all(e.offset % 16 == 0 for bucket in buckets for e in bucket)
    assert all(bucket[-1].offset + bucket[-1].nbytes <= 64 for bucket in buckets if len(bucket) > 1)
    assert [e.shape for bucket in buckets for e in bucket] == [(5,), (3,), (100,), (2,)]
