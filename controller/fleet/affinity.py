"""Which controller is a request's home: the one whose executors most likely cache its prompt's
prefix (prefix affinity across controllers; controller/api/forwarding.py sends it there).

The key is a digest of the prompt's leading tokens: the first `key_tokens` of them, or, for a
shorter prompt, its whole `KEY_BLOCK`-token blocks (a prompt under one block has no key: it is
served where it was received, as caching it would save little). A fixed-length key keeps the
turns of one conversation, and the requests of a group that share a long prefix, on one key;
taking many tokens (256 by default) keeps requests that share only a chat template's first
block or a short system prompt on different keys.

The home is chosen by rendezvous hashing of the key over the live controllers (the same live set
that divides the executors, peers.py), so every controller picks the same home for a key with no
coordination, and a controller joining or leaving moves only the keys it ranks first (about
1/N of them). A hot key (one long system prompt shared by many clients) would send all its
traffic to one controller, so the choice is bounded by load (consistent hashing with bounded
loads, Mirrokni et al. 2018): a controller whose load (requests in flight) would exceed
`load_factor` times the mean, plus a slack of LOAD_SLACK requests, is passed over for the next
one in the key's order. The hot key
then spreads over the controllers in a fixed order and is cached on each that takes it.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Mapping, Sequence

from controller.fleet.division import rendezvous_order

KEY_BLOCK = 16  # tokens per block of a short prompt's key (the common KV block size)
# Requests a controller may hold beyond load_factor x the mean: at low load a few more on the
# home cost nothing, where without this slack the noise of a handful of requests in flight
# (8 over 2 controllers: 5 on one half the time) sent cold keys away from their home and lost
# their cache hits (benchmarks/README.md, "Prefix affinity across controllers").
LOAD_SLACK = 4


def routing_key(tokens: Sequence[int], key_tokens: int) -> str | None:
    """The routing key of a prompt: a digest of its first `key_tokens` tokens, or of its whole
    KEY_BLOCK-token blocks when it is shorter; None under one block."""
    length = min(key_tokens, len(tokens) - len(tokens) % KEY_BLOCK)
    if length <= 0:
        return None
    text = ",".join(map(str, tokens[:length]))
    return hashlib.blake2b(text.encode("ascii"), digest_size=12).hexdigest()


def load_bound(loads: Mapping[str, int], load_factor: float) -> int:
    """The most requests in flight a controller may hold and still take a new one: the mean
    load with the new request counted, times `load_factor`, plus LOAD_SLACK, rounded up."""
    total = sum(loads.values()) + 1
    return math.ceil(load_factor * total / max(len(loads), 1) + LOAD_SLACK)


def home_of(key: str, loads: Mapping[str, int], load_factor: float) -> str:
    """The key's home among the live controllers (the keys of `loads`, each with its requests
    in flight): the first of the key's rendezvous order whose load is under the bound. One
    always is (the least loaded is at most the mean)."""
    bound = load_bound(loads, load_factor)
    order = rendezvous_order(key, loads)
    for controller in order:
        if loads[controller] + 1 <= bound:
            return controller
    return min(order, key=lambda c: loads[c])  # unreachable for load_factor >= 1
