"""The reply stage: ``LLM`` adds the user's transcripts to the conversation and streams replies
from the shared engine (speculatively at a pause, with ``pipelines.speculation``), function
calls parsed out of them (``modalities.llm.tools``)."""

from __future__ import annotations

import logging
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.offload import OFF_LOOP_CHARS, run_sized
from gateway.errors import failure_error, retry_after
from gateway.ratelimit import Charge, shielded
from modalities.llm.serving import charge_amount
from modalities.llm.tools import ToolCallStream, declared
from modalities.tts.text import SentenceSplitter
from pipelines.conversation import Conversation, Item
from pipelines.frames import (
    Frame,
    Interrupt,
    LLMDone,
    LLMReserved,
    LLMStarted,
    ResponseRequest,
    SpeechResumed,
    TextDelta,
    ToolCall,
    ToolCallArguments,
    ToolCallStarted,
    Transcript,
)
from pipelines.processor import Processor
from pipelines.services import Services
from pipelines.speculation import Buffered, LLMSpeculation, ReplyParams, SpeechPrefetch
from pipelines.turns import TurnJudge

if TYPE_CHECKING:
    from engine.sampling_params import SamplingParams

logger = logging.getLogger("mmserve.pipelines")


@dataclass
class LLMOptions:
    max_tokens: int = 64
    temperature: float = 0.0
    priority: int = 0  # of the engine requests (lower first under the engine's priority policy)
    # Parse replies for calls of these functions (the conversation's tools; None: off).
    tool_calls: frozenset[str] | None = None
    grammar: str | None = None  # what the session's tool_choice holds replies to
    # semantic VAD: a pause whose transcript ends the user's message at least this likely ends
    # the turn (``pipelines.turns``; None: pauses are not judged)
    end_of_turn_p: float | None = None
    # Who pays for a reply: takes its ``llm_tokens`` (prompt + max_tokens, as the chat routes
    # charge) before it starts, or raises (``APIError`` 429: the reply fails); a realtime
    # session's tenant. None: replies are free (a job's, charged at its submission).
    budget: Callable[[int], Awaitable[Charge]] | None = None


class LLM(Processor):
    """Adds transcripts to the conversation and streams replies: on a ``Transcript`` that asks
    for one, or on ``ResponseRequest``. Cancelling ``process`` (barge-in) aborts the engine
    request at once (``AsyncEngine.generate`` aborts when its consumer leaves).

    A tentative ``Transcript`` starts a speculative reply (and, with ``prefetch``, the synthesis
    of its first sentence) in the background; the next reply takes it if its prompt and sampling
    parameters are the same, otherwise (and on ``SpeechResumed`` or a barge-in) it is aborted."""

    interruptible = True

    def __init__(
        self,
        services: Services,
        conversation: Conversation,
        options: LLMOptions | None = None,
        prefetch: SpeechPrefetch | None = None,
        end_turn: Callable[[int], None] | None = None,
    ) -> None:
        self.services = services
        self.conversation = conversation
        self.options = options or LLMOptions()
        self.prefetch = prefetch
        self.active: str | None = None
        self.speculation: LLMSpeculation | None = None
        self.judge = TurnJudge(  # (the options are live: a session.update changes them)
            services, conversation, lambda: self.options.end_of_turn_p, end_turn, lambda: self.options.priority
        )

    async def process(self, frame: Frame) -> AsyncIterator[Frame]:
        if isinstance(frame, Transcript) and frame.tentative:
            self.close()
            if frame.respond:
                self._speculate(frame.text)
            self.judge.start(frame.text, frame.turn_key)
        elif isinstance(frame, SpeechResumed):
            self.close()
        elif isinstance(frame, Transcript):
            self.judge.stop()  # the turn is over
            heard = self.conversation.hear(frame.item_id, frame.text)
            yield frame
            if heard is not None and frame.respond and frame.text:  # nothing said (noise), or deleted: no reply
                async for out in self._reply(ResponseRequest(asked=heard.made)):  # (asked at the commit)
                    yield out
            else:
                self.close()
        elif isinstance(frame, ResponseRequest):
            if not frame.cancelled:  # (a request the client cancelled on its way here: none)
                async for out in self._reply(frame):
                    yield out
        else:
            yield frame

    def _params(self, req: ResponseRequest | None = None) -> ReplyParams:
        """A reply's sampling: ``req``'s where it sets it, else the options'."""
        o = self.options
        if req is None:
            return ReplyParams(o.max_tokens, o.temperature, o.grammar)
        return ReplyParams(
            req.max_tokens or o.max_tokens,
            o.temperature if req.temperature is None else req.temperature,
            o.grammar if req.tools is None else req.grammar,
        )

    def _prompt(self, conv: Conversation, max_tokens: int | None = None) -> list[int]:
        engine = self.services.llm
        max_len = getattr(engine, "max_model_len", None)
        max_tokens = max_tokens or self.options.max_tokens
        return conv.prompt_ids(engine.tokenizer, max_len - max_tokens if max_len else None, max_tokens)

    def _sampling(self, p: ReplyParams) -> SamplingParams:
        from engine.sampling_params import SamplingParams

        return SamplingParams(max_tokens=p.max_tokens, temperature=p.temperature, grammar=p.grammar)

    def _generate(self, request_id: str, ids: list[int], params: ReplyParams | None = None) -> AsyncIterator[Any]:
        sampling = self._sampling(params or self._params())
        # Response ids count per session; the engine is shared by every session, so its request
        # id needs a process-unique suffix.
        request_id = f"{request_id}-{uuid.uuid4().hex[:12]}"
        return self.services.llm.generate(request_id, ids, sampling, priority=self.options.priority)

    def _speculate(self, text: str) -> None:
        """Start the reply the conversation would get if the turn ended with ``text`` (the
        caller has closed any earlier one)."""
        if not text or self.conversation.chars() > OFF_LOOP_CHARS:  # a long render would hold the loop
            return
        try:
            ids = self._prompt(self.conversation.answering(text))
        except Exception:  # noqa: BLE001 - the committed turn will report it, not a speculation
            logger.debug("no speculative reply", exc_info=True)
            return
        splitter = SentenceSplitter()
        calls = None if self.options.tool_calls is None else ToolCallStream(self.options.tool_calls, False)  # unsaid

        def first_sentence(out: Any) -> None:
            """Synthesise the reply's first sentence (the one ``Sentences`` will send) early."""
            if self.prefetch is None or spec.prefetch is not None:
                return
            delta = out.outputs[0].delta_text or ""
            first = splitter.feed(calls.feed(delta) if calls is not None else delta)
            if not first and out.finished:
                first = [splitter.flush()]
            if first and first[0]:
                spec.prefetch = self.prefetch
                self.prefetch.start(first[0])

        spec = LLMSpeculation(ids, self._params(), Buffered(self._generate("spec", ids), first_sentence))
        self.speculation = spec

    async def _reply(self, req: ResponseRequest) -> AsyncIterator[Frame]:
        """A reply to the conversation as it was when asked for (``req.asked``), or to
        ``req.input``, under ``req.instructions`` if given (for this reply only); an out-of-band
        one is not added to the conversation and leaves a speculative reply for the next turn
        alone."""
        conv = self.conversation
        response_id = conv.new_id("resp")
        late = conv.later(req.asked)  # (the client's items added since: they wait for the next reply)
        item = Item(conv.new_id(), "assistant") if req.out_of_band else conv.add_reply(late)
        prompt = conv.as_asked(req.asked, late)
        own = req.out_of_band or req.input is not None or req.instructions or req.tools is not None
        if own:
            prompt = prompt.context(req.input, item, req.instructions, req.tools)
        names = self.options.tool_calls if req.tools is None else declared(req.tools) if req.tools else None
        self.active = response_id
        yield LLMStarted(
            response_id,
            item.id,
            req.audio,
            req.out_of_band,
            req.metadata,
            req.voice,
            req.sample_rate,
            req.audio_format,
            calls=names is not None,
            request=req.number,
            event_id=req.event_id,
        )
        final = None
        failed: dict[str, Any] | None = None  # the error object of a failed reply
        wait: float | None = None  # (refused under load: how long the engine asked to wait)
        whole = False  # it ran to its end
        ids: list[int] = []
        charged: Charge | None = None

        def used() -> int:  # (the tokens generated so far: the session may have shown fewer, its audio behind)
            return len(ids) + len(final.outputs[0].token_ids) if final is not None else 0

        async def settle(reported: float) -> None:  # (the session's, at response.done: what it reported, at least)
            assert charged is not None
            await charged.settle(max(reported, used()))

        spec = None
        if not req.out_of_band:
            spec, self.speculation = self.speculation, None
        try:
            # A long render runs on a thread, over a snapshot: the session may add or delete items
            # meanwhile; the items the render left out stay out of the live conversation.
            rendered, params = prompt.snapshot(), self._params(req)
            ids = await run_sized(rendered.chars(), self._prompt, rendered, params.max_tokens)
            if not own:
                conv.keep_from(rendered)
            reserved = charge_amount(self.services.llm, [ids], self._sampling(params))
            if self.options.budget is not None:  # (over it: the reply fails, the session goes on)
                charged = await shielded(self.options.budget(reserved))
            yield LLMReserved(response_id, reserved, None if charged is None else settle)
            if spec is not None and not spec.matches(ids, params):
                spec.cancel()
                spec = None
            outputs = spec.outputs.replay() if spec is not None else self._generate(response_id, ids, params)
            # The text of a call is not said: it becomes a ToolCall; the message ends where a call starts.
            calls = None if names is None else ToolCallStream(names, text_after_calls=False)
            made: list[Item] = []  # the calls' items
            async for out in outputs:
                final = out
                delta = out.outputs[0].delta_text
                if calls is not None:
                    delta = calls.feed(delta)
                if delta:
                    if not item.truncated:
                        item.text += delta
                    yield TextDelta(response_id, delta, len(ids), len(out.outputs[0].token_ids), out.num_cached_tokens)
                if calls is not None:
                    for frame in self._call_frames(response_id, item, calls, made, req.out_of_band):
                        yield frame
            if calls is not None:
                for frame in self._calls(response_id, item, calls, made, req.out_of_band):
                    yield frame
            whole = True
        except Exception as exc:  # noqa: BLE001 - refused (prompt too long, queue full) or failed: the reply fails
            failed = failure_error(exc)  # (an APIError: a lost worker's 503 under celery dispatch)
            wait = retry_after(exc)
        finally:
            if spec is not None and whole:
                spec.outputs.cancel()  # (its first sentence's synthesis is the TTS stage's to take)
            elif spec is not None:
                spec.cancel()  # cut or failed: stop the generation and that synthesis too
            if charged is not None:  # (cancelled too) the tokens it used; none if it never started, as the chat routes
                await charged.settle(used())
        self.active = None
        yield LLMDone(
            response_id,
            item.text,
            cut=final is not None and getattr(final.outputs[0], "finish_reason", None) == "length",
            prompt_tokens=len(ids),
            completion_tokens=len(final.outputs[0].token_ids) if final else 0,
            cached_tokens=final.num_cached_tokens if final else 0,
            error=failed["message"] if failed else None,
            error_type=failed["type"] if failed else "server_error",
            error_code=failed["code"] if failed else None,
            retry_after_s=wait,
        )

    def _calls(
        self, response_id: str, item: Item, calls: ToolCallStream, made: list[Item], out_of_band: bool
    ) -> Iterator[Frame]:
        """At the reply's end: its held-back text, then what its calls gained (all whole now)."""
        tail, _ = calls.finish()
        if tail:
            if not item.truncated:
                item.text += tail
            yield TextDelta(response_id, tail)
        yield from self._call_frames(response_id, item, calls, made, out_of_band)

    def _call_frames(
        self, response_id: str, item: Item, calls: ToolCallStream, made: list[Item], out_of_band: bool
    ) -> Iterator[Frame]:
        """What the reply's calls gained: a new call's item (in the conversation after the
        reply's, or the last call's, unless the reply is out-of-band) and ``ToolCallStarted``;
        ``ToolCallArguments``; ``ToolCall`` once a call is whole."""
        for d in calls.deltas():
            fn = d["function"]
            if "id" in d:
                fields = {"kind": "function_call", "call_id": d["id"], "name": fn["name"], "response_id": response_id}
                if out_of_band:
                    made.append(Item(self.conversation.new_id(), "assistant", status="in_progress", **fields))
                else:
                    after = next((i.id for i in [*made[::-1], item] if self.conversation.get(i.id)), None)
                    made.append(self.conversation.add("assistant", after=after, status="in_progress", **fields))
                yield ToolCallStarted(response_id, made[-1].id, d["id"], fn["name"])
            if fn["arguments"]:
                made[d["index"]].text += fn["arguments"]
                yield ToolCallArguments(response_id, made[d["index"]].id, fn["arguments"])
        for call, call_item in zip(calls.calls[: calls.whole], made, strict=False):
            if call_item.status == "in_progress":
                call_item.status = "completed"
                yield ToolCall(response_id, call_item.id, call.id, call.name, call.arguments)

    def reply_of(self, frame: Frame) -> str | None:
        return self.active  # (the reply being written, whatever frame asked for it)

    async def on_interrupt(self, by: Interrupt) -> None:
        if not by.cancels(self.active):
            return  # a client's cancel of a reply written before: the one being written goes on
        self.active = None
        self.close(judging=False)  # (a client's response.cancel: the user's turn is still judged)

    def close(self, judging: bool = True) -> None:
        """Drop the speculative reply, and (``judging``) the verdict on the pause being judged."""
        spec, self.speculation = self.speculation, None
        if spec is not None:
            spec.cancel()
        if judging:
            self.judge.stop()
