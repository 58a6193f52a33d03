"""Piper's phonemiser in a child process.

Piper phonemises with the eSpeak NG that ``piper-tts`` bundles, and eSpeak NG crashes its process
on some texts: a word of 220 ``s'`` suffixes overflows a stack buffer (espeak-ng#2495), a run of
~100 letter-dot pairs ("a.b.c.…") crashes it too, and fuzzers keep finding more upstream. Speech
input is user text (and LLM output), and in the embedded server a crash would take every request
in flight with it. So ``PiperVoice.phonemize`` itself (Piper's own phonemes) runs in a child: a
crash or a hang fails only the text that caused it (``PhonemizerError``, a 400 for its request),
and a fresh child serves the next one.

The child speaks JSON lines: the voice's config first, then a text in, its phonemes per sentence
out. A round trip costs ~0.1 ms over the phonemisation itself; Piper serialises phonemisation
under one lock anyway, so one child per engine loses no parallelism.
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
from pathlib import Path
from typing import IO, Any

from modalities.tts.protocol import TTSInputError

logger = logging.getLogger("mmserve.tts")

_ROOT = str(Path(__file__).resolve().parents[2])  # the child imports this module by name


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
    (so does garbage collection)."""

    def __init__(self, config: dict[str, Any], timeout_s: float = 10.0) -> None:
        self._config = json.dumps(config)
        self.timeout_s = timeout_s
        self._proc: subprocess.Popen[bytes] | None = None
        self._lock = threading.Lock()
        self._finalizer: weakref.finalize | None = None

    def start(self) -> None:
        with self._lock:
            self._child()

    def close(self) -> None:
        with self._lock:
            self._drop()

    def phonemize(self, text: str) -> list[list[str]]:
        line = (json.dumps(text.replace("\0", " ")) + "\n").encode()  # Piper's C bridge takes no NUL
        with self._lock:
            for attempt in range(2):  # a child that died between calls is replaced, once
                proc = self._child()
                assert proc.stdin is not None and proc.stdout is not None
                try:
                    proc.stdin.write(line)
                    proc.stdin.flush()
                    break
                except OSError:
                    self._drop()
                    if attempt:
                        raise PhonemizerError("the phonemiser could not be started") from None
            ready, _, _ = select.select([proc.stdout], [], [], self.timeout_s)
            answer = proc.stdout.readline() if ready else b""
            if not answer:  # it crashed on the text (or hung: killed)
                hung = not ready
                self._drop()
                self._child()  # the next text doesn't wait for a start
                logger.warning("the phonemiser %s on a text of %d characters", "hung" if hung else "crashed", len(text))
                raise PhonemizerError("this text can't be spoken: the phonemiser (eSpeak NG) failed on it")
        return json.loads(answer)

    def _child(self) -> subprocess.Popen[bytes]:
        if self._proc is not None and self._proc.poll() is None:
            return self._proc
        self._drop()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [_ROOT, os.environ.get("PYTHONPATH")]))}
        proc = subprocess.Popen(
            [sys.executable, "-m", "modalities.tts.phonemizer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=env,
        )
        assert proc.stdin is not None
        proc.stdin.write((self._config + "\n").encode())
        proc.stdin.flush()
        self._proc = proc
        self._finalizer = weakref.finalize(self, _stop, proc)
        return proc

    def _drop(self) -> None:
        proc, self._proc = self._proc, None
        if self._finalizer is not None:
            self._finalizer.detach()
            self._finalizer = None
        if proc is not None:
            _stop(proc)


def _serve(stdin: IO[str], out: IO[str]) -> None:
    """The child: the voice's config, then one JSON text per line in, its phonemes out."""
    from piper import PiperConfig, PiperVoice

    voice = PiperVoice(config=PiperConfig.from_dict(json.loads(stdin.readline())), session=None)
    for line in stdin:
        out.write(json.dumps(voice.phonemize(json.loads(line))) + "\n")
        out.flush()


if __name__ == "__main__":
    # The protocol keeps the real stdout; anything eSpeak prints goes to stderr instead.
    protocol = os.fdopen(os.dup(1), "w", encoding="utf-8")
    os.dup2(2, 1)
    _serve(sys.stdin, protocol)
