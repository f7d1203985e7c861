"""Writes take turns in arrival order; a large add is cut into chunks of bounded size."""

from __future__ import annotations

import threading
import time

from inferscale.server.write_queue import FairLock, UserLocks, chunks


def test_the_lock_is_handed_over_in_the_order_it_was_asked_for():
    lock, order = FairLock(), []
    lock.__enter__()  # held: the others queue up
    waiters = []
    for i in range(5):
        waiters.append(threading.Thread(target=lambda i=i: (lock.__enter__(), order.append(i), lock.__exit__())))
        waiters[-1].start()
        time.sleep(0.05)  # asked in this order
    lock.__exit__()
    for thread in waiters:
        thread.join(timeout=5)
    assert order == [0, 1, 2, 3, 4]


def test_a_thread_that_lets_go_does_not_take_the_lock_again_before_a_waiter():
    lock, taken = FairLock(), []
    lock.__enter__()
    waiter = threading.Thread(target=lambda: (lock.__enter__(), taken.append("waiter"), lock.__exit__()))
    waiter.start()
    time.sleep(0.05)
    lock.__exit__()
    with lock:
        taken.append("again")
    waiter.join(timeout=5)
    assert taken == ["waiter", "again"]


def test_chunks_keep_order_and_bound_their_characters():
    facts = [("a" * 1500, None), ("b" * 1500, "t"), ("c" * 1500, None), ("d" * 9000, None), ("e", None)]
    runs = list(chunks(facts, max_chars=4000))
    assert [f for run in runs for f in run] == facts
    assert [len(run) for run in runs] == [2, 1, 1, 1]  # a fact longer than the bound goes alone
    assert all(sum(len(t) for t, _ in run) <= 4000 for run in runs if len(run) > 1)


def test_one_users_lock_is_dropped_when_no_write_holds_it():
    locks = UserLocks()
    with locks.hold("ann"), locks.hold("bob"):
        assert set(locks._held) == {"ann", "bob"}
    assert locks._held == {}
