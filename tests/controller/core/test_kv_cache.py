"""Unit tests of the KV block pool and the prefix-caching KV-cache manager."""

from __future__ import annotations

import pytest

from common.wire.step_types import SamplingParams
from controller.core.block_pool import BlockPool
from controller.core.kv_cache import (
    ROOT_HASH,
    KVCacheManager,
    hash_block_tokens,
    hash_token_blocks,
)
from controller.core.request import Request

BS = 16


def make_request(rid: str, tokens: list[int]) -> Request:
    return Request(rid, list(tokens), SamplingParams(), max_tokens=8)


def admit(kv: KVCacheManager, req: Request, num_new: int | None = None) -> list[int]:
    """First allocation with prefix lookup, as the scheduler does it; marks tokens computed."""
    blocks, hit = kv.get_computed_blocks(req)
    num_new = req.num_tokens - hit if num_new is None else num_new
    ids = kv.allocate_slots(req, num_new, blocks)
    assert ids is not None
    req.num_computed_tokens = hit + num_new
    return ids


def test_hashes_are_chained_and_deterministic() -> None:
    tokens = list(range(40))
    hashes = hash_token_blocks(tokens, BS)
    assert len(hashes) == 2  # the partial third block has no hash
    assert hashes == hash_token_blocks(list(range(40)), BS)
    assert hashes[0] == hash_block_tokens(ROOT_HASH, tokens[:16])
    assert hashes[1] == hash_block_tokens(hashes[0], tokens[16:32])
    other = hash_token_blocks([99] + tokens[1:], BS)
    assert other[0] != hashes[0]
    assert other[1] != hashes[1]  # same block tokens, different parent
    # A stable known value: the hash must not depend on the process (routing uses it).
    assert hash_block_tokens(ROOT_HASH, (1, 2, 3)).hex() == "6b4db9665e8706c68f522c6ee82d071b"
    assert len(hashes[0]) == 16


def test_null_block_is_never_handed_out() -> None:
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(4)
    assert sorted(b.block_id for b in blocks) == [1, 2, 3, 4]
    assert pool.usage == 1.0 and pool.num_free_blocks == 0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    assert pool.num_used_blocks == 0 and pool.usage == 0.0
    with pytest.raises(ValueError):
        BlockPool(1)


def test_freed_blocks_go_to_tail_in_reverse_order_uncached_to_head() -> None:
    kv = KVCacheManager(8, BS)
    req = make_request("a", list(range(40)))  # 2 full blocks + 1 partial
    assert admit(kv, req) == [1, 2, 3]
    assert kv.pool.free_queue.block_ids() == [4, 5, 6, 7]
    kv.free(req)
    # The partial (unhashed) block is evicted first; hashed ones last-block-first at the tail.
    assert kv.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 2, 1]
    assert kv.num_used_blocks == 0


def test_lazy_eviction_drops_hash_only_when_reused() -> None:
    kv = KVCacheManager(5, BS)  # 4 usable blocks
    a = make_request("a", list(range(48)))
    admit(kv, a)
    kv.free(a)
    h0, h1, h2 = a.block_hashes
    assert all(h in kv.pool.cached for h in (h0, h1, h2))
    assert kv.pool.free_queue.block_ids() == [4, 3, 2, 1]
    # A 2-block unrelated request takes block 4 (never cached) and block 3 (a's last block).
    b = make_request("b", [7] * 32)
    assert admit(kv, b) == [4, 3]
    assert h2 not in kv.pool.cached and kv.pool.blocks[3].block_hash == b.block_hashes[1]
    assert kv.pool.cached[h0].block_id == 1 and kv.pool.cached[h1].block_id == 2
    assert kv.pool.num_evictions == 1
    # a's first two blocks are still reusable.
    c = make_request("c", list(range(48)))
    blocks, hit = kv.get_computed_blocks(c)
    assert [blk.block_id for blk in blocks] == [1, 2] and hit == 32
    kv.free(b)


def test_prefix_hit_shares_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(16, BS)
    prefix = list(range(100, 148))  # 3 full blocks
    a = make_request("a", prefix + [1, 2])
    b = make_request("b", prefix + [3, 4, 5])
    ids_a = admit(kv, a)
    ids_b = admit(kv, b)
    assert b.num_computed_tokens == 51
    assert ids_b[:3] == ids_a[:3] and ids_b[3] != ids_a[3]
    assert kv.get_block_ids("b") == ids_b
    for block_id in ids_a[:3]:
        assert kv.pool.blocks[block_id].ref_count == 2
    assert kv.num_used_blocks == 5
    assert kv.prefix_cache_queries == 50 + 51
    assert kv.prefix_cache_hits == 48
    kv.free(a)
    assert kv.pool.blocks[ids_a[0]].ref_count == 1 and kv.num_used_blocks == 4
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_last_token_is_never_a_hit() -> None:
    kv = KVCacheManager(16, BS)
    tokens = list(range(32))  # exactly two full blocks
    a = make_request("a", tokens)
    admit(kv, a)
    kv.free(a)
    b = make_request("b", tokens)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 16 and len(blocks) == 1  # the second block holds the last token
    c = make_request("c", tokens + [5])
    assert kv.get_computed_blocks(c)[1] == 32
    assert kv.peek_prefix_hit(hash_token_blocks(tokens, BS), 32) == 16
    assert kv.peek_prefix_hit(hash_token_blocks(tokens + [5], BS), 33) == 32


def test_hit_on_free_block_touches_it() -> None:
    kv = KVCacheManager(6, BS)
    a = make_request("a", list(range(33)))
    admit(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 5
    b = make_request("b", list(range(33)))
    ids = admit(kv, b)
    assert ids[:2] == [1, 2]
    assert 1 not in kv.pool.free_queue.block_ids() and 2 not in kv.pool.free_queue.block_ids()
    assert kv.pool.blocks[1].ref_count == 1
    assert kv.num_used_blocks == 3
    kv.free(b)
    assert kv.num_used_blocks == 0


def test_allocation_failure_changes_nothing() -> None:
    kv = KVCacheManager(5, BS)  # 4 usable
    a = make_request("a", list(range(48)))
    admit(kv, a)
    kv.free(a)  # 3 cached free blocks + 1 plain
    b = make_request("b", list(range(48)) + list(range(500, 540)))  # 88 tokens: 6 blocks
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == 48
    before = (kv.pool.free_queue.block_ids(), dict(kv.pool.cached), kv.prefix_cache_queries)
    # 3 hit blocks are free themselves: only 1 other block is left for the 3 new ones.
    assert kv.allocate_slots(b, 40, blocks) is None
    assert (kv.pool.free_queue.block_ids(), dict(kv.pool.cached), kv.prefix_cache_queries) == before
    assert kv.get_block_ids("b") == [] and all(blk.ref_count == 0 for blk in blocks)


def test_incremental_allocation_returns_only_new_blocks() -> None:
    kv = KVCacheManager(16, BS)
    req = make_request("r", list(range(20)))
    assert admit(kv, req, 10) == [1]  # chunk 1: tokens 0..9
    assert kv.allocate_slots(req, 0) == []
    assert kv.allocate_slots(req, 10) == [2]  # tokens 10..19
    req.num_computed_tokens = 20
    assert kv.get_block_ids("r") == [1, 2]
    assert len(req.block_hashes) == 1  # only the first block is full
    req.output_token_ids.extend(range(12))  # 32 tokens now
    assert kv.allocate_slots(req, 12) == []
    assert len(req.block_hashes) == 2 and kv.pool.blocks[2].block_hash == req.block_hashes[1]
    with pytest.raises(ValueError):
        kv.allocate_slots(req, 1, kv.get_blocks("r")[:1])
    kv.free(req)
    kv.free(req)  # idempotent
    assert kv.num_used_blocks == 0


def test_free_uncaches_blocks_whose_tokens_were_never_computed() -> None:
    kv = KVCacheManager(8, BS)
    req = make_request("r", list(range(48)))
    assert kv.allocate_slots(req, 48) == [1, 2, 3]  # cached at allocation ...
    assert len(kv.pool.cached) == 3
    req.num_computed_tokens = 16  # ... but only the first block's step counted
    kv.free(req)
    assert list(kv.pool.cached.values()) == [kv.pool.blocks[1]]
    assert kv.pool.blocks[2].block_hash is None and kv.pool.blocks[3].block_hash is None
    assert kv.pool.free_queue.block_ids()[:2] == [2, 3]  # uncached: evicted first


def test_duplicate_block_stays_uncached() -> None:
    kv = KVCacheManager(16, BS)
    a = make_request("a", list(range(32)))
    b = make_request("b", list(range(32)))
    assert kv.allocate_slots(a, 16) == [1]  # chunk: a's block 0 cached
    assert kv.allocate_slots(b, 16) == [2]  # b skipped the lookup: same tokens, other block
    assert kv.pool.blocks[1].block_hash is not None and kv.pool.blocks[2].block_hash is None
    a.num_computed_tokens = b.num_computed_tokens = 16
    kv.free(b)
    kv.free(a)
    assert kv.pool.free_queue.block_ids()[0] == 2 and kv.pool.free_queue.block_ids()[-1] == 1


def test_reset_prefix_cache_and_disabled_caching() -> None:
    kv = KVCacheManager(8, BS)
    a = make_request("a", list(range(40)))
    admit(kv, a)
    assert not kv.reset_prefix_cache()
    kv.free(a)
    assert kv.reset_prefix_cache()
    assert not kv.pool.cached and all(blk.block_hash is None for blk in kv.pool.blocks)
    assert kv.get_computed_blocks(make_request("b", list(range(40))))[1] == 0

    off = KVCacheManager(8, BS, enable_prefix_caching=False)
    c = make_request("c", list(range(40)))
    admit(off, c)
    off.free(c)
    d = make_request("d", list(range(40)))
    assert off.get_computed_blocks(d) == ([], 0)
    assert not off.pool.cached and off.prefix_cache_queries == 0
    assert off.peek_prefix_hit(hash_token_blocks(list(range(40)), BS), 40) == 0


def test_prompt_logprobs_requests_compute_every_position() -> None:
    kv = KVCacheManager(16, BS)
    prefix = list(range(100, 148))  # 3 full blocks
    admit(kv, make_request("a", prefix + [1, 2]))
    b = Request("b", prefix + [3], SamplingParams(prompt_logprobs=0), max_tokens=8)
    blocks, hit = kv.get_computed_blocks(b)
    assert (blocks, hit) == ([], 0)


# --- sliding windows: blocks out of every layer's window go back --------------------------


def test_window_releases_blocks_behind_a_chunked_prefill() -> None:
    """A 160-token prompt in 32-token chunks with a 24-token window holds at most the blocks
    the window and the chunk need; released entries read as the null block."""
    kv = KVCacheManager(num_blocks=20, block_size=BS, sliding_window=24)
    req = make_request("long", list(range(160)))
    peak = 0
    for _ in range(5):
        ids = kv.allocate_slots(req, 32)
        assert ids is not None
        req.num_computed_tokens += 32
        peak = max(peak, kv.num_used_blocks)
        # The next query (at num_computed_tokens) sees positions from there - 23 on.
    table = kv.get_block_ids("long")
    assert len(table) == 10
    first_needed = (128 - 24 + 1) // BS  # the last chunk started at 128
    assert table[:first_needed] == [0] * first_needed
    assert 0 not in table[first_needed:]
    assert peak <= -(-(24 + 32) // BS) + 1
    kv.free(req)
    assert kv.num_used_blocks == 0 and kv.pool.null_block.ref_count == 1


def test_window_decodes_release_one_block_at_a_time() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=BS)
    req = make_request("d", list(range(BS * 2)))
    admit(kv, req)
    held = kv.num_used_blocks
    for _ in range(BS * 3):
        req.output_token_ids.append(1)
        assert kv.allocate_slots(req, 1) is not None
        req.num_computed_tokens += 1
        assert kv.num_used_blocks <= held
    assert kv.get_block_ids("d")[:3] == [0, 0, 0]


def test_window_prefix_hit_is_cut_at_a_released_and_evicted_block() -> None:
    """Released blocks stay findable by their hash until evicted; once one is reused for
    other tokens, a hit on the same prefix stops before it."""
    kv = KVCacheManager(num_blocks=7, block_size=BS, sliding_window=BS)
    prompt = list(range(BS * 4 + 1))
    a = make_request("a", prompt)
    for _ in range(4):  # a 65-token prompt in 16-token chunks: blocks 0.. released behind it
        assert kv.allocate_slots(a, BS) is not None
        a.num_computed_tokens += BS
    assert kv.get_block_ids("a")[:2] == [0, 0]  # released at the last allocation (at 48)
    b = make_request("b", prompt)
    blocks, hit = kv.get_computed_blocks(b)
    assert hit == BS * 4  # every block still cached (released, not evicted)
    kv.free(a)
    other = make_request("o", [7] * (BS * 5))
    admit(kv, other)  # takes the free blocks, evicting the prompt's first ones
    c = make_request("c", prompt)
    blocks, hit = kv.get_computed_blocks(c)
    assert hit == 0  # its first block is gone: no hit past it


def test_prefix_hit_past_the_window_releases_the_hit_blocks_at_once() -> None:
    kv = KVCacheManager(num_blocks=12, block_size=BS, sliding_window=BS)
    prompt = list(range(BS * 5 + 3))
    a = make_request("a", prompt)
    admit(kv, a)
    kv.free(a)
    b = make_request("b", prompt)
    ids = admit(kv, b)  # 80 tokens hit, the last 3 computed; only the last block is needed
    assert ids[:4] == [0, 0, 0, 0] and 0 not in ids[4:]
    assert kv.num_used_blocks == 2
    kv.free(b)
    assert kv.num_used_blocks == 0 and kv.pool.null_block.ref_count == 1
