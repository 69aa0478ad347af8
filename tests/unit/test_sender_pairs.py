"""A sender's region pair is never handed out again once retired; retired names wait to be unregistered."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from app.backends import shm
from app.backends.regions import RETRY_S, Pair, SenderPairs
from tests.support import FakeClock


@pytest.fixture
def owner() -> Iterator[shm.Owner]:
    made = shm.Owner()
    yield made
    made.release()


def test_a_retired_pair_is_never_handed_out_again_and_its_files_go(owner: shm.Owner) -> None:
    clock = FakeClock()
    pairs = SenderPairs(clock=clock)

    def make(number: str) -> Pair:
        return Pair(owner.create(f"{number}_in", 64, 0o600), owner.create(f"{number}_out", 64, 0o600))

    first = pairs.current(make)
    assert pairs.current(make) is first, "one pair per thread, reused while nothing went wrong"
    first.registered = True
    pairs.retire(first)
    second = pairs.current(make)
    assert second is not first and set(second.names).isdisjoint(first.names)
    assert not (shm.SHM_DIR / first.input.name).exists() and not (shm.SHM_DIR / first.output.name).exists()

    clock.advance(RETRY_S)
    assert pairs.due() == list(first.names)
    pairs.still_registered([first.input.name])  # Triton refused: still in use
    assert pairs.due() == [], "not asked again before RETRY_S"
    clock.advance(RETRY_S)
    assert pairs.due() == [first.input.name]
    live, names = pairs.drain()
    assert live == [second] and names == []
    for pair in live:
        pair.input.close()
        pair.output.close()


def test_an_owner_is_alive_while_it_holds_its_lock_and_gone_after(owner: shm.Owner) -> None:
    region = owner.create("1_in", 64, 0o600)
    try:
        assert shm.owner_of(region.name) == owner.token
        assert shm.stale_names([region.name], missing_is_gone=True) == []
        other = shm.Owner()
        other_region = other.create("1_in", 64, 0o600)
        assert other._fd is not None
        os.close(other._fd)  # its lock goes, as when its process dies
        other._fd = None
        assert owner.token not in shm.dead_owners(), "a live owner holds its lock"
        shm.sweep_files()  # (another sweeper of this machine may have been first: either way it goes)
        assert not (shm.SHM_DIR / other_region.name).exists() and other.token not in shm.owners()
        assert (shm.SHM_DIR / region.name).exists()
    finally:
        region.close()
