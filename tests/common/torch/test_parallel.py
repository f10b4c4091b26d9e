"""How a tensor-parallel model is cut: ranges, heads and vocabulary slices (no processes)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from common.torch.parallel import (  # noqa: E402
    HeadShard,
    TensorParallel,
    head_shard,
    split_range,
    stored_kv_heads,
)


def test_split_range_covers_everything_once_with_lengths_within_one():
    for n, parts in [(9, 2), (1536, 2), (14336, 8), (3, 3), (7, 4)]:
        ranges = [split_range(n, parts, i) for i in range(parts)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        lengths = [b - a for a, b in ranges]
        assert max(lengths) - min(lengths) <= 1


def test_heads_split_by_whole_gqa_groups():
    # The default model: 9 query heads reading 3 key/value heads (3 each), over 2 ranks.
    assert head_shard(9, 3, 2, 0) == HeadShard(0, 6, 0, 2)
    assert head_shard(9, 3, 2, 1) == HeadShard(6, 3, 2, 1)
    # Llama-3-8B over 8: one KV head and its 4 query heads per rank.
    assert [head_shard(32, 8, 8, r) for r in (0, 7)] == [
        HeadShard(0, 4, 0, 1),
        HeadShard(28, 4, 7, 1),
    ]
    assert stored_kv_heads(32, 8, 8) == 8
    assert head_shard(32, 8, 1, 0) == HeadShard(0, 32, 0, 8)


def test_fewer_kv_heads_than_ranks_are_replicated():
    # 2 KV heads (2 query heads each) over 4 ranks: each KV head on 2 ranks, one query each.
    shards = [head_shard(4, 2, 4, r) for r in range(4)]
    assert [(s.q_start, s.q_count, s.kv_start, s.kv_count) for s in shards] == [
        (0, 1, 0, 1),
        (1, 1, 0, 1),
        (2, 1, 1, 1),
        (3, 1, 1, 1),
    ]
    assert stored_kv_heads(4, 2, 4) == 4
    with pytest.raises(ValueError, match="does not fit"):
        head_shard(4, 2, 8, 0)  # 4 replicas of a KV head that has 2 query heads
    with pytest.raises(ValueError, match="does not fit"):
        head_shard(8, 4, 6, 0)  # 6 ranks cannot replicate 4 KV heads evenly
    # The default model over 6 ranks: each KV head on 2 ranks, its 3 query heads split 2 + 1.
    assert [head_shard(9, 3, 6, r).q_count for r in range(6)] == [2, 1] * 3
    assert stored_kv_heads(9, 3, 6) == 6


def test_vocabulary_slices_are_equal_and_padded():
    tp = [TensorParallel(r, 3, None) for r in range(3)]
    assert [t.vocab_shard(49152) for t in tp] == [(0, 16384), (16384, 16384), (32768, 16384)]
    assert [t.vocab_shard(10) for t in tp] == [(0, 4), (4, 4), (8, 4)]  # the last: 2 rows padded
