"""``engine.batch_loop``: a batch that kills the loop fails every request still pending, once each
(a request of several items included), and ``resolve`` completes futures from the loop's thread."""

from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field
from typing import Any

import pytest

from engine.batch_loop import BatchLoop, resolve
from engine.errors import EngineDeadError


@dataclass(eq=False)
class _Req:
    future: asyncio.Future[Any]
    loop: asyncio.AbstractEventLoop
    out: list[int] = field(default_factory=list)


@dataclass
class _Item:
    request: _Req
    value: int


class _Loop(BatchLoop):
    """Runs one item a batch; an item of value < 0 raises (a bug in the batch)."""

    _engine_label = "toy"

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._pending: list[_Item] = []
        self._stopping = False
        self._dead = None

    def _next_batch(self) -> list[_Item]:
        return [self._pending.pop(0)]

    def _run(self, batch: list[_Item]) -> None:
        (item,) = batch
        if item.value < 0:
            raise RuntimeError("bad batch")
        item.request.out.append(item.value)
        resolve(item.request, None)


def test_a_dead_loop_fails_every_pending_request_once() -> None:
    async def go() -> None:
        loop = asyncio.get_running_loop()
        engine = _Loop()
        ok, multi, single = (_Req(loop.create_future(), loop) for _ in range(3))
        engine._pending = [_Item(ok, 1), _Item(_Req(loop.create_future(), loop), -1)]
        engine._pending += [_Item(multi, 2), _Item(multi, 3), _Item(single, 4)]
        thread = threading.Thread(target=engine._serve_batches)
        thread.start()
        assert await asyncio.wait_for(ok.future, 10) == [1]
        for req in (multi, single):
            with pytest.raises(EngineDeadError, match="the toy engine died: RuntimeError"):
                await asyncio.wait_for(req.future, 10)
        thread.join(10)
        assert isinstance(engine.dead, RuntimeError) and engine._pending == []

    asyncio.run(go())


def test_resolve_after_the_loop_closed_is_a_no_op() -> None:
    loop = asyncio.new_event_loop()
    req = _Req(loop.create_future(), loop)
    loop.close()
    resolve(req, None)  # (no RuntimeError from a closed loop)
    assert not req.future.done()
