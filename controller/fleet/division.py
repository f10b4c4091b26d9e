"""How live controllers divide the executors between them: rendezvous hashing with a load
bound, and which peers count as live.

Every controller computes the same division from the same inputs (the executor addresses it
discovered and the live controllers' advertised addresses), with no coordination: each
executor ranks the controllers by a hash of (controller, executor), highest first (rendezvous,
or highest-random-weight, hashing), and goes to the first controller in its ranking that still
has room: each controller takes floor(executors / controllers), and the remainder go one each
to the first controllers that reach that. Executors are taken in an order fixed by their own
hash, so the result is deterministic. The bound makes the split as even as it can be (a plain
rendezvous split of four executors over two controllers is 3/1 or 4/0 five times in eight);
without it the ranking alone moves only the executors of a controller that left or those a
joining one ranks first, and the bound adds some moves to that (16 % more on average over the
grid of tests/controller/fleet/test_division.py).

Liveness is judged by the caller's clock: a peer is live while its last good answer is at most
`window` seconds old, so one lost probe does not move executors. The controller itself is
always live in its own view.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass


def _score(controller: str, executor: str) -> int:
    """The weight of `controller` for `executor`: 64 uniform bits from both names."""
    digest = hashlib.blake2b(f"{controller}\0{executor}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big")


def rendezvous_order(executor: str, controllers: Iterable[str]) -> list[str]:
    """The controllers ranked for `executor`, highest weight first (ties by name)."""
    return sorted(controllers, key=lambda c: (-_score(c, executor), c))


def divide(executors: Iterable[str], controllers: Iterable[str]) -> dict[str, str]:
    """executor -> its controller: each executor to the first controller of its rendezvous
    order with room (every controller ends with floor or ceil of executors / controllers).
    Empty without controllers."""
    members = sorted(set(controllers))
    ordered = sorted(set(executors), key=lambda e: (_score("", e), e))
    if not members:
        return {}
    base, extra = divmod(len(ordered), len(members))  # each gets base, `extra` get one more
    load = dict.fromkeys(members, 0)
    chosen: dict[str, str] = {}
    for executor in ordered:
        for controller in rendezvous_order(executor, members):
            if load[controller] < base or (load[controller] == base and extra > 0):
                extra -= load[controller] == base
                chosen[executor] = controller
                load[controller] += 1
                break
    return chosen


@dataclass
class PeerAnswer:
    """The last good answer of one peer, as found at one probe address."""

    key: str  # the address the peer advertises: its name in the division
    owner: str  # its owner id (executors know it by this)
    at: float  # when it answered (the caller's clock)
    load: int = 0  # the requests it had in flight then (prefix affinity's load bound)


class PeerTable:
    """The peers' last good answers, and which of them are live now."""

    def __init__(self, self_key: str, window: float):
        self.self_key = self_key  # this controller's advertised address
        self.window = window  # seconds after its last good answer that a peer stays live
        self.answers: dict[str, PeerAnswer] = {}  # probe address -> its last good answer

    def answered(self, found_at: str, key: str, owner: str, now: float, load: int = 0) -> None:
        """The peer at probe address `found_at` answered: it advertises `key` and has `load`
        requests in flight."""
        self.answers[found_at] = PeerAnswer(key, owner, now, load)

    def forget(self, keep: Iterable[str]) -> None:
        """Drop the answers of probe addresses not in `keep` (they left discovery)."""
        kept = set(keep)
        for found_at in [a for a in self.answers if a not in kept]:
            del self.answers[found_at]

    def live(self, now: float) -> list[str]:
        """The live controllers' keys, this one's included, sorted."""
        keys = {self.self_key}
        for answer in self.answers.values():
            if now - answer.at <= self.window:
                keys.add(answer.key)
        return sorted(keys)

    def loads(self, now: float) -> dict[str, int]:
        """The live peers' keys (not this controller's) with the load of their latest answer."""
        latest: dict[str, PeerAnswer] = {}
        for answer in self.answers.values():
            if now - answer.at <= self.window and answer.key != self.self_key:
                if answer.key not in latest or answer.at > latest[answer.key].at:
                    latest[answer.key] = answer
        return {key: answer.load for key, answer in latest.items()}

    def owner_of(self, key: str) -> str:
        """The owner id last heard from the controller advertising `key` ("" if unknown)."""
        found = [a for a in self.answers.values() if a.key == key]
        return max(found, key=lambda a: a.at).owner if found else ""
