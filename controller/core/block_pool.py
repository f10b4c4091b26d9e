"""The KV blocks of one executor and their pool: the free queue (eviction order) and the map
from a block's chained hash to the block holding those tokens.

Block 0 is a null block that is never handed out. A freed block keeps its hash and stays
findable until the pool hands it out again (lazy eviction, least recently freed first).
`KVCacheManager` (kv_cache.py) keeps the requests' block tables over this pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(eq=False, slots=True)
class KVBlock:
    """One block of the pool. Blocks compare by identity."""

    block_id: int  # index into the executor's KV cache
    ref_count: int = 0  # live requests whose block table holds this block
    block_hash: bytes | None = None  # chained hash once cached; None = not reusable
    prev: KVBlock | None = None  # free-queue link towards the head (evicted first)
    next: KVBlock | None = None  # free-queue link towards the tail


class FreeBlockQueue:
    """Doubly linked list of free blocks in eviction order, O(1) at both ends and in the middle."""

    def __init__(self) -> None:
        self._head = KVBlock(-1)  # sentinel before the first block
        self._tail = KVBlock(-1)  # sentinel after the last block
        self._head.next = self._tail
        self._tail.prev = self._head
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def _link(self, block: KVBlock, before: KVBlock, after: KVBlock) -> None:
        block.prev, block.next = before, after
        before.next = block
        after.prev = block
        self._len += 1

    def append(self, block: KVBlock) -> None:
        """Put a block at the tail (evicted last)."""
        assert self._tail.prev is not None
        self._link(block, self._tail.prev, self._tail)

    def appendleft(self, block: KVBlock) -> None:
        """Put a block at the head (evicted first)."""
        assert self._head.next is not None
        self._link(block, self._head, self._head.next)

    def remove(self, block: KVBlock) -> None:
        """Take a block out of the queue, wherever it is."""
        assert block.prev is not None and block.next is not None, "block is not free"
        block.prev.next = block.next
        block.next.prev = block.prev
        block.prev = block.next = None
        self._len -= 1

    def popleft(self) -> KVBlock:
        """Take the block at the head."""
        block = self._head.next
        if block is None or block is self._tail:
            raise IndexError("no free block")
        self.remove(block)
        return block

    def block_ids(self) -> list[int]:
        """Ids from head to tail (for tests and debugging; O(n))."""
        ids = []
        block = self._head.next
        while block is not None and block is not self._tail:
            ids.append(block.block_id)
            block = block.next
        return ids


class BlockPool:
    """All KV blocks of one executor: the free queue and the hash -> cached block map."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 2:
            raise ValueError(
                f"num_blocks must be at least 2 (block 0 is reserved), got {num_blocks}"
            )
        self.num_blocks = num_blocks  # including the null block
        self.blocks = [KVBlock(i) for i in range(num_blocks)]  # indexed by block id
        self.null_block = self.blocks[0]  # reserved, never handed out
        self.null_block.ref_count = 1
        self.free_queue = FreeBlockQueue()  # free blocks, eviction order
        for block in self.blocks[1:]:
            self.free_queue.append(block)
        self.cached: dict[bytes, KVBlock] = {}  # block hash -> block holding those tokens
        self.num_evictions = 0  # cached blocks whose hash was dropped for reuse

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request holds (cached or not)."""
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        """Blocks some live request holds (null block excluded)."""
        return self.num_blocks - 1 - len(self.free_queue)

    @property
    def usage(self) -> float:
        """Fraction of the usable blocks in use, 0..1."""
        return self.num_used_blocks / (self.num_blocks - 1)

    def get_cached_block(self, block_hash: bytes) -> KVBlock | None:
        """The block cached under this hash, in use or free, or None."""
        return self.cached.get(block_hash)

    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue, dropping their old hashes."""
        if count > len(self.free_queue):
            raise ValueError(f"asked for {count} blocks, {len(self.free_queue)} free")
        blocks = []
        for _ in range(count):
            block = self.free_queue.popleft()
            if block.block_hash is not None:
                self.uncache(block)
                self.num_evictions += 1
            block.ref_count = 1
            blocks.append(block)
        return blocks

    def touch(self, blocks: Sequence[KVBlock]) -> None:
        """Take a reference on cached blocks (prefix hit), pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_count == 0:
                self.free_queue.remove(block)
            block.ref_count += 1

    def cache_block(self, block: KVBlock, block_hash: bytes) -> None:
        """Make a full block findable under `block_hash`.

        If another block already holds the same tokens, this one stays uncached (a duplicate).
        """
        if block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        self.cached[block_hash] = block

    def uncache(self, block: KVBlock) -> None:
        """Drop a block's hash so that no prefix lookup finds it."""
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def free_blocks(self, blocks: Sequence[KVBlock]) -> None:
        """Release one reference on each block of a block table (given in table order).

        Blocks that become free go to the tail in reverse table order, so a sequence's last
        blocks are evicted before its first ones; uncached blocks go to the head.
        """
        for block in reversed(blocks):
            block.ref_count -= 1
            assert block.ref_count >= 0, f"block {block.block_id} freed twice"
            if block.ref_count == 0:
                if block.block_hash is None:
                    self.free_queue.appendleft(block)
                else:
                    self.free_queue.append(block)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash; refused (False) while any block is in use."""
        if self.num_used_blocks > 0:
            return False
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()
        return True
