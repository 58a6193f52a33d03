"""Speculative turn processing ("preemptive generation", as LiveKit and Pipecat do it).

When the speaker pauses (``VADConfig.eager_ms`` of silence, shorter than the silence that ends
the turn), the ASR transcribes the utterance so far, the LLM starts the reply to that transcript
and the TTS synthesises the reply's first sentence, all in the background: nothing reaches the
conversation or the client. When the turn commits, the reply reuses that work if its prompt is
exactly the speculative one (the same transcript in the same conversation); otherwise, or when
speech resumes, the speculative requests are aborted inside the engines and the turn runs as usual.

``Buffered`` is the mechanism: an async stream consumed in a background task into a buffer,
replayed later from its first item and then followed live.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

T = TypeVar("T")


class SpeculationCancelled(RuntimeError):
    """``replay`` of a stream that was cancelled before it finished."""


class Buffered(Generic[T]):
    """Consumes ``source`` in a background task, keeping every item (``on_item`` sees each one as
    it comes). ``replay()`` yields the items so far, then the rest as they arrive, then raises the
    source's error if it failed. ``cancel()`` stops the task, which closes ``source`` (an engine's
    stream: its request is aborted)."""

    def __init__(self, source: AsyncIterator[T], on_item: Callable[[T], None] | None = None) -> None:
        self.items: list[T] = []
        self.error: Exception | None = None
        self.finished = self.cancelled = False
        self._changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run(source, on_item))

    async def _run(self, source: AsyncIterator[T], on_item: Callable[[T], None] | None) -> None:
        try:
            async for item in source:
                self.items.append(item)
                if on_item is not None:
                    on_item(item)
                self._changed.set()
        except Exception as exc:  # noqa: BLE001 - kept for the consumer (an engine refusal)
            self.error = exc
        finally:
            self.finished = True
            self._changed.set()
            aclose = getattr(source, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()

    async def replay(self) -> AsyncIterator[T]:
        i = 0
        while True:
            while i < len(self.items):
                yield self.items[i]
                i += 1
            if self.finished:
                if self.error is not None:
                    raise self.error
                if self.cancelled:
                    raise SpeculationCancelled("the speculative stream was cancelled")
                return
            self._changed.clear()
            await self._changed.wait()

    def cancel(self) -> None:
        if not self.task.done():
            self.cancelled = True
            self.task.cancel()


class SpeechPrefetch:
    """Speculative synthesis of one piece of text (a speculative reply's first sentence), shared
    by the LLM stage that starts it and the TTS stage that takes it. ``options`` is the TTS
    stage's ``TTSOptions`` (enabled, voice, sample rate, priority, speed)."""

    def __init__(self, services: Any, options: Any) -> None:
        self.services, self.options = services, options
        self.pending: tuple[tuple[str, str | None, int, float], Buffered[Any]] | None = None

    def _key(self, text: str) -> tuple[str, str | None, int, float]:
        return text, self.options.voice, self.options.sample_rate, self.options.speed

    def start(self, text: str) -> None:
        self.cancel()
        if self.options.enabled and self.services.tts is not None and text:
            o = self.options
            stream = self.services.speak(text, o.voice, o.sample_rate, o.priority, o.speed)
            self.pending = (self._key(text), Buffered(stream))

    def take(self, text: str) -> Buffered[Any] | None:
        """The synthesis of ``text`` if it was prefetched with the current voice; any other
        prefetch is cancelled."""
        pending, self.pending = self.pending, None
        if pending is not None and pending[0] == self._key(text):
            return pending[1]
        if pending is not None:
            pending[1].cancel()
        return None

    def cancel(self) -> None:
        pending, self.pending = self.pending, None
        if pending is not None:
            pending[1].cancel()


@dataclass(frozen=True)
class ReplyParams:
    """How a reply is sampled."""

    max_tokens: int
    temperature: float
    grammar: str | None = None  # what tool_choice holds it to (engine.structured)


@dataclass
class LLMSpeculation:
    """A reply generated for a prompt before the turn committed."""

    prompt_ids: list[int]
    params: ReplyParams
    outputs: Buffered[Any]
    prefetch: SpeechPrefetch | None = None  # the first sentence's synthesis, once started

    def matches(self, prompt_ids: list[int], params: ReplyParams) -> bool:
        return self.prompt_ids == prompt_ids and self.params == params

    def cancel(self) -> None:
        """Abort the generation and the synthesis it started."""
        self.outputs.cancel()
        if self.prefetch is not None:
            self.prefetch.cancel()
