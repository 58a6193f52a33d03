"""Helpers shared by the LLM routes: engine lookup, admission, fan-in, usage/metrics
bookkeeping, and OpenAI logprob formatting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.async_engine import AsyncEngine
from engine.outputs import RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from gateway.errors import APIError, from_engine_error, model_not_found
from gateway.streaming import SSE_DONE, SSE_HEADERS, ClientDisconnected, MergedGeneration, sse


def resolve_engine(request: Request, model: str | None) -> tuple[str, Any]:
    """``(served_name, engine)`` for ``model``; the only LLM engine when ``model`` is omitted.
    Naming a model of another modality (e.g. an embedding model) is a 400."""
    engines: dict[str, Any] = request.app.state.engines
    llms = {name: e for name, e in engines.items() if isinstance(e, AsyncEngine)}
    if model is None:
        if len(llms) == 1:
            return next(iter(llms.items()))
        raise APIError(400, "you must provide a model parameter", param="model")
    if model not in engines:
        model = getattr(request.app.state, "aliases", {}).get(model, model)
    if model not in engines:
        raise model_not_found(model, list(engines))
    if model not in llms:
        raise APIError(400, f"model {model!r} does not generate text", param="model")
    return model, llms[model]


def token_text(tokenizer: Any, token_id: int, cache: dict[int, str]) -> str:
    text = cache.get(token_id)
    if text is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        cache[token_id] = text
    return text


def validate_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range for a vocabulary of {vocab_size} tokens", param=param)


def admit_error(exc: BaseException, param: str) -> BaseException:
    mapped = from_engine_error(exc, param=param)
    return mapped if mapped is not None else exc


def usage_dict(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class Tracker:
    """Per-response bookkeeping: token counts, finished choices, metrics."""

    def __init__(self, request: Request, model: str, endpoint: str, n: int, num_prompts: int) -> None:
        self.metrics = getattr(request.app.state, "metrics", None)
        self.model, self.endpoint, self.n = model, endpoint, n
        self.start = time.monotonic()
        self.first_token: float | None = None
        self.prompt_tokens = [0] * num_prompts
        self.completion_tokens = [0] * (num_prompts * n)
        self.finished: set[int] = set()

    def update(self, prompt_idx: int, out: RequestOutput) -> None:
        self.prompt_tokens[prompt_idx] = len(out.prompt_token_ids)
        for co in out.outputs:
            self.completion_tokens[prompt_idx * self.n + co.index] = len(co.token_ids)
        if self.first_token is None and any(co.token_ids for co in out.outputs):
            self.first_token = time.monotonic()
            if self.metrics is not None:
                self.metrics.observe(
                    "time_to_first_token_seconds", self.first_token - self.start, help="TTFT", model=self.model
                )

    def server_timing(self, finals: list[RequestOutput]) -> str:
        """``Server-Timing`` value: queue (arrival → first scheduled, worst prompt), inference
        (first scheduled → now) and total (request received → now), in ms."""
        now = time.time()
        scheduled = [o.metrics.get("scheduled_time", now) for o in finals]
        queue = max((s - o.metrics.get("arrival_time", s) for s, o in zip(scheduled, finals, strict=True)), default=0.0)
        inference = now - min(scheduled, default=now)
        total = time.monotonic() - self.start
        return f"queue;dur={queue * 1e3:.1f}, inference;dur={inference * 1e3:.1f}, total;dur={total * 1e3:.1f}"

    def usage(self) -> dict[str, int]:
        return usage_dict(sum(self.prompt_tokens), sum(self.completion_tokens))

    def done(self, status: str) -> None:
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
        m.inc("prompt_tokens_total", sum(self.prompt_tokens), help="prompt tokens", model=self.model)
        m.inc("generation_tokens_total", sum(self.completion_tokens), help="generated tokens", model=self.model)
        m.observe(
            "e2e_request_latency_seconds", time.monotonic() - self.start, help="request latency", model=self.model
        )


async def start_generation(
    request: Request,
    engine: Any,
    request_ids: list[str],
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    param: str,
) -> MergedGeneration[RequestOutput]:
    """Submit one engine request per prompt and wait until all are admitted and producing.
    Admission errors become ``APIError`` (400/429/503) naming ``param``; the others are aborted."""
    sources: list[AsyncIterator[RequestOutput]] = []
    gen: MergedGeneration[RequestOutput] | None = None
    try:
        for rid, ids in zip(request_ids, prompts, strict=True):
            sources.append(engine.generate(rid, ids, params, priority=priority))
        gen = MergedGeneration(request, sources)
        await gen.start()
    except ClientDisconnected as exc:  # gone while queued: nothing to answer, nothing left running
        raise APIError(499, "client closed the request", type="client_closed_request") from exc
    except Exception as exc:
        if gen is None:
            for s in sources:
                if hasattr(s, "aclose"):
                    await s.aclose()  # type: ignore[attr-defined]
        raise admit_error(exc, param) from exc
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
        tracker.done("disconnected")
        return None
    except Exception as exc:
        tracker.done("error")
        raise admit_error(exc, param) from exc


def sse_response(events: AsyncIterator[str], gen: MergedGeneration[Any], tracker: Tracker) -> StreamingResponse:
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
            tracker.done(status)

    return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)


def disconnected_response() -> JSONResponse:
    return APIError(499, "client closed the request", type="client_closed_request").response()


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
