"""OpenAI-compatible text generation routes: ``/v1/completions`` and ``/v1/chat/completions``.

The engines live in ``app.state.engines`` (served model name -> ``AsyncEngine``). Chat prompts
are rendered with the tokenizer's own chat template into token ids; completion prompts are
tokenized with the tokenizer's default special-token behaviour, token-id prompts pass through.
Each completion prompt becomes one engine request; choices are numbered ``prompt_idx * n + i``.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, StreamingResponse

from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from gateway.errors import APIError, from_engine_error, model_not_found
from gateway.streaming import SSE_DONE, SSE_HEADERS, ClientDisconnected, MergedGeneration, sse
from modalities.llm.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
)

router = APIRouter(tags=["llm"], strict_content_type=False)


# --------------------------------------------------------------------------------------------
# helpers
# --------------------------------------------------------------------------------------------


def resolve_engine(request: Request, model: str | None) -> tuple[str, Any]:
    """``(served_name, engine)`` for ``model``; the only engine when ``model`` is omitted."""
    engines: dict[str, Any] = request.app.state.engines
    if model is None:
        if len(engines) == 1:
            return next(iter(engines.items()))
        raise APIError(400, "you must provide a model parameter", param="model")
    if model not in engines:
        raise model_not_found(model, list(engines))
    return model, engines[model]


def _token_text(tokenizer: Any, token_id: int, cache: dict[int, str]) -> str:
    text = cache.get(token_id)
    if text is None:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        cache[token_id] = text
    return text


def _validate_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is out of range for a vocabulary of {vocab_size} tokens", param=param)


def _admit_error(exc: BaseException, param: str) -> BaseException:
    mapped = from_engine_error(exc, param=param)
    return mapped if mapped is not None else exc


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


class _Tracker:
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

    def usage(self) -> dict[str, int]:
        return _usage(sum(self.prompt_tokens), sum(self.completion_tokens))

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


async def _start(
    request: Request,
    engine: Any,
    request_ids: list[str],
    prompts: list[list[int]],
    params: SamplingParams,
    priority: int,
    param: str,
) -> MergedGeneration[RequestOutput]:
    sources: list[AsyncIterator[RequestOutput]] = []
    gen: MergedGeneration[RequestOutput] | None = None
    try:
        for rid, ids in zip(request_ids, prompts, strict=True):
            sources.append(engine.generate(rid, ids, params, priority=priority))
        gen = MergedGeneration(request, sources)
        await gen.start()
    except ClientDisconnected:
        raise
    except Exception as exc:
        if gen is None:
            for s in sources:
                if hasattr(s, "aclose"):
                    await s.aclose()  # type: ignore[attr-defined]
        raise _admit_error(exc, param) from exc
    return gen


async def _collect(gen: MergedGeneration[RequestOutput], tracker: _Tracker) -> dict[int, RequestOutput]:
    finals: dict[int, RequestOutput] = {}
    async for idx, out in gen:
        tracker.update(idx, out)
        finals[idx] = out
    return finals


def _disconnected_response() -> JSONResponse:
    return APIError(499, "client closed the request", type="client_closed_request").response()


# --------------------------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------------------------


def _completion_logprobs(
    tokenizer: Any, lps: list[TokenLogprob] | None, offset: int, cache: dict[int, str]
) -> dict[str, Any] | None:
    if lps is None:
        return None
    tokens, token_lps, tops, offsets = [], [], [], []
    for lp in lps:
        tok = _token_text(tokenizer, lp.token_id, cache)
        top = {_token_text(tokenizer, t, cache): float(v) for t, v in lp.top}
        top.setdefault(tok, float(lp.logprob))
        tokens.append(tok)
        token_lps.append(float(lp.logprob))
        tops.append(top)
        offsets.append(offset)
        offset += len(tok)
    return {"text_offset": offsets, "token_logprobs": token_lps, "tokens": tokens, "top_logprobs": tops}


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Any:
    """OpenAI ``POST /v1/completions`` (streaming and not)."""
    model, engine = resolve_engine(request, body.model)
    tokenizer = engine.tokenizer
    try:
        params = body.to_sampling_params()
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    prompts: list[list[int]] = []
    for p in body.prompts():
        ids = list(tokenizer.encode(p)) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        _validate_ids(ids, len(tokenizer), "prompt")
        prompts.append(ids)
    echo_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompts()] if body.echo else None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    rids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    tracker = _Tracker(request, model, "completions", body.n, len(prompts))
    gen = await _start(request, engine, rids, prompts, params, body.priority, "prompt")
    created = int(time.time())
    n = body.n
    cache: dict[int, str] = {}

    if body.stream:

        async def stream() -> AsyncIterator[str]:
            status = "error"
            echoed: set[int] = set()
            text_len = [0] * (len(prompts) * n)
            try:
                async for idx, out in gen:
                    tracker.update(idx, out)
                    for co in out.outputs:
                        ci = idx * n + co.index
                        if ci in tracker.finished or not (co.delta_text or co.delta_token_ids or co.finished):
                            continue
                        text = co.delta_text
                        if echo_texts is not None and ci not in echoed:
                            echoed.add(ci)
                            text = echo_texts[idx] + text
                        choice = {
                            "index": ci,
                            "text": text,
                            "logprobs": _completion_logprobs(tokenizer, co.delta_logprobs, text_len[ci], cache),
                            "finish_reason": co.finish_reason,
                            "stop_reason": co.stop_reason,
                        }
                        text_len[ci] += len(text)
                        if co.finished:
                            tracker.finished.add(ci)
                        chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model}
                        chunk["choices"] = [choice]
                        if body.include_usage:
                            chunk["usage"] = None
                        yield sse(chunk)
                if body.include_usage:
                    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model}
                    yield sse({**chunk, "choices": [], "usage": tracker.usage()})
                status = "ok"
                yield SSE_DONE
            except (ClientDisconnected, asyncio.CancelledError, GeneratorExit) as exc:
                status = "disconnected"
                if not isinstance(exc, ClientDisconnected):
                    raise
            except Exception as exc:  # after the headers went out: report in-band
                mapped = from_engine_error(exc) or APIError(500, f"internal error: {type(exc).__name__}")
                yield sse(mapped.to_dict())
                yield SSE_DONE
            finally:
                await gen.aclose()
                tracker.done(status)

        return StreamingResponse(stream(), media_type="text/event-stream", headers=SSE_HEADERS)

    try:
        finals = await _collect(gen, tracker)
    except ClientDisconnected:
        tracker.done("disconnected")
        return _disconnected_response()
    except Exception as exc:
        tracker.done("error")
        raise _admit_error(exc, "prompt") from exc
    choices = []
    for idx in range(len(prompts)):
        for co in sorted(finals[idx].outputs, key=lambda c: c.index):
            text = co.text if echo_texts is None else echo_texts[idx] + co.text
            choices.append(
                {
                    "index": idx * n + co.index,
                    "text": text,
                    "logprobs": _completion_logprobs(tokenizer, co.logprobs, 0, cache),
                    "finish_reason": co.finish_reason,
                    "stop_reason": co.stop_reason,
                }
            )
    tracker.done("ok")
    return {
        "id": request_id,
        "object": "text_completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": tracker.usage(),
        "system_fingerprint": None,
    }


# --------------------------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------------------------


def _chat_prompt_ids(tokenizer: Any, body: ChatCompletionRequest) -> list[int]:
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions instead", param="messages")
    try:
        messages = body.template_messages()
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    if body.tools is not None:
        kwargs["tools"] = body.tools
    try:
        ids: Any = tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=body.add_generation_prompt,
            continue_final_message=body.continue_final_message,
            tokenize=True,
            return_dict=False,
            **kwargs,
        )
    except Exception as exc:  # template errors (e.g. roles must alternate) are the caller's input
        raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from exc
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    if ids and isinstance(ids[0], list):
        ids = ids[0]
    return [int(t) for t in ids]


def _chat_logprobs(tokenizer: Any, lps: list[TokenLogprob] | None, cache: dict[int, str]) -> dict[str, Any] | None:
    if lps is None:
        return None
    content = []
    for lp in lps:
        tok = _token_text(tokenizer, lp.token_id, cache)
        top = []
        for t, v in lp.top:
            s = _token_text(tokenizer, t, cache)
            top.append({"token": s, "logprob": float(v), "bytes": list(s.encode("utf-8"))})
        content.append(
            {"token": tok, "logprob": float(lp.logprob), "bytes": list(tok.encode("utf-8")), "top_logprobs": top}
        )
    return {"content": content, "refusal": None}


def _chat_choice_chunk(co: CompletionOutput, tokenizer: Any, cache: dict[int, str], want_lp: bool) -> dict[str, Any]:
    return {
        "index": co.index,
        "delta": {"content": co.delta_text},
        "logprobs": _chat_logprobs(tokenizer, co.delta_logprobs, cache) if want_lp else None,
        "finish_reason": co.finish_reason,
        "stop_reason": co.stop_reason,
    }


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Any:
    """OpenAI ``POST /v1/chat/completions`` (streaming and not)."""
    model, engine = resolve_engine(request, body.model)
    tokenizer = engine.tokenizer
    prompt_ids = _chat_prompt_ids(tokenizer, body)
    try:
        params = body.to_sampling_params(len(prompt_ids), int(engine.max_model_len))
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    tracker = _Tracker(request, model, "chat_completions", body.n, 1)
    gen = await _start(request, engine, [request_id], [prompt_ids], params, body.priority, "messages")
    created = int(time.time())
    cache: dict[int, str] = {}
    want_lp = body.logprobs

    if body.stream:

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            out = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
            out["choices"] = choices
            if body.include_usage:
                out["usage"] = None
            return out

        async def stream() -> AsyncIterator[str]:
            status = "error"
            try:
                for i in range(body.n):
                    role = {"role": "assistant", "content": ""}
                    yield sse(chunk([{"index": i, "delta": role, "logprobs": None, "finish_reason": None}]))
                async for idx, out in gen:
                    tracker.update(idx, out)
                    for co in out.outputs:
                        if co.index in tracker.finished or not (co.delta_text or co.delta_token_ids or co.finished):
                            continue
                        if co.finished:
                            tracker.finished.add(co.index)
                        yield sse(chunk([_chat_choice_chunk(co, tokenizer, cache, want_lp)]))
                if body.include_usage:
                    yield sse({**chunk([]), "usage": tracker.usage()})
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

    try:
        finals = await _collect(gen, tracker)
    except ClientDisconnected:
        tracker.done("disconnected")
        return _disconnected_response()
    except Exception as exc:
        tracker.done("error")
        raise _admit_error(exc, "messages") from exc
    choices = [
        {
            "index": co.index,
            "message": {"role": "assistant", "content": co.text, "refusal": None},
            "logprobs": _chat_logprobs(tokenizer, co.logprobs, cache) if want_lp else None,
            "finish_reason": co.finish_reason,
            "stop_reason": co.stop_reason,
        }
        for co in sorted(finals[0].outputs, key=lambda c: c.index)
    ]
    tracker.done("ok")
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": tracker.usage(),
        "system_fingerprint": None,
    }
