"""The Piper workers' queue (``modalities.tts.piece_queue``) with a made-up clock and latents:
which request's audio is made next, how long its segments are, fronts ahead, dropped requests."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import numpy as np
import pytest

from modalities.tts.piece_queue import END, MIN_FRAMES, Item, PieceJob, PieceQueue

FRAME_S = 256 / 22050


@pytest.fixture()
def loop() -> Iterator[asyncio.AbstractEventLoop]:
    loop = asyncio.new_event_loop()
    yield loop
    loop.close()


def _job(loop: asyncio.AbstractEventLoop, seq: int, arrival: float, pieces: int = 2, priority: int = 0) -> PieceJob:
    return PieceJob(seq, [f"piece {i}" for i in range(pieces)], 1.0, priority, 24, loop, arrival)


def _z(frames: int) -> np.ndarray:
    return np.zeros((1, 2, frames), np.float32)


def _take(q: PieceQueue, now: float) -> Item:
    item = q.take(now)
    assert item is not None
    return item


def _front(q: PieceQueue, now: float, frames: int = 200, audio_s: float | None = None) -> Item:
    """Take the next item (a front), give it one sentence of ``frames`` latents and finish it."""
    item = _take(q, now)
    assert item.front
    decoded = q.fronted(item, [_z(frames)])
    q.finish(item, decoded * FRAME_S if audio_s is None else audio_s, now)
    return item


def test_a_new_request_goes_before_the_later_audio_of_one_with_audio(loop: asyncio.AbstractEventLoop) -> None:
    q = PieceQueue(FRAME_S)
    a = _job(loop, 0, arrival=0.0)
    q.add(a)
    first = _front(q, 0.1)
    assert (first.piece, first.segment, first.stop) == (0, 0, 24) and a.cursor == (0, 0, 24)
    assert a.started == 0.1 and q.first_pending() == 0
    b = _job(loop, 1, arrival=0.2)
    q.add(b)
    assert q.first_pending() == 1
    assert _take(q, 0.25).job is b  # a runs dry at 0.1 + 24 frames (0.38 s); b waits since 0.2
    item = _take(q, 0.3)  # a's next audio: under 0.1 s in hand, so a segment of MIN_FRAMES
    assert (item.job, item.front, item.segment, item.start, item.stop) == (a, False, 1, 24, 24 + MIN_FRAMES)


def test_a_live_turn_goes_first_and_then_the_request_about_to_run_dry(loop: asyncio.AbstractEventLoop) -> None:
    q = PieceQueue(FRAME_S)
    early, live = _job(loop, 0, arrival=0.0), _job(loop, 1, arrival=0.5, priority=-1)
    q.add(early)
    q.add(live)
    assert _front(q, 0.6, audio_s=2.0).job is live
    assert _front(q, 0.7, audio_s=3.0).job is early  # early now runs dry at 3.7, live at 2.6
    assert _take(q, 0.8).job is live


def test_under_overload_a_new_request_gets_its_first_audio_before_the_backlog(
    loop: asyncio.AbstractEventLoop,
) -> None:
    """Streams far behind (their deadlines long past) do not hold back a new request's first
    chunk: earliest deadline first alone would make it wait for the whole backlog."""
    q = PieceQueue(FRAME_S)
    behind = _job(loop, 0, arrival=0.0)
    q.add(behind)
    _front(q, 0.0, audio_s=0.28)  # then nothing more of it was made: at 10 s it is 9.7 s behind
    new = _job(loop, 1, arrival=9.9)
    q.add(new)
    assert _take(q, 10.0).job is new
    assert _take(q, 10.0).job is behind  # (and then the backlog)


def test_streams_far_behind_go_least_made_first(loop: asyncio.AbstractEventLoop) -> None:
    """Among streams more than ``LATE_S`` behind, the one with the least audio made goes first (a
    short request is not held until the oldest stream catches up); one barely behind waits."""
    q = PieceQueue(FRAME_S)
    old, young, barely = _job(loop, 0, arrival=0.0), _job(loop, 1, arrival=4.0), _job(loop, 2, arrival=9.0)
    for job, now, made in ((old, 0.0, 5.0), (young, 4.0, 1.5), (barely, 9.0, 0.9)):
        q.add(job)
        _front(q, now, audio_s=made)
    # At 10 s: old ran dry at 5.0 (5 s behind), young at 5.5 (4.5 s), barely runs dry at 9.9.
    taken = [_take(q, 10.0).job for _ in range(8)]  # (no item finishes: young's in synthesis count)
    assert taken[:2] == [young, young] and old in taken and barely not in taken[: taken.index(old)]


def test_a_live_turn_short_of_audio_goes_before_a_new_request(loop: asyncio.AbstractEventLoop) -> None:
    """A live voice reply with under ``LIVE_HORIZON_S`` in hand goes before another request's
    first chunk; with more in hand, after it."""
    from modalities.tts.piece_queue import LIVE_HORIZON_S

    q = PieceQueue(FRAME_S)
    live = _job(loop, 0, arrival=0.0, priority=-1)
    q.add(live)
    _front(q, 0.0, audio_s=LIVE_HORIZON_S + 0.5)
    other = _job(loop, 1, arrival=0.1)
    q.add(other)
    assert _take(q, 0.2).job is other  # (live has 1.3 s in hand)
    assert _take(q, 0.6).job is live  # (0.9 s)


def test_segments_grow_with_the_audio_in_hand_and_end_with_the_sentence(loop: asyncio.AbstractEventLoop) -> None:
    q = PieceQueue(FRAME_S)
    a = _job(loop, 0, arrival=0.0, pieces=1)
    q.add(a)
    _front(q, 0.0, frames=400)
    item = _take(q, 0.0)
    assert (item.start, item.stop) == (24, 24 + 48)  # twice the 24 frames in hand
    q.finish(item, 1.0, 0.1)  # 1.28 s made by 0.1: about 1.2 s in hand
    item = _take(q, 0.1)
    assert item.start == 72 and item.stop - item.start == int(2 * (24 * FRAME_S + 1.0 - 0.1) / FRAME_S)
    q.finish(item, (item.stop - item.start) * FRAME_S, 0.2)
    item = _take(q, 0.2)  # the rest: what is left of the sentence, not a sliver after it
    assert item.stop == 400 and a.exhausted
    q.finish(item, 1.0, 0.3)
    assert q.take(0.3) is None and q.jobs == []


def test_a_lone_request_fronts_ahead_and_decodes_on_several_workers(loop: asyncio.AbstractEventLoop) -> None:
    q = PieceQueue(FRAME_S)
    a = _job(loop, 0, arrival=0.0, pieces=3)
    q.add(a)
    head = _take(q, 0.0)
    assert q.take(0.0) is None  # nothing beside its first segment
    assert q.fronted(head, [_z(100)]) == 24
    assert q.take(0.0) is None  # not even the rest of the piece, whose latents are there now
    q.finish(head, 24 * FRAME_S, 0.1)
    one, two = _take(q, 0.1), _take(q, 0.1)  # two workers decode consecutive stretches at once
    assert (one.segment, one.start, one.stop) == (1, 24, 72) and (two.segment, two.start, two.stop) == (2, 72, 100)
    three, ahead = _take(q, 0.1), _take(q, 0.1)  # piece 1's front with its first audio; piece 2's ahead
    assert (three.piece, three.front, three.segment) == (1, True, 3)
    assert (ahead.piece, ahead.front, ahead.segment) == (2, True, None)
    assert q.take(0.1) is None and a.exhausted is False
    assert q.fronted(ahead, [_z(60)]) == 0
    assert q.fronted(three, [_z(90), _z(60)]) == 90  # twice the audio in hand: the whole sentence
    four = _take(q, 0.2)
    assert (four.piece, four.sentence, four.start, four.stop, four.front) == (1, 1, 0, 60, False)


def _short_first_piece(q: PieceQueue, job: PieceJob) -> tuple[Item, Item]:
    """Make ``job``'s short first piece (one segment), then take its next piece's front (with
    audio) and the front of the piece after (ahead)."""
    head = _take(q, 0.0)
    assert q.fronted(head, [_z(30)]) == 30  # short: the whole sentence at once
    q.finish(head, 30 * FRAME_S, 0.1)
    assert job.cursor == (1, 0, 0)
    front, ahead = _take(q, 0.1), _take(q, 0.1)
    assert (front.piece, front.segment, ahead.piece, ahead.segment) == (1, 1, 2, None)
    return front, ahead


def test_a_piece_with_nothing_to_say_is_skipped(loop: asyncio.AbstractEventLoop) -> None:
    q = PieceQueue(FRAME_S)
    a = _job(loop, 0, arrival=0.0, pieces=4)
    q.add(a)
    front, ahead = _short_first_piece(q, a)
    q.fronted(ahead, [])  # piece 2: no phonemes
    q.finish(ahead, 0.0, 0.15)
    q.fronted(front, [_z(30)])
    q.finish(front, 30 * FRAME_S, 0.2)
    assert a.cursor == (3, 0, 0)
    nxt = _take(q, 0.2)
    assert (nxt.piece, nxt.front, nxt.segment) == (3, True, 2)


def test_a_piece_with_nothing_to_say_fronted_after_the_cursor_got_there_ends_the_request(
    loop: asyncio.AbstractEventLoop,
) -> None:
    q = PieceQueue(FRAME_S)
    a = _job(loop, 0, arrival=0.0, pieces=3)
    q.add(a)
    front, ahead = _short_first_piece(q, a)
    q.fronted(front, [_z(30)])
    q.finish(front, 30 * FRAME_S, 0.2)
    assert a.cursor == (2, 0, 0) and not a.exhausted and q.take(0.2) is None  # piece 2's front runs
    q.fronted(ahead, [])
    q.finish(ahead, 0.0, 0.3)
    assert a.exhausted and q.jobs == []


def test_an_uncut_voice_speaks_whole_pieces_in_order(loop: asyncio.AbstractEventLoop) -> None:
    q = PieceQueue(FRAME_S, whole_pieces=True)
    a = _job(loop, 0, arrival=0.0, pieces=2)
    q.add(a)
    head = _take(q, 0.0)
    assert q.take(0.0) is None  # no front ahead: a front is the piece's audio
    assert q.fronted(head, []) == 0 and a.cursor == (1, 0, 0)
    q.finish(head, 1.0, 0.5)
    last = _take(q, 0.5)
    assert (last.piece, last.front, last.segment) == (1, True, 1)
    q.fronted(last, [])
    assert a.exhausted


def test_a_dropped_request_leaves_nothing_queued(loop: asyncio.AbstractEventLoop) -> None:
    q = PieceQueue(FRAME_S)
    a, b = _job(loop, 0, 0.0, pieces=4), _job(loop, 1, 0.1)
    q.add(a)
    q.add(b)
    running = _take(q, 0.2)
    assert running.job is a
    q.drop(a)
    q.drop(b)
    assert q.queued() == 0 and q.first_pending() == 0 and q.jobs == [a]  # a's front still runs
    q.fronted(running, [_z(100)])
    q.finish(running, 0.28, 0.3)
    assert q.jobs == [] and q.take(0.4) is None


def test_deliver_emits_in_segment_order_then_the_end(loop: asyncio.AbstractEventLoop) -> None:
    job = _job(loop, 0, 0.0)
    job.segments, job.exhausted = 3, True
    for segment in (2, 0, 1):
        job.deliver(segment, np.full(2, float(segment), np.float32))
    out = [job.queue.get_nowait() for _ in range(4)]
    assert out[-1] is END and [a.tolist() for a in out[:-1]] == [[0.0] * 2, [1.0] * 2, [2.0] * 2]
