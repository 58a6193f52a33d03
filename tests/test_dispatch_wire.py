"""Errors and values crossing the Redis Stream between workers and the gateway (pure logic)."""

from __future__ import annotations

import numpy as np

from engine.errors import PromptTooLongError, QueueFullError
from gateway.errors import from_engine_error
from workers.wire import Keys, RemoteError, dump, dump_error, load, load_error


def test_engine_errors_rebuild_and_map_like_local_ones() -> None:
    full = load_error(dump_error(QueueFullError(7, 2.5)))
    assert isinstance(full, QueueFullError) and full.retry_after_s == 2.5
    assert str(full) == str(QueueFullError(7, 2.5))
    mapped = from_engine_error(full)
    assert mapped is not None and mapped.status_code == 429
    long = load_error(dump_error(PromptTooLongError(10, 5, 12)))
    assert isinstance(long, PromptTooLongError) and long.max_model_len == 12
    assert from_engine_error(long, param="prompt").status_code == 400  # type: ignore[union-attr]


def test_unpicklable_errors_degrade_to_remote_error() -> None:
    class Local(Exception):  # not importable by name: pickling the class fails
        pass

    err = load_error(dump_error(Local("boom")))
    assert isinstance(err, RemoteError) and "boom" in str(err)


def test_values_and_keys() -> None:
    arr = np.arange(6, dtype=np.float32).reshape(2, 3)
    np.testing.assert_array_equal(load(dump(arr)), arr)
    keys = Keys("p")
    assert (keys.worker("w"), keys.stream("c"), keys.abort("c"), keys.control("w")) == (
        "p:w:w", "p:s:c", "p:abort:c", "p:ctl:w",
    )  # fmt: skip
    assert keys.worker_pattern == "p:w:*"
