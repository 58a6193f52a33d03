"""Helpers shared by the LLM routes: engine lookup, admission (context cap, rate limit, engine
queue), fan-in, usage/metrics bookkeeping, timing, and OpenAI logprob formatting.

Timing: non-streamed responses carry ``Server-Timing: queue;dur=…, inference;dur=…, total;dur=…``
(ms; queue = arrival → first scheduled, inference = first scheduled → done, total = request
received → done). A stream's headers leave before its body, so they carry what is known then:
``queue`` and ``ttft`` (request received → first output); the full split is in the last SSE
chunk before ``[DONE]`` (the usage chunk when ``stream_options.include_usage``, else the chunk
that finishes the last choice) as ``"timing": {"queue_ms", "inference_ms", "total_ms", "ttft_ms"}``.

Rate limit: a request is charged ``prompt tokens + max_tokens × n`` (``llm_tokens``) before it
reaches the engine, and settled to its real usage when it ends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request

from engine.errors import InvalidParamError, PromptTooLongError, check_token_ids
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from engine.token_bound import check_length
from gateway.errors import APIError, ClientDisconnected, as_api_error, from_engine_error, pick_engine
from gateway.logs import annotate
from gateway.metrics import record_timing, server_timing_header
from gateway.ratelimit import Charge, charge
from gateway.streaming import SSE_DONE, SSE_HEADERS, ClosingStreamingResponse, MergedGeneration, sse


def resolve_engine(request: Request, model: str | None) -> tuple[str, Any]:
    """``(served_name, engine)`` for ``model`` (``gateway.errors.pick_engine``); the only LLM
    engine when ``model`` is omitted. Naming a model of another modality (e.g. an embedding
    model) is a 400, an unknown one a 404."""
    from engine.async_engine import AsyncEngine  # here, not at import: plugin loading stays torch-free

    state = request.app.state
    llms = {name: e for name, e in state.engines.items() if isinstance(e, AsyncEngine)}
    return pick_engine(
        state.engines,
        getattr(state, "aliases", {}),
        model,
        llms,
        none_served="no text generation model is served (include llm in --only; --llm picks the model)",
        unsupported="does not generate text",
    )


def token_text(tokenizer: Any, token_id: int, cache: dict[int, str]) -> str:
    text = cache.get(token_id)
    if text is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        cache[token_id] = text
    return text


def validate_ids(ids: list[int], vocab_size: int, param: str) -> None:
    try:
        check_token_ids(ids, vocab_size, param)
    except InvalidParamError as exc:
        raise APIError(400, str(exc), param=param) from exc


def refuse_oversized(limit: int | None, tokenizer: Any, text: str, param: str) -> None:
    """A 400 ``context_length_exceeded`` for a prompt ``text`` that cannot fit a context of
    ``limit`` tokens whatever it says (``engine.token_bound``): before tokenizing it."""
    if isinstance(limit, int):
        try:
            check_length(tokenizer, text, limit)
        except PromptTooLongError as exc:
            raise as_api_error(exc, param) from exc


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Tracker:
    """Per-response bookkeeping: token counts, finished choices, timing, metrics, the rate-limit charge."""

    def __init__(self, request: Request, model: str, endpoint: str, n: int, prompt_tokens: list[int]) -> None:
        """``prompt_tokens``: each prompt's length (usage counts them before any output comes)."""
        self.request = request
        self.metrics = getattr(request.app.state, "metrics", None)
        self.model, self.endpoint, self.n = model, endpoint, n
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.last_token: float | None = None
        self.prompt_tokens = list(prompt_tokens)
        self.completion_tokens = [0] * (len(prompt_tokens) * n)
        self.finished: set[int] = set()
        self.charge: Charge | None = None
        self.last: dict[int, RequestOutput] = {}
        self._timing: tuple[str, dict[str, float]] | None = None
        self.stream_header = ""

    def update(self, prompt_idx: int, out: RequestOutput) -> None:
        self.last[prompt_idx] = out
        for co in out.outputs:
            self.completion_tokens[prompt_idx * self.n + co.index] = len(co.token_ids)
        if any(co.delta_token_ids for co in out.outputs):
            self.last_token = time.monotonic()
        if self.first_token is None and any(co.token_ids for co in out.outputs):
            self.first_token = time.monotonic()
            if self.metrics is not None:
                self.metrics.observe(
                    "time_to_first_token_seconds", self.first_token - self.start, help="TTFT", model=self.model
                )

    @property
    def all_finished(self) -> bool:
        return len(self.finished) == len(self.completion_tokens)

    def _queue_s(self, outputs: list[RequestOutput], now: float) -> tuple[float, float]:
        """(queue seconds of the slowest-admitted prompt, earliest first-scheduled wall time)."""
        scheduled = [o.metrics.get("scheduled_time", now) for o in outputs]
        queue = max((s - o.metrics.get("arrival_time", s) for s, o in zip(scheduled, outputs, strict=True)), default=0)
        return max(0.0, queue), min(scheduled, default=now)

    def header_timing(self, first: list[RequestOutput]) -> str:
        """``Server-Timing`` for a stream's headers (``first``: each prompt's first output)."""
        queue, _ = self._queue_s(first, time.time())
        ttft = time.monotonic() - self.start
        return server_timing_header({"queue_ms": round(queue * 1e3, 1), "ttft_ms": round(ttft * 1e3, 1)})

    def timing(self) -> tuple[str, dict[str, float]]:
        """``(Server-Timing value, {queue_ms, inference_ms, total_ms, ttft_ms})`` of the finished
        response; recorded in the metrics and the request's log line once."""
        if self._timing is None:
            now = time.time()
            queue, scheduled = self._queue_s(list(self.last.values()), now)
            total = time.monotonic() - self.start
            fields = record_timing(self.request, "llm", self.model, queue, max(0.0, now - scheduled), total)
            header = server_timing_header(fields)
            if self.first_token is not None:
                fields["ttft_ms"] = round((self.first_token - self.start) * 1e3, 1)
            self._timing = header, fields
        return self._timing

    def usage(self) -> dict[str, int]:
        return usage_dict(sum(self.prompt_tokens), sum(self.completion_tokens))

    async def done(self, status: str) -> None:
        """Record the outcome (metrics, log fields) and settle the rate-limit charge to the usage."""
        prompt, completion = sum(self.prompt_tokens), sum(self.completion_tokens)
        annotate(self.request, model=self.model, prompt_tokens=prompt, completion_tokens=completion, outcome=status)
        if self.charge is not None:
            await self.charge.settle(prompt + completion)
        if self.metrics is None:
            return
        m = self.metrics
        m.inc(
            "requests_total",
            help="generation requests by outcome",
            model=self.model,
            endpoint=self.endpoint,
            status=status,
        )
        m.inc("prompt_tokens_total", prompt, help="prompt tokens", model=self.model)
        m.inc("generation_tokens_total", completion, help="generated tokens", model=self.model)
        m.observe(
            "e2e_request_latency_seconds", time.monotonic() - self.start, help="request latency", model=self.model
        )
        longest = max(self.completion_tokens, default=0)
        if status == "ok" and self.first_token is not None and self.last_token is not None and longest > 1:
            tpot = (self.last_token - self.first_token) / (longest - 1)
            m.observe("time_per_output_token_seconds", tpot, help="TPOT (decode time per token)", model=self.model)


def _check_context(engine: Any, prompts: list[list[int]], params: SamplingParams, param: str) -> None:
    """The engine's context cap, and its waiting queue's bound on the prompts of one request (a
    retry could never pass it), enforced before any budget is charged or work queued."""
    queue = getattr(engine, "max_waiting", None)
    if isinstance(queue, int) and len(prompts) > max(queue, 1):  # (one prompt may always wait its turn)
        raise APIError(400, f"{len(prompts)} prompts in one request: this server queues at most {queue}", param=param)
    limit = getattr(engine, "max_model_len", None)
    if not isinstance(limit, int):
        return
    for ids in prompts:
        max_tokens = params.max_tokens if params.max_tokens is not None else limit - len(ids)
        if max_tokens < 1 or len(ids) + max_tokens > limit:
            raise PromptTooLongError(len(ids), max(max_tokens, 1), limit)


def charge_amount(engine: Any, prompts: list[list[int]], params: SamplingParams) -> int:
    """The ``llm_tokens`` a request is charged at admission: each prompt + ``max_tokens`` × ``n``
    (without ``max_tokens``, what the context window leaves it)."""
    limit = getattr(engine, "max_model_len", None) or 0
    total = 0
    for ids in prompts:
        max_tokens = params.max_tokens if params.max_tokens is not None else max(1, limit - len(ids))
        total += len(ids) + max_tokens * params.n
    return total


async def start_generation(
    request: Request,
    engine: Any,
    request_ids: list[str],
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    param: str,
    tracker: Tracker,
) -> MergedGeneration[RequestOutput]:
    """Check the context cap, charge the tenant's ``llm_tokens``, then submit one engine request
    per prompt and wait until all are admitted and producing. Admission errors become
    ``APIError`` (400/429/503) naming ``param`` and refund the charge; the others are aborted.
    Sets ``tracker.stream_header`` (the ``Server-Timing`` known before a stream's body)."""
    try:
        _check_context(engine, prompts, params, param)
    except PromptTooLongError as exc:
        raise as_api_error(exc, param) from exc
    tracker.charge = await charge(request, "llm_tokens", charge_amount(engine, prompts, params))
    sources: list[AsyncIterator[RequestOutput]] = []
    gen: MergedGeneration[RequestOutput] | None = None
    try:
        for rid, ids in zip(request_ids, prompts, strict=True):
            sources.append(engine.generate(rid, ids, params, priority=priority))
        gen = MergedGeneration(request, sources)
        await gen.start()
    except ClientDisconnected as exc:  # gone while queued: nothing to answer, nothing left running
        await tracker.charge.refund()
        raise APIError(499, "client closed the request", type="client_closed_request") from exc
    except Exception as exc:
        await tracker.charge.refund()
        if gen is None:
            for s in sources:
                if hasattr(s, "aclose"):
                    await s.aclose()  # type: ignore[attr-defined]
        raise as_api_error(exc, param) from exc
    tracker.stream_header = tracker.header_timing([item for _, item in gen.first_items()])
    return gen


async def collect(gen: MergedGeneration[RequestOutput], tracker: Tracker) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for idx, out in gen:
        tracker.update(idx, out)
        finals[idx] = out
    return finals


async def collect_or_raise(
    gen: MergedGeneration[RequestOutput], tracker: Tracker, param: str
) -> dict[int, RequestOutput] | None:
    """Final outputs of a non-streamed request; None when the client went away; engine errors
    are mapped to their OpenAI error (``param`` names the offending field)."""
    try:
        return await collect(gen, tracker)
    except ClientDisconnected:
        await tracker.done("disconnected")
        return None
    except Exception as exc:
        await tracker.done("error")
        raise as_api_error(exc, param) from exc


def sse_response(events: AsyncIterator[str], gen: MergedGeneration[Any], tracker: Tracker) -> ClosingStreamingResponse:
    """Stream ``events`` as SSE, then ``[DONE]``. Errors after the headers went out are reported
    in-band; whatever happens, the engine requests are closed and the tracker told how it ended."""

    async def stream() -> AsyncIterator[str]:
        status = "error"
        try:
            async for event in events:
                yield event
            status = "ok"
            yield SSE_DONE
        except (ClientDisconnected, asyncio.CancelledError, GeneratorExit) as exc:
            status = "disconnected"
            if not isinstance(exc, ClientDisconnected):
                raise
        except Exception as exc:
            mapped = from_engine_error(exc) or APIError(500, f"internal error: {type(exc).__name__}")
            yield sse(mapped.to_dict())
            yield SSE_DONE
        finally:
            await gen.aclose()
            await tracker.done(status)

    headers = {**SSE_HEADERS, "Server-Timing": tracker.stream_header}
    return ClosingStreamingResponse(stream(), media_type="text/event-stream", headers=headers)


def completion_logprobs(
    tokenizer: Any, lps: list[TokenLogprob] | None, offset: int, cache: dict[int, str]
) -> dict[str, Any] | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok = token_text(tokenizer, lp.token_id, cache)
        top = {token_text(tokenizer, t, cache): float(v) for t, v in lp.top}
        top.setdefault(tok, float(lp.logprob))
        tokens.append(tok)
        token_lps.append(float(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


def chat_logprobs(tokenizer: Any, lps: list[TokenLogprob] | None, cache: dict[int, str]) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        tok = token_text(tokenizer, lp.token_id, cache)
        top = []
        for t, v in lp.top:
            s = token_text(tokenizer, t, cache)
            top.append({"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8"))})
        content.append(
            {"token": tok, "logprob": float(lp.logprob), "bytes": list(tok.encode("utf-8")), "top_logprobs": top}
        )
    return {"content": content, "refusal": None}
