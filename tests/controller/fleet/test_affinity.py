"""Prefix affinity across controllers: the routing key and the home controller
(controller/fleet/affinity.py)."""

from __future__ import annotations

import random
from collections import Counter

from controller.fleet.affinity import KEY_BLOCK, LOAD_SLACK, home_of, load_bound, routing_key

CONTROLLERS = [f"10.0.0.{i}:8000" for i in range(1, 5)]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(length)]


def idle(controllers) -> dict[str, int]:
    return dict.fromkeys(controllers, 0)


def test_key_is_the_leading_tokens_only():
    shared = prompt(1, 300)
    a = routing_key(shared + prompt(2, 40), 256)
    b = routing_key(shared + prompt(3, 700), 256)
    assert a == b  # a group sharing more than key_tokens shares the key
    assert routing_key(shared, 256) == a
    assert routing_key(prompt(4, 300), 256) != a
    # The template's first block alone does not make a key shared by every chat.
    assert routing_key(shared[:16] + prompt(5, 300), 256) != a


def test_short_prompts_key_their_whole_blocks():
    p = prompt(6, 100)  # 6 whole blocks and 4 tokens
    assert routing_key(p, 256) == routing_key(p[: 6 * KEY_BLOCK], 256)
    assert routing_key(p, 256) != routing_key(p[: 5 * KEY_BLOCK], 256)
    assert routing_key(p[: KEY_BLOCK - 1], 256) is None  # under one block: served locally
    assert routing_key([], 256) is None


def test_home_is_deterministic_and_independent_of_order():
    key = routing_key(prompt(7, 256), 256)
    assert key is not None
    reversed_loads = dict(reversed(list(idle(CONTROLLERS).items())))
    homes = {home_of(key, idle(CONTROLLERS), 1.25), home_of(key, reversed_loads, 1.25)}
    assert len(homes) == 1


def test_distinct_prefixes_balance_over_controllers():
    keys = [routing_key(prompt(i, 256), 256) for i in range(4000)]
    counts = Counter(home_of(k, idle(CONTROLLERS), 1.25) for k in keys)
    assert set(counts) == set(CONTROLLERS)
    assert max(counts.values()) <= 1.1 * 4000 / 4  # within 10 % of even


def test_a_hot_prefix_is_bounded_by_load():
    """Every request shares one key; none finishes: no controller holds more than the load
    factor times the mean plus the slack (the key's first ones fill to the bound, the last
    takes the rest)."""
    key = routing_key(prompt(8, 256), 256)
    loads = idle(CONTROLLERS)
    for _ in range(400):
        home = home_of(key, loads, 1.25)
        assert loads[home] + 1 <= load_bound(loads, 1.25)
        loads[home] += 1
    assert max(loads.values()) <= 1.25 * 400 / 4 + LOAD_SLACK + 1  # none past the bound
    assert min(loads.values()) > 0  # the overflow spread to the last in the key's order
    # The key's first controller is the one that took the most.
    first = home_of(key, idle(CONTROLLERS), 1.25)
    assert loads[first] == max(loads.values())


def test_a_joining_controller_moves_about_one_key_in_n():
    keys = [routing_key(prompt(i, 256), 256) for i in range(3000)]
    before = {k: home_of(k, idle(CONTROLLERS[:3]), 1.25) for k in keys}
    after = {k: home_of(k, idle(CONTROLLERS), 1.25) for k in keys}
    moved = [k for k in keys if before[k] != after[k]]
    assert all(after[k] == CONTROLLERS[3] for k in moved)  # only to the newcomer
    assert 0.2 * len(keys) <= len(moved) <= 0.3 * len(keys)  # about 1/4


def test_a_few_requests_in_flight_stay_home():
    """Below the slack a cold key is never sent away by the noise of a few requests."""
    key = routing_key(prompt(10, 256), 256)
    first = home_of(key, idle(CONTROLLERS[:2]), 1.25)
    other = next(c for c in CONTROLLERS[:2] if c != first)
    assert home_of(key, {first: 6, other: 2}, 1.25) == first
    assert home_of(key, {first: 20, other: 2}, 1.25) == other


def test_the_least_loaded_always_has_room():
    rng = random.Random(9)
    for _ in range(500):
        loads = {c: rng.randrange(40) for c in CONTROLLERS[: rng.randrange(1, 5)]}
        home = home_of(routing_key(prompt(rng.randrange(99), 64), 256), loads, 1.0)
        assert loads[home] + 1 <= load_bound(loads, 1.0)
