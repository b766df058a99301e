"""The shard pass's bucket plan: first-use order, sizes, param groups."""
from __future__ import annotations

import zerocc
from tests.architectures import architecture_batches, build_architecture
from tests.reference import two_groups


def test_interleaved_param_groups_share_buckets_instead_of_one_collective_per_parameter():
    model = build_architecture("gnn")   # weights (decayed) and biases (not) alternate in first-use order
    step = zerocc.compile(model, two_groups(model), stage=3)
    step(*architecture_batches("gnn", 1, 2)[0])
    buckets = step.shard_plan.buckets
    assert [len(b.segments) for b in buckets] == [4, 4]
    assert {b.group for b in buckets} == {0, 1}
    for bucket in buckets:
        # in first-use order within the bucket, no overlaps, each start aligned to 64 bytes
        offsets = [s.offset for s in bucket.segments]
        assert offsets == sorted(offsets)
        assert all(s.offset * 4 % 64 == 0 for s in bucket.segments)
        assert all(a.offset + a.numel <= b.offset for a, b in zip(bucket.segments, bucket.segments[1:]))


def test_bucket_size_bounds_buckets():
    model = build_architecture("gnn")
    step = zerocc.compile(model, two_groups(model), stage=3, bucket_bytes=1024)
    step(*architecture_batches("gnn", 1, 2)[0])
    for bucket in step.shard_plan.buckets:
        assert bucket.nbytes <= 1024 or len(bucket.segments) == 1
