"""The helper thread of a one-graph decode step (cuda/graphs.py): jobs run on it in order, one at a time; a
job submitted with `announce` lets the submitter wait for its start; a job's error reaches the thread that waits
for it, and the next job does not inherit it."""

from __future__ import annotations

import threading

import pytest

from tandem.cuda.graphs import _StepThread


def test_jobs_run_on_the_thread_and_errors_reach_the_waiter() -> None:
    worker = _StepThread()
    seen: list[tuple[int, str]] = []
    for i in range(3):
        worker.submit(lambda i=i: seen.append((i, threading.current_thread().name)))
        worker.wait()
    assert seen == [(i, "tandem-step") for i in range(3)]

    def fail() -> None:
        raise ValueError("host op failed")

    worker.submit(fail)
    with pytest.raises(ValueError, match="host op failed"):
        worker.wait()
    worker.submit(lambda: seen.append((3, "after")))
    worker.wait()  # the failure is not raised twice
    assert seen[-1] == (3, "after")


def test_an_announced_job_is_waited_for_until_it_starts() -> None:
    worker = _StepThread()
    release = threading.Event()
    started = []
    worker.submit(lambda: (started.append(True), release.wait(10)), announce=True)
    worker.wait_started()
    assert started == [True]  # the job has begun (it appended before blocking) ...
    release.set()
    worker.wait()  # ... and ends once released
