"""``engine.admission.Admission``: the bound on requests held, refusing only refusable ones, and
the ``Retry-After`` it advises."""

from __future__ import annotations

from typing import Any

import pytest

from engine.admission import MAX_RETRY_AFTER_S, Admission, HeldBoundError


def _refusal(adm: Admission) -> HeldBoundError:
    with pytest.raises(HeldBoundError) as info:
        with adm.hold(True):
            pass
    return info.value


def test_refusable_requests_are_refused_at_the_bound_others_count_and_pass() -> None:
    adm = Admission(limit=2)
    with adm.hold(True), adm.hold(False):
        assert adm.active == 2
        assert "2 requests are already in progress" in str(_refusal(adm))
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


def test_reserve_counts_a_routes_work_before_hold_so_a_burst_is_refused_before_it() -> None:
    """``reserve`` (a route decoding an upload): refused where ``hold`` would be, counted by both
    while inside (of a burst arriving with room for 2, 2 do that work, the rest are refused
    before it), given back on leaving; a job's or a live turn's is never refused."""
    adm = Admission(limit=2, hold_s=3.4)
    places = [adm.reserve(True) for _ in range(5)]
    entered, refused = 0, []
    for place in places:
        try:
            place.__enter__()
            entered += 1
        except HeldBoundError as exc:
            refused.append(exc.retry_after_s)
    assert (entered, adm.reserved, adm.active) == (2, 2, 0) and refused == [4.0, 4.0, 8.0]
    assert "2 requests are already in progress" in str(_refusal(adm))  # (hold counts them too)
    with adm.reserve(False), adm.hold(False):  # counted, never refused
        assert (adm.reserved, adm.active) == (3, 1)
    for place in places[:entered]:
        place.__exit__(None, None, None)
    assert adm.reserved == 0
    with adm.hold(True), adm.hold(True):  # their places, now held
        assert adm.active == 2


def test_retry_after_sends_a_bursts_refused_clients_back_in_waves_of_the_bound() -> None:
    """Held requests last ~3.4 s: the first ``limit`` refused come back in 4 s, the next
    ``limit`` in 8 s, ... (all at 1 s, they came back together into a still-full bound)."""
    adm = Admission(limit=2, hold_s=3.4)
    with adm.hold(True), adm.hold(True):
        waits = [_refusal(adm).retry_after_s for _ in range(5)]
    assert waits == [4.0, 4.0, 8.0, 8.0, 12.0]
    assert 0 < adm.hold_s < 3.4  # (these two held for no time: the running mean fell)
    adm = Admission(limit=1, hold_s=50.0)
    with adm.hold(True):
        assert [_refusal(adm).retry_after_s for _ in range(2)] == [50.0, MAX_RETRY_AFTER_S]


def test_a_client_refused_again_goes_behind_those_told_to_come_back_and_the_queue_stays_small(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Clients told 4 s and 8 s; at 4 s the first come back into a still-full bound: told 8 s
    more (behind the 8 s wave), not 4 s again (with it). A flood of refusals keeps no more
    entries than a minute of waves; a job's long hold does not move the advice."""
    import engine.admission as admission

    now = [100.0]
    monkeypatch.setattr(admission.time, "monotonic", lambda: now[0])
    adm = Admission(limit=2, hold_s=3.4)
    with adm.hold(True), adm.hold(True):
        assert [_refusal(adm).retry_after_s for _ in range(4)] == [4.0, 4.0, 8.0, 8.0]
        now[0] += 4.0  # the first two come back: the two told 8 s are still ahead of them
        assert [_refusal(adm).retry_after_s for _ in range(2)] == [8.0, 8.0]
        for _ in range(10_000):
            _refusal(adm)
        assert len(adm._due) <= 2 * (MAX_RETRY_AFTER_S // 4 + 1)
        assert _refusal(adm).retry_after_s == MAX_RETRY_AFTER_S
    assert adm.hold_s == pytest.approx(3.616)  # the two held 4 s: 3.4 -> 3.52 -> 3.616
    with adm.hold(False):  # a job held for ten minutes says nothing of when a client finds room
        now[0] += 600.0
    assert adm.hold_s == pytest.approx(3.616)
    with adm.hold(True):  # a route's request held ten minutes counts as one minute
        now[0] += 600.0
    assert adm.hold_s == pytest.approx(3.616 + 0.2 * (60 - 3.616))


def test_the_bound_flags_take_0_for_none_and_refuse_a_negative(capsys: pytest.CaptureFixture[str]) -> None:
    from gateway.cli import build_parser
    from modalities.asr.engine import DEFAULT_MAX_REQUESTS as ASR_DEFAULT
    from modalities.tts.protocol import DEFAULT_MAX_REQUESTS as TTS_DEFAULT

    parser = build_parser()
    args = parser.parse_args(["serve", "--tts-max-requests", "0", "--asr-max-requests", "3"])
    assert (args.tts_max_requests, args.asr_max_requests) == (None, 3)
    defaults = parser.parse_args(["serve"])
    assert (defaults.tts_max_requests, defaults.asr_max_requests) == (TTS_DEFAULT, ASR_DEFAULT)
    for bad in ("-1", "many"):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--tts-max-requests", bad])
        assert "--tts-max-requests" in capsys.readouterr().err


def test_a_celery_gateway_names_the_worker_options_it_ignores_and_keeps_its_upload_limits() -> None:
    """Under ``--dispatch celery`` an engine's bound or size is the worker's: the gateway names
    those it was given (it logs them); the ASR upload limits are the gateway's, which reads the
    file: its proxy carries them (the routes read them off the engine; they were the defaults)."""
    from gateway.cli import build_parser
    from gateway.plugins import worker_options_given
    from modalities.asr.plugin import remote_engines

    argv = ["serve", "--dispatch", "celery", "--only", "asr,tts", "--tts-max-requests", "4", "--tts-workers", "2"]
    args = build_parser().parse_args([*argv, "--asr-max-num-seqs", "8", "--asr-max-file-mb", "100"])
    assert worker_options_given(args) == ["--asr-max-num-seqs", "--tts-max-requests"]
    assert worker_options_given(build_parser().parse_args(["serve", "--only", "llm", "--tts-workers", "3"])) == []
    llm = build_parser().parse_args(["serve", "--only", "llm", "--max-waiting", "8", "--max-model-len", "512"])
    assert worker_options_given(llm) == ["--max-waiting"]  # (the gateway reads the context length itself)
    (engine,) = remote_engines(args, cluster=None).engines.values()
    assert (engine.max_file_mb, engine.max_audio_s) == (100.0, args.asr_max_audio_s)


def test_a_speech_workers_threads_cover_its_bound_so_the_bound_refuses() -> None:
    """A Celery thread carries one call: with fewer threads than the bound, calls past them wait
    in the queue (a 503 after a minute) and the bound never refuses."""
    from gateway.cli import build_parser
    from workers.worker import default_concurrency

    parser = build_parser()

    def threads(*argv: str) -> int:
        return default_concurrency(parser.parse_args(["worker", *argv]))

    assert threads("--modality", "tts", "--tts-max-requests", "40") == 48
    assert threads("--modality", "asr", "--asr-max-requests", "4") == 16
    assert threads("--modality", "asr", "--asr-max-requests", "0") == 16  # (no bound)
    assert threads("--modality", "llm", "--max-num-seqs", "8") == 8
    assert threads("--modality", "diffusion") == 16


def test_held_counts_a_stream_while_read_and_closes_it_as_soon_as_the_reader_stops() -> None:
    """``Admission.held`` (the Piper voice's and Whisper's ``stream``): counted from the first
    item; closing it early closes the engine's stream at once (its ``finally`` drops its work),
    not when the garbage collector gets to it; a refused one never starts the stream."""
    import asyncio
    import gc

    adm = Admission(limit=1)
    events: list[str] = []

    async def items() -> Any:
        events.append("started")
        try:
            for i in range(10):
                yield i
        finally:
            events.append("closed")

    async def go() -> None:
        stream = adm.held(True, items())
        assert await anext(stream) == 0 and adm.active == 1
        with pytest.raises(HeldBoundError):
            await anext(adm.held(True, items()))
        assert events == ["started"]
        await stream.aclose()
        assert events == ["started", "closed"] and adm.active == 0

    gc.disable()
    try:
        asyncio.run(go())
    finally:
        gc.enable()
