"""Piper's phonemiser out of process (``modalities.tts.phonemizer``): the child gives Piper's own
phonemes, and a text that crashes eSpeak NG (a known upstream overflow) or hangs it fails alone
while the process and the next texts carry on."""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from modalities.tts.phonemizer import Phonemizer, PhonemizerError
from modalities.tts.piper_engine import default_voice_path
from modalities.tts.protocol import TTSInputError

CRASHES = "s'" * 220  # espeak-ng#2495: stacked suffixes overflow a stack buffer (always an abort)


@pytest.fixture(scope="module")
def config() -> dict:
    return json.loads(Path(f"{default_voice_path()}.json").read_text())


@pytest.fixture(scope="module")
def phonemizer(config: dict) -> Iterator[Phonemizer]:
    p = Phonemizer(config)
    yield p
    p.close()


def test_the_child_gives_pipers_own_phonemes(phonemizer: Phonemizer, config: dict) -> None:
    from piper import PiperConfig, PiperVoice

    voice = PiperVoice(config=PiperConfig.from_dict(config), session=None)
    texts = ["Hello there, how are you? Fine.", "Naïve café, 12.5 km\nnext line", "[[ hɛloʊ ]] world", "😀 ..."]
    for text in texts:
        assert phonemizer.phonemize(text) == voice.phonemize(text)


def test_a_text_that_crashes_espeak_fails_alone(phonemizer: Phonemizer) -> None:
    before = phonemizer.phonemize("Before.")
    with pytest.raises(PhonemizerError) as err:
        phonemizer.phonemize(CRASHES)
    assert isinstance(err.value, TTSInputError) and err.value.param == "input"
    phonemizer._cache.pop(CRASHES)  # (asked again, not answered from the cache)
    with pytest.raises(PhonemizerError):  # again, on the child started after the first crash
        phonemizer.phonemize(CRASHES)  # (the heap overflows, e.g. "x." * 200, crash only mostly)
    phonemizer._cache.pop("Before.")
    assert phonemizer.phonemize("Before.") == before  # a fresh child serves the next text


def test_a_hung_phonemiser_is_cut_off(config: dict) -> None:
    p = Phonemizer(config, timeout_s=0.5)
    try:
        expected = p.phonemize("Hello.")
        hung = p._proc
        assert hung is not None
        os.kill(hung.pid, signal.SIGSTOP)  # it hangs (a timeout of 0 raced a fast child's answer)
        t0 = time.monotonic()
        p._cache.clear()  # (asked again, not answered from the cache)
        with pytest.raises(PhonemizerError):
            p.phonemize("Hello.")
        assert time.monotonic() - t0 < 2.0  # its timeout, then a kill: no wait for an exit that can't come
        assert hung.wait(timeout=10) == -signal.SIGKILL and p._proc is not hung  # killed, replaced
        p._cache.clear()
        assert p.phonemize("Hello.") == expected
    finally:
        p.close()


def test_a_child_that_died_between_calls_is_replaced(phonemizer: Phonemizer) -> None:
    expected = phonemizer.phonemize("Hello.")
    proc = phonemizer._proc
    assert proc is not None
    proc.kill()
    proc.wait()
    assert phonemizer.phonemize("Hello.") == expected  # (kept: no child needed)
    assert phonemizer._proc is proc
    assert phonemizer.phonemize("Goodbye.")  # a new text: a new child
    assert phonemizer._proc is not proc and phonemizer._proc.poll() is None


def test_the_last_texts_outcomes_are_kept(config: dict) -> None:
    """The cache the engine's look-ahead fills: a text phonemised once answers from it (a copy),
    the oldest text leaves it first, and a text eSpeak NG failed on fails again without a child
    (it fails on it every time: one crash, not one per look)."""
    from modalities.tts import phonemizer as mod

    p = Phonemizer(config)
    try:
        first = p.phonemize("One.")
        for i in range(mod.CACHED - 1):
            p._cache[f"filler {i}"] = [["x"]]
        again = p.phonemize("One.")  # (read again: now the newest)
        assert again == first and again is not first
        again[0].append("!")  # (the caller's to change: the cache keeps its own)
        p.phonemize("Two.")  # one past the size: the oldest filler leaves, "One." stays
        assert "filler 0" not in p._cache and "One." in p._cache and len(p._cache) == mod.CACHED
        assert p.phonemize("One.") == first
        with pytest.raises(PhonemizerError):
            p.phonemize(CRASHES)
        child = p._proc
        with pytest.raises(PhonemizerError):
            p.phonemize(CRASHES)
        assert p._proc is child  # (no second crash, no second child)
    finally:
        p.close()


def test_a_phonemiser_that_cannot_start_is_the_servers_fault_not_the_texts(
    config: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    import sys

    from engine.errors import EngineDeadError

    monkeypatch.setattr(sys, "executable", "/bin/false")  # the child exits at once, never ready
    p = Phonemizer(config)
    with pytest.raises(EngineDeadError):
        p.phonemize("Hello.")
    p.close()


def test_pipes_past_select_reach_still_work(config: dict) -> None:
    """With 1024 files open, the child's pipes get descriptors select() can't watch."""
    import os
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < 1200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(4096, hard), hard))  # (a soft limit of 1024 is common)
    held = [os.open(os.devnull, os.O_RDONLY) for _ in range(1100)]
    try:
        p = Phonemizer(config)
        assert p.phonemize("Hello.") and p._proc is not None and p._proc.stdout.fileno() >= 1024
        p.close()
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
