"""One session per executor process, however many addresses reach it.

An executor process has an incarnation id (its `Identify` answer). The same process may be
found under two addresses (a static name and its DNS address); driving it from two sessions
would share one KV cache between two block pools. The first session to claim an incarnation
drives it; a claim by another address names the holder instead, and the other session waits
as a duplicate until the holder lets go.
"""

from __future__ import annotations

from collections.abc import Callable


class Incarnations:
    """Which address drives each executor process."""

    def __init__(self, is_live: Callable[[str], bool]):
        self._is_live = is_live  # whether a session at this address still exists
        self._drivers: dict[str, str] = {}  # incarnation id -> the address driving it
        self._claims: dict[str, str] = {}  # address -> the incarnation it drives

    def claim(self, address: str, incarnation: str) -> str:
        """The live address already driving `incarnation`, or "" once `address` holds it."""
        holder = self._drivers.get(incarnation, "")
        if holder and holder != address and self._is_live(holder):
            return holder
        self.release(address)
        self._drivers[incarnation] = address
        self._claims[address] = incarnation
        return ""

    def release(self, address: str) -> None:
        """`address` drives nothing any more."""
        incarnation = self._claims.pop(address, None)
        if incarnation is not None and self._drivers.get(incarnation) == address:
            del self._drivers[incarnation]
