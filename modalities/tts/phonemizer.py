"""Piper's phonemiser in a child process.

Piper phonemises with the eSpeak NG that ``piper-tts`` bundles, and eSpeak NG crashes its process
on some texts: a word of 220 ``s'`` suffixes overflows a stack buffer (espeak-ng#2495), a run of
~100 letter-dot pairs ("a.b.c.…") crashes it too, and fuzzers keep finding more upstream. Speech
input is user text (and LLM output), and in the embedded server a crash would take every request
in flight with it. So ``PiperVoice.phonemize`` itself (Piper's own phonemes) runs in a child: a
crash or a hang fails only the text that caused it (``PhonemizerError``, a 400 for its request),
and a fresh child serves the next one.

The child speaks JSON lines: the voice's config first (it answers ``ready``), then a text in, its
phonemes per sentence out. A round trip costs ~0.1 ms over the phonemisation itself; Piper serialises phonemisation
under one lock anyway, so one child per engine loses no parallelism. The last ``CACHED`` texts'
phonemes (or failures: eSpeak NG fails on a text every time) are kept: the engine phonemises a
request's later pieces ahead, to refuse a text that can't be spoken before its first audio, and
their synthesis then finds them done.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import weakref
from collections import OrderedDict
from pathlib import Path
from typing import IO, Any

from engine.errors import EngineDeadError
from modalities.tts.protocol import TTSInputError

logger = logging.getLogger("mmserve.tts")

_ROOT = str(Path(__file__).resolve().parents[2])  # the child imports this module by name
CACHED = 256  # texts whose phonemes are kept (a few requests' pieces)


class PhonemizerError(TTSInputError):
    """The phonemiser crashed or hung on a text: that text can't be spoken."""

    def __init__(self, message: str) -> None:
        super().__init__(message, "input")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """End ``proc``: EOF on its stdin asks it to exit; a child that doesn't is killed."""
    try:
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=2)
    except (OSError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


class Phonemizer:
    """``phonemize(text)``: Piper's phonemes for ``text``, one list per sentence, made in a child
    process (started at the first call, or by ``start``). Thread-safe; ``close`` ends the child
    (so does garbage collection). A child that can't start raises ``EngineDeadError`` (the
    server's fault, not the text's)."""

    def __init__(self, config: dict[str, Any], timeout_s: float = 5.0, start_timeout_s: float = 60.0) -> None:
        self._config = json.dumps(config)
        self.timeout_s = timeout_s  # per text: ~0.1 ms of work, so only a hang gets near it
        self.start_timeout_s = start_timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._ready = False
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None
        self._cache: OrderedDict[str, list[list[str]] | str] = OrderedDict()  # phonemes, or why it failed

    def start(self) -> None:
        with self._lock:
            self._ready_child()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def phonemize(self, text: str) -> list[list[str]]:
        line = (json.dumps(text.replace("\0", " ")) + "\n").encode()  # Piper's C bridge takes no NUL
        with self._lock:
            if (done := self._cache.get(text)) is not None:
                self._cache.move_to_end(text)
                if isinstance(done, str):
                    raise PhonemizerError(done)
                return [list(p) for p in done]  # (copies: the cache's own stay as made)
            try:
                self._send(self._ready_child(), line)
            except OSError:  # it died between calls (killed from outside): once more, on a fresh one
                self._drop()
                try:
                    self._send(self._ready_child(), line)
                except OSError as exc:
                    raise EngineDeadError(f"the phonemiser (eSpeak NG) is not running: {exc}") from exc
            assert self._proc is not None
            answer = self._read(self._proc, self.timeout_s)
            if answer is None:  # it crashed on the text, or hung on it
                hung = self._proc.poll() is None
                self._drop(kill=hung)  # a hung child reads no EOF: no 2 s wait for it, under the lock
                try:
                    self._spawn()  # the next text doesn't wait for a start
                except OSError:
                    logger.exception("the phonemiser could not be restarted (the next text tries again)")
                logger.warning("the phonemiser %s on a text of %d characters", "hung" if hung else "crashed", len(text))
                failed = "this text can't be spoken: the phonemiser (eSpeak NG) failed on it"
                self._keep(text, failed)
                raise PhonemizerError(failed)
            phonemes = json.loads(answer)
            self._keep(text, [list(p) for p in phonemes])
        return phonemes

    def _keep(self, text: str, outcome: list[list[str]] | str) -> None:
        self._cache[text] = outcome
        if len(self._cache) > CACHED:
            self._cache.popitem(last=False)

    @staticmethod
    def _send(proc: subprocess.Popen[bytes], line: bytes) -> None:
        assert proc.stdin is not None
        proc.stdin.write(line)
        proc.stdin.flush()

    @staticmethod
    def _read(proc: subprocess.Popen[bytes], timeout_s: float) -> bytes | None:
        """The child's next line; ``None`` at its end or after ``timeout_s`` (poll, not select:
        a server with 1024 files open gets pipes past select's reach)."""
        assert proc.stdout is not None
        poller = select.poll()
        poller.register(proc.stdout, select.POLLIN)
        if not poller.poll(timeout_s * 1000):
            return None
        return proc.stdout.readline() or None  # whole lines only: one per request

    def _ready_child(self) -> subprocess.Popen[bytes]:
        if self._proc is None or self._proc.poll() is not None:
            self._drop()
            self._spawn()
        assert self._proc is not None
        if not self._ready:
            if self._read(self._proc, self.start_timeout_s) != b"ready\n":
                self._drop()
                raise EngineDeadError("the phonemiser (eSpeak NG) could not start: see the server's log")
            self._ready = True
        return self._proc

    def _spawn(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(
            [sys.executable, "-m", "modalities.tts.phonemizer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        self._proc, self._ready = proc, False
        self._finalizer = weakref.finalize(self, _stop, proc)
        self._send(proc, (self._config + "\n").encode())

    def _drop(self, kill: bool = False) -> None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None and kill:
            proc.kill()
            proc.wait()
        elif proc is not None:
            _stop(proc)


def _serve(stdin: IO[str], out: IO[str]) -> None:
    """The child: the voice's config in, ``ready`` out once it can phonemise, then one JSON text
    per line in, its phonemes out."""
    from piper import PiperConfig, PiperVoice

    voice = PiperVoice(config=PiperConfig.from_dict(json.loads(stdin.readline())), session=None)
    voice.phonemize("Ready.")  # eSpeak NG loads its data at the first text
    out.write("ready\n")
    out.flush()
    for line in stdin:
        out.write(json.dumps(voice.phonemize(json.loads(line))) + "\n")
        out.flush()


if __name__ == "__main__":
    # The protocol keeps the real stdout; anything eSpeak prints goes to stderr instead.
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    _serve(sys.stdin, protocol)
