"""Writes take turns in arrival order; a large add is cut into chunks of bounded size."""

from __future__ import annotations

import contextlib
import sys
import threading
from collections.abc import Iterator

from inferscale.server.memory.write_queue import FairLock, UserLocks, chunks


@contextlib.contextmanager
def switches_only_where_a_thread_blocks() -> Iterator[None]:
    """No time slicing: the running thread keeps the GIL until it blocks. A thread started here
    runs until it waits for the lock (so it has asked before ``start()`` returns), and a thread
    that lets go asks again before a waiter it woke can run: the order seen is the lock's, not
    the scheduler's, and a lock that lets the thread letting go take it again shows it every time."""
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1000.0)
    try:
        yield
    finally:
        sys.setswitchinterval(interval)


def test_the_lock_is_handed_over_in_the_order_it_was_asked_for():
    """Five threads, each taking the lock 50 times: every turn goes to the thread that asked first,
    so they take it in the order they started, round after round."""
    lock, order = FairLock(), []

    def turns(i: int) -> None:
        for _ in range(50):
            with lock:
                order.append(i)

    with switches_only_where_a_thread_blocks():
        lock.__enter__()  # held: the others queue up as they start
        waiters = [threading.Thread(target=turns, args=(i,)) for i in range(5)]
        for thread in waiters:
            thread.start()
        lock.__exit__()
        for thread in waiters:
            thread.join(timeout=30)
    assert order == [0, 1, 2, 3, 4] * 50


def test_a_thread_that_lets_go_does_not_take_the_lock_again_before_a_waiter():
    """Twenty times over: a thread lets go of the lock with a waiter queued and asks again at once."""
    lock, taken = FairLock(), []
    with switches_only_where_a_thread_blocks():
        for _ in range(20):
            lock.__enter__()
            waiter = threading.Thread(target=lambda: (lock.__enter__(), taken.append("waiter"), lock.__exit__()))
            waiter.start()  # and is waiting
            lock.__exit__()
            with lock:
                taken.append("again")
            waiter.join(timeout=5)
    assert taken == ["waiter", "again"] * 20


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
