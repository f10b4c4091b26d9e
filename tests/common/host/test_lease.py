"""The executor's session lease, on a fake clock: grant, refusal of another owner, same-owner
re-init, renewal, expiry, release, stale generations, ownerless sessions."""

from __future__ import annotations

import time

import pytest

from common.host.lease import DEFAULT_LEASE_SECONDS, LeaseHeld, LeaseLost, SessionLease


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> _Clock:
    return _Clock()


@pytest.fixture
def lease(clock) -> SessionLease:
    return SessionLease(max_seconds=30.0, clock=clock, start=0)


def test_grant_gives_generations_in_order_and_bounds_the_lease(lease):
    first = lease.grant("a", 10.0)
    assert (first.generation, first.lease_seconds) == (1, 10.0)
    again = lease.grant("a", 500.0)  # the same owner reconnects: a new session
    assert (again.generation, again.lease_seconds) == (2, 30.0)  # bounded by the executor
    assert lease.grant("a", 0.0).lease_seconds == DEFAULT_LEASE_SECONDS
    assert lease.grant("a", 0.01).lease_seconds == 1.0


def test_another_owner_is_refused_while_the_lease_lives(lease, clock):
    lease.grant("a", 10.0)
    clock.now += 4.0
    with pytest.raises(LeaseHeld) as exc:
        lease.grant("b", 10.0)
    assert exc.value.owner == "a"
    assert exc.value.seconds_left == pytest.approx(6.0)
    assert "'a'" in str(exc.value) and "6.0s" in str(exc.value)
    assert not exc.value.repeated
    with pytest.raises(LeaseHeld) as again:  # logged quieter: it retries every few seconds
        lease.grant("b", 10.0)
    assert again.value.repeated
    assert lease.state() == (1, "a", pytest.approx(6.0))


def test_renewal_keeps_the_lease_and_expiry_lets_the_next_owner_in(lease, clock):
    gen = lease.grant("a", 10.0).generation
    for _ in range(5):
        clock.now += 9.0
        assert lease.renew("a", gen) == 10.0
    with pytest.raises(LeaseHeld):
        lease.grant("b", 10.0)
    clock.now += 10.0  # no renewal: expired
    assert lease.seconds_left() == 0.0
    taken = lease.grant("b", 10.0)
    assert taken.generation == gen + 1
    with pytest.raises(LeaseLost, match="stale"):  # the old owner is fenced
        lease.renew("a", gen)
    assert lease.stale(gen)
    assert lease.stale(taken.generation) == ""


def test_a_late_renewal_still_succeeds_while_no_one_took_over(lease, clock):
    gen = lease.grant("a", 10.0).generation
    clock.now += 25.0
    assert lease.renew("a", gen) == 10.0
    with pytest.raises(LeaseHeld):
        lease.grant("b", 10.0)


def test_release_lets_the_next_owner_in_at_once_and_fences_the_released(lease):
    gen = lease.grant("a", 10.0).generation
    with pytest.raises(LeaseLost):  # only the owner may release
        lease.release("b", gen)
    lease.release("a", gen)
    assert lease.seconds_left() == 0.0
    assert lease.stale(gen)
    with pytest.raises(LeaseLost):
        lease.session_of(gen)
    assert lease.grant("b", 10.0).generation == gen + 2


def test_generations_start_from_the_process_start_in_milliseconds():
    """A restart takes seconds: the new process starts past every generation the one before
    granted (fewer than one per millisecond)."""
    before = time.time_ns() // 1_000_000
    lease = SessionLease()
    assert before <= lease.generation <= time.time_ns() // 1_000_000
    assert lease.grant("a", 10.0).generation == lease.generation


def test_calls_name_their_session(lease):
    assert lease.session_of(None) == 0  # no session yet: ownerless
    gen = lease.grant("a", 10.0).generation
    assert lease.session_of(gen) == gen
    with pytest.raises(LeaseLost, match="stale"):
        lease.session_of(gen - 1)
    with pytest.raises(LeaseLost, match="must carry"):  # owned: a call without one is refused
        lease.session_of(None)


def test_ownerless_sessions_replace_each_other_but_not_a_live_owner(lease, clock):
    first = lease.grant("", 10.0)
    assert first.lease_seconds == 0.0
    assert lease.session_of(None) == first.generation
    assert lease.grant("", 0.0).generation == first.generation + 1  # as before owners
    owned = lease.grant("a", 10.0)  # a named owner takes an ownerless executor
    with pytest.raises(LeaseHeld):
        lease.grant("", 0.0)
    clock.now += 11.0
    assert lease.grant("", 0.0).generation == owned.generation + 1


def test_a_call_in_progress_holds_the_lease(lease, clock):
    gen = lease.grant("a", 10.0).generation
    with lease.hold(gen):
        clock.now += 300.0  # a long warm-up
        with pytest.raises(LeaseHeld):
            lease.grant("b", 10.0)
    clock.now += 9.0  # the lease restarted when the call ended
    with pytest.raises(LeaseHeld):
        lease.grant("b", 10.0)
    clock.now += 2.0
    assert lease.grant("b", 10.0).generation == gen + 1
    with lease.hold(gen):  # a stale call holds nothing
        clock.now += 11.0
    assert lease.grant("c", 10.0).generation == gen + 2
