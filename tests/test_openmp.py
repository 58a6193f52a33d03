"""``engine.openmp``: a thread's OpenMP team is released, so idle threads hold no workers that
would make libgomp throttle the busy thread's team."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch

from engine.openmp import _pause, release_thread_team


def _threads() -> int:
    return len(os.listdir("/proc/self/task"))


@pytest.mark.skipif(_pause() is None or not os.path.isdir("/proc/self/task"), reason="needs libgomp on Linux")
def test_release_frees_the_calling_threads_team() -> None:
    counts: list[int] = []

    def work() -> None:
        torch.set_num_threads(2)
        a = torch.randn(512, 512)
        for _ in range(3):
            a = torch.tanh(a @ a)  # parallel regions: this thread gets a team of 2
        counts.append(_threads())
        release_thread_team()
        deadline = time.monotonic() + 5
        while _threads() >= counts[0] and time.monotonic() < deadline:
            time.sleep(0.01)  # the team's worker exits on its own thread
        counts.append(_threads())
        a = torch.tanh(a @ a)  # a released thread still computes: it starts a new team
        assert torch.isfinite(a).all()

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert counts[1] < counts[0], counts
