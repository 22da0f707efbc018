"""The thread that runs a one-graph decode step's host ops (cuda/graphs.py): jobs run in order, one at a
time, and a job's error reaches the thread that waits for it, which the next job does not inherit."""

from __future__ import annotations

import threading

import pytest

from tandem.cuda.graphs import _HostStepThread


def test_jobs_run_on_the_thread_and_errors_reach_the_waiter() -> None:
    worker = _HostStepThread()
    seen: list[tuple[int, str]] = []
    for i in range(3):
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        worker.wait()
    assert seen == [(i, "tandem-host-ops") for i in range(3)]

    def fail() -> None:
        raise ValueError("host op failed")

    worker.submit(fail)
    with pytest.raises(ValueError, match="host op failed"):
        worker.wait()
    worker.submit(lambda: seen.append((3, "after")))
    worker.wait()  # the failure is not raised twice
    assert seen[-1] == (3, "after")
