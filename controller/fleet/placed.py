"""The requests placed on one executor, and the prompt blocks they announce there."""

from __future__ import annotations

import time
from collections import Counter
from typing import TYPE_CHECKING

from controller.core.request import RequestStatus

if TYPE_CHECKING:
    from controller.fleet.tracked import Tracked


class PlacedRequests(dict[str, "Tracked"]):
    """Requests placed on one executor and not finished, by request id (a dict: the step loop
    looks requests up at dict speed), with the block hashes of their sequences: blocks that
    will be cached there before any later request is admitted, so placement counts them as
    prefix hits already."""

    __slots__ = ("queued",)  # no instance __dict__: lookups stay at dict speed

    def __init__(self) -> None:
        super().__init__()
        self.queued: Counter[bytes] = Counter()  # block hash -> placed requests announcing it

    def place(self, tracked: Tracked, address: str) -> None:
        """Hold a request placed on the executor at `address`."""
        self[tracked.gen.request_id] = tracked
        tracked.placed_on = address
        tracked.placed_at = time.monotonic()
        self.queued.update(tracked.queued_hashes)

    def remove(self, tracked: Tracked) -> bool:
        """Let a request go (finished, withdrawn, moved); False if it was not here."""
        if self.pop(tracked.gen.request_id, None) is None:
            return False
        self.queued.subtract(tracked.queued_hashes)
        for block_hash in tracked.queued_hashes:
            if self.queued[block_hash] <= 0:
                del self.queued[block_hash]
        tracked.placed_on = None
        return True

    def queued_blocks(self, hashes: list[bytes], usable: int) -> int:
        """Leading blocks of a sequence (its block hashes, at most `usable`) announced here."""
        queued = 0
        for block_hash in hashes[:usable]:
            if block_hash not in self.queued:
                break
            queued += 1
        return queued

    def stale_waiting(self, placed_before: float) -> list[Tracked]:
        """Requests never admitted here that were placed before `placed_before` (monotonic)."""
        return [
            t
            for t in self.values()
            if t.request is not None
            and t.request.status is RequestStatus.WAITING
            and t.placed_at < placed_before
        ]

    def backlog(self, expected_output: float) -> tuple[int, int]:
        """(tokens not computed yet, output tokens still expected) of these requests; each
        one's expected output is capped at `expected_output`."""
        uncomputed = decode = 0
        cap = int(expected_output)
        waiting = RequestStatus.WAITING
        # Once per placement over every request here: the Request properties are inlined.
        for t in self.values():
            req = t.request
            if req is not None:
                done = req.num_computed_tokens
                if req.status is waiting and t.expected_hit > done:  # its hit will be reused
                    done = t.expected_hit
                num_output = len(req.output_token_ids)
                left = len(req.prompt_token_ids) + num_output - done
                if left > 0:
                    uncomputed += left
                left = req.max_tokens - num_output
                decode += left if left < cap else cap
        return uncomputed, decode
