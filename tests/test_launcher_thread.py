"""The launcher thread of a one-graph decode step (cuda/graphs.py): `start` returns once the job has begun,
jobs run on it one at a time, and a job's error reaches the thread that waits for it, which the next job does
not inherit."""

from __future__ import annotations

import threading

import pytest

from tandem.cuda.graphs import _Launcher


def test_jobs_run_on_the_thread_and_errors_reach_the_waiter() -> None:
    launcher = _Launcher()
    seen: list[tuple[int, str]] = []
    for i in range(3):
        launcher.start(lambda i=i: seen.append((i, threading.current_thread().name)))
        launcher.wait()
    assert seen == [(i, "tandem-launch") for i in range(3)]

    def fail() -> None:
        raise ValueError("launch failed")

    launcher.start(fail)
    with pytest.raises(ValueError, match="launch failed"):
        launcher.wait()
    launcher.start(lambda: seen.append((3, "after")))
    launcher.wait()  # the failure is not raised twice
    assert seen[-1] == (3, "after")


def test_start_returns_once_the_job_has_begun() -> None:
    launcher = _Launcher()
    began, release = threading.Event(), threading.Event()
    launcher.start(lambda: (began.set(), release.wait(10)))
    assert began.wait(5)  # the job is running (blocked), not merely queued
    release.set()
    launcher.wait()
