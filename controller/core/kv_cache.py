"""KV-cache block allocation with prefix caching, for one executor's block pool.

The controller owns the executor's KV memory as `num_blocks` fixed-size blocks of `block_size`
token slots. Block 0 is a null block that is never handed out. A block that is full of known
tokens gets a chained hash of its contents (the hash of the block before it plus its token ids),
so a later request whose prompt starts with the same tokens reuses the block instead of
recomputing it. Freed blocks keep their hash and stay findable until the pool needs them again
(lazy eviction, least recently freed first; the blocks and their pool: block_pool.py).

For a model whose every layer attends to a sliding window of W tokens (Mistral), a request's
leading blocks that fell out of the window of every query still to come are given back as soon
as its computation passes them (their table entries become the null block, which attention
never reads unmasked): a long prompt holds about W / block_size blocks plus one chunk's. They
keep their hash, so a later request with the same prefix can still hit them until they are
evicted; a hit is cut at the first block that is gone, as always. Models that mix windowed and
global layers keep every block (a block holds all layers' keys and values).
"""

from __future__ import annotations

import hashlib
import sys
from array import array
from collections.abc import Sequence

from controller.core.block_pool import BlockPool, KVBlock
from controller.core.request import Request

ROOT_HASH = b"tandem-kv-v1"  # parent "hash" of a sequence's first block


def hash_block_tokens(parent_hash: bytes, token_ids: Sequence[int]) -> bytes:
    """Chained hash of one full block: stable across processes and machines (16 bytes)."""
    packed = array("i", token_ids)
    if sys.byteorder == "big":
        packed.byteswap()  # always hash little-endian int32s
    digest = hashlib.blake2b(parent_hash, digest_size=16)
    digest.update(packed.tobytes())
    return digest.digest()


def hash_token_blocks(token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """Hashes of every full block of `token_ids`, in order (the last partial block has none)."""
    hashes: list[bytes] = []
    parent = ROOT_HASH
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block_tokens(parent, token_ids[start : start + block_size])
        hashes.append(parent)
    return hashes


class KVCacheManager:
    """Block tables of the live requests of one executor, with prefix caching.

    A request's block table grows as the scheduler allocates slots for it. Blocks that are full
    of known tokens are hashed and cached as soon as they are allocated for computing, so two
    requests admitted in the same step already share their common prefix: an executor writes the
    KV of every scheduled token before any attention of that step reads it.
    """

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        sliding_window: int = 0,
    ) -> None:
        if block_size < 1:
            raise ValueError(f"block_size must be positive, got {block_size}")
        self.block_size = block_size  # tokens per block
        self.sliding_window = sliding_window  # every layer sees the last N tokens; 0 = all
        self.enable_prefix_caching = enable_prefix_caching  # look up / cache full blocks
        self.pool = BlockPool(num_blocks)  # the blocks
        self._tables: dict[str, list[KVBlock]] = {}  # request id -> its blocks, in order
        self._num_cached: dict[str, int] = {}  # request id -> leading blocks already cached
        self._num_released: dict[str, int] = {}  # request id -> leading blocks given back
        self.prefix_cache_queries = 0  # tokens of admitted requests looked up (cumulative)
        self.prefix_cache_hits = 0  # of those, tokens found in the cache (cumulative)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use, 0..1."""
        return self.pool.usage

    @property
    def num_used_blocks(self) -> int:
        """Blocks held by live requests."""
        return self.pool.num_used_blocks

    @property
    def num_free_blocks(self) -> int:
        """Blocks not held by any request (some may still be prefix-cached)."""
        return self.pool.num_free_blocks

    def _update_hashes(self, request: Request, num_full_blocks: int) -> list[bytes]:
        """Extend `request.block_hashes` to cover its first `num_full_blocks` full blocks."""
        hashes = request.block_hashes
        bs = self.block_size
        for i in range(len(hashes), num_full_blocks):
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(
                hash_block_tokens(parent, request.token_ids_between(i * bs, (i + 1) * bs))
            )
        return hashes

    def _max_hit_blocks(self, num_tokens: int) -> int:
        # The last token is always recomputed: it must produce the logits of the next token.
        return max(num_tokens - 1, 0) // self.block_size

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of a request's tokens: (its blocks, its length in tokens).

        Walks the hashes of the full blocks from the start and stops at the first miss; at most
        `num_tokens - 1` tokens can hit, rounded down to whole blocks. Takes no reference: pass
        the blocks to `allocate_slots`, which also counts the query and the hit.
        """
        if not self.enable_prefix_caching or request.sampling.prompt_logprobs is not None:
            # Prompt logprobs need every prompt position computed, so no prefix is reused.
            return [], 0
        hashes = self._update_hashes(request, self._max_hit_blocks(request.num_tokens))
        blocks: list[KVBlock] = []
        for block_hash in hashes[: self._max_hit_blocks(request.num_tokens)]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            blocks.append(block)
        return blocks, len(blocks) * self.block_size

    def peek_prefix_hit(self, block_hashes: Sequence[bytes], num_tokens: int) -> int:
        """Tokens a sequence with these full-block hashes would hit now (no side effects).

        For placement: hash a prompt once with `hash_token_blocks`, ask every executor.
        """
        if not self.enable_prefix_caching:
            return 0
        hits = 0
        for block_hash in block_hashes[: self._max_hit_blocks(num_tokens)]:
            if block_hash not in self.pool.cached:
                break
            hits += 1
        return hits * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: Sequence[KVBlock] | None = None,
    ) -> list[int] | None:
        """Give a request room for `num_computed_tokens + num_new_tokens` tokens.

        `computed_blocks` (from `get_computed_blocks`) may only be passed on a request's first
        allocation, while its `num_computed_tokens` is still 0; the caller then sets
        `num_computed_tokens` to the hit length. Returns the ids of the blocks added to the
        request's table by this call (on a first allocation: the whole table, hits included),
        or None when too few blocks are free, in which case nothing changes. Every block that
        becomes full of known tokens with this step is then cached.
        """
        rid = request.request_id
        table = self._tables.get(rid)
        if table is not None and self.sliding_window:
            self._release_out_of_window(rid, table, request.num_computed_tokens)
        if table is not None and not computed_blocks:
            # Fast path (most decode steps): room already held and no block newly full.
            num_total = request.num_computed_tokens + num_new_tokens
            if num_total <= len(table) * self.block_size and (
                not self.enable_prefix_caching
                or min(num_total, len(request.prompt_token_ids) + len(request.output_token_ids))
                // self.block_size
                <= self._num_cached[rid]
            ):
                return []
        first = table is None
        computed = list(computed_blocks or ())
        if computed and not first:
            raise ValueError(f"request {rid}: computed blocks passed on a later allocation")
        num_total = request.num_computed_tokens + len(computed) * self.block_size + num_new_tokens
        num_held = (0 if first else len(table)) + len(computed)
        num_needed = max(-(-num_total // self.block_size) - num_held, 0)
        # Hit blocks sitting in the free queue stop being free once touched.
        num_free_hits = sum(1 for block in computed if block.ref_count == 0)
        if num_needed > self.pool.num_free_blocks - num_free_hits:
            return None

        if first:
            table = self._tables[rid] = []
            self._num_cached[rid] = len(computed)
            if self.enable_prefix_caching:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += len(computed) * self.block_size
        self.pool.touch(computed)
        new_blocks = computed + self.pool.get_new_blocks(num_needed)
        table.extend(new_blocks)

        if self.enable_prefix_caching:
            num_full = min(num_total, request.num_tokens) // self.block_size
            start = self._num_cached[rid]
            if num_full > start:
                hashes = self._update_hashes(request, num_full)
                for i in range(start, num_full):
                    if table[i] is not self.pool.null_block:
                        self.pool.cache_block(table[i], hashes[i])
                self._num_cached[rid] = num_full
        if first and self.sliding_window:  # a long prefix hit may reach past the window
            first_position = request.num_computed_tokens + len(computed) * self.block_size
            self._release_out_of_window(rid, table, first_position)
            new_blocks = table
        self._set_room(request, table)
        return [block.block_id for block in new_blocks]

    def _set_room(self, request: Request, table: list[KVBlock]) -> None:
        """Tell the request how far it may grow without an `allocate_slots` call (see
        `Request.kv_room`): the slots its table holds, and the end of its first block not yet
        cached. A sliding window releases blocks as computation advances: always call."""
        if self.sliding_window:
            request.kv_room = request.kv_hash_limit = 0
            return
        request.kv_room = len(table) * self.block_size
        request.kv_hash_limit = (
            (self._num_cached[request.request_id] + 1) * self.block_size
            if self.enable_prefix_caching
            else request.kv_room + 1
        )

    def _release_out_of_window(self, rid: str, table: list[KVBlock], position: int) -> None:
        """Give back the leading blocks that no query at ``position`` or later can see (a
        query at p sees p - window + 1 .. p); their table entries become the null block."""
        keep_from = max(position - self.sliding_window + 1, 0) // self.block_size
        done = self._num_released.get(rid, 0)
        if keep_from <= done:
            return
        released = table[done:keep_from]
        table[done:keep_from] = [self.pool.null_block] * (keep_from - done)
        self._num_released[rid] = keep_from
        self.pool.free_blocks(released)

    def get_block_ids(self, request_id: str) -> list[int]:
        """A request's whole block table (a copy); empty when it holds none."""
        return [block.block_id for block in self._tables.get(request_id, ())]

    def get_blocks(self, request_id: str) -> list[KVBlock]:
        """A request's block objects (a copy), for tests and debugging."""
        return list(self._tables.get(request_id, ()))

    def free(self, request: Request) -> None:
        """Release a request's blocks (idempotent).

        Blocks covering tokens at or beyond `request.num_computed_tokens` may have been cached
        for a step whose result never counted (an error, a preemption in the step that
        scheduled them); those lose their hash if nobody else holds them, so that no later
        request trusts their contents.
        """
        table = self._tables.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        request.kv_room = request.kv_hash_limit = 0
        released = self._num_released.pop(request.request_id, 0)
        if not table:
            return
        for block in table[request.num_computed_tokens // self.block_size :]:
            if block.ref_count == 1 and block is not self.pool.null_block:
                self.pool.uncache(block)
        self.pool.free_blocks(table[released:])  # the first ones went back already

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any request holds blocks."""
        return self.pool.reset_prefix_cache()
