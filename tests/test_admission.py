"""``engine.admission.Admission``: the bound on requests held, refusing only refusable ones."""

from __future__ import annotations

import pytest

from engine.admission import Admission
from engine.errors import QueueFullError


def test_refusable_requests_are_refused_at_the_bound_others_count_and_pass() -> None:
    adm = Admission(limit=2, retry_after_s=3.0)
    with adm.hold(True), adm.hold(False):
        assert adm.active == 2
        with pytest.raises(QueueFullError) as info:
            with adm.hold(True):
                pass
        assert info.value.retry_after_s == 3.0 and "2 requests" in str(info.value)
        with adm.hold(False):  # a job's or a live turn's: waits its turn instead
            assert adm.active == 3
    assert adm.active == 0
    with adm.hold(True):  # room again
        assert adm.active == 1


def test_a_request_that_fails_inside_is_released_and_no_bound_refuses_nothing() -> None:
    adm = Admission(limit=1)
    with pytest.raises(RuntimeError), adm.hold(True):
        raise RuntimeError("synthesis failed")
    assert adm.active == 0
    unbounded = Admission()
    with unbounded.hold(True), unbounded.hold(True):
        assert unbounded.active == 2
