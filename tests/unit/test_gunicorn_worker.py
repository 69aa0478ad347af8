"""The balanced gthread worker's decisions (app/gunicorn_worker.py): which worker takes a new connection, when
a kept-alive one moves, and the master's slots. tests/integration/test_connection_spread.py runs it in gunicorn."""

from __future__ import annotations

from types import SimpleNamespace

from app.batching import triton_senders
from app.gunicorn_worker import DEFER_S, NOT_ACCEPTING, Spread, should_move, should_wait


def test_a_new_connection_waits_for_a_worker_holding_fewer_but_never_past_the_deferral() -> None:
    assert should_wait(mine=3, fewest_elsewhere=2, waited_s=0.0)
    assert not should_wait(mine=2, fewest_elsewhere=2, waited_s=0.0)  # a tie: whoever is awake takes it
    assert not should_wait(mine=3, fewest_elsewhere=None, waited_s=0.0)  # no other worker accepts
    assert not should_wait(mine=9, fewest_elsewhere=0, waited_s=DEFER_S)  # the other is hung or busy: take it


def test_a_kept_alive_connection_moves_only_when_another_worker_holds_two_fewer() -> None:
    assert should_move(mine=9, fewest_elsewhere=7)
    assert should_move(mine=16, fewest_elsewhere=0)
    assert not should_move(mine=9, fewest_elsewhere=8)  # moving it would only swap the counts
    assert not should_move(mine=5, fewest_elsewhere=None)
    # Clients already told to go count as arrived elsewhere: 9 / 7 moves one, 16 / 0 moves eight.
    assert not should_move(mine=9, fewest_elsewhere=7, leaving=1)
    assert should_move(mine=16, fewest_elsewhere=0, leaving=7)
    assert not should_move(mine=16, fewest_elsewhere=0, leaving=8)


def test_the_master_hands_out_free_slots_and_a_dead_workers_slot_counts_for_nobody() -> None:
    spread = Spread(3)
    workers = [SimpleNamespace() for _ in range(3)]
    for w in workers:
        spread.assign(w)
    assert [w.spread[1] for w in workers] == [0, 1, 2]
    assert spread.fewest_elsewhere(0) is None  # no worker's loop runs yet: nobody accepts
    spread.counts[0], spread.counts[1], spread.counts[2] = 5, 2, 7
    assert spread.fewest_elsewhere(0) == 2
    spread.release(workers[1])
    assert spread.counts[1] == NOT_ACCEPTING and spread.fewest_elsewhere(0) == 7
    late = SimpleNamespace()
    spread.assign(late)  # the freed slot is reused
    assert late.spread[1] == 1
    over = SimpleNamespace()
    spread.assign(over)  # more workers than slots: it runs, unbalanced
    assert not hasattr(over, "spread")


def test_the_workers_together_keep_one_triton_request_per_model_instance_in_flight() -> None:
    assert triton_senders(instances=2, workers=2) == 1
    assert triton_senders(instances=2, workers=1) == 2
    assert triton_senders(instances=2, workers=4) == 1
    assert triton_senders(instances=3, workers=2) == 2
