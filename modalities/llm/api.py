"""OpenAI-compatible text generation routes: ``/v1/completions`` and ``/v1/chat/completions``.

The engines live in ``app.state.engines`` (served model name -> ``AsyncEngine``). Chat prompts
are rendered with the tokenizer's own chat template into token ids; completion prompts are
tokenized with the tokenizer's default special-token behaviour, token-id prompts pass through.
Each completion prompt becomes one engine request; choices are numbered ``prompt_idx * n + i``.
"""

from __future__ import annotations

import functools
import inspect
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import APIRouter, Request, Response

from engine.offload import run_sized
from engine.outputs import CompletionOutput
from gateway.errors import APIError, disconnected_response
from gateway.streaming import sse
from modalities.llm.chat import render_chat, render_chat_text, tokenize_chat_text
from modalities.llm.protocol import ChatCompletionRequest, CompletionRequest
from modalities.llm.serving import (
    Tracker,
    chat_logprobs,
    collect_or_raise,
    completion_logprobs,
    refuse_oversized,
    resolve_engine,
    sse_response,
    start_generation,
    validate_ids,
)
from modalities.llm.structured import guided_grammar, reply_grammar
from modalities.llm.tools import (
    ToolCall,
    ToolCallStream,
    ToolError,
    check_tools,
    declared,
    forced_function,
    parse_tool_calls,
)

router = APIRouter(tags=["llm"], strict_content_type=False)


# --------------------------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------------------------


async def _grammar(
    body: CompletionRequest | ChatCompletionRequest,
    tools: list[dict[str, Any]] | None = None,
    tool_choice: Any = None,
    parallel: bool = True,
) -> str | None:
    """The grammar of ``body``'s reply (``reply_grammar``, or ``guided_grammar`` for vLLM's
    guided decoding), off the event loop when large (a big schema compiles for a while); its
    errors as 400s."""
    schema = body.response_format.schema_of_reply() if body.response_format else None
    guided = body.guided()
    if schema is None and not guided and tool_choice in (None, "auto", "none"):
        return None
    try:
        if guided:
            [(kind, value, param)] = guided
            if tools and tool_choice not in (None, "auto", "none"):
                raise ToolError(f"{param} cannot be combined with a tool_choice that asks for calls", param)
            return await run_sized(len(str(value)), guided_grammar, kind, value, param)
        size = len(str(schema)) + len(str(tools))
        return await run_sized(size, reply_grammar, schema, tools, tool_choice, parallel)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request, response: Response) -> Any:
    """OpenAI ``POST /v1/completions`` (streaming and not)."""
    model, engine = resolve_engine(request, body.model)
    tokenizer = engine.tokenizer
    grammar = await _grammar(body)
    try:
        params = body.to_sampling_params(grammar)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    prompts: list[list[int]] = []
    for p in body.prompts():
        if isinstance(p, str):
            refuse_oversized(getattr(engine, "max_model_len", None), tokenizer, p, "prompt")
        ids = list(await run_sized(len(p), tokenizer.encode, p)) if isinstance(p, str) else list(p)
        if not ids:
            raise APIError(400, "prompt must contain at least one token", param="prompt")
        validate_ids(ids, len(tokenizer), "prompt")
        prompts.append(ids)
    echo_texts = [p if isinstance(p, str) else tokenizer.decode(p) for p in body.prompts()] if body.echo else None
    request_id = f"cmpl-{uuid.uuid4().hex}"
    rids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
    tracker = Tracker(request, model, "completions", body.n, [len(p) for p in prompts])
    gen = await start_generation(request, engine, rids, prompts, params, body.priority, "prompt", tracker)
    created = int(time.time())
    n = body.n
    cache: dict[int, str] = {}

    if body.stream:

        async def events() -> AsyncIterator[str]:
            echoed: set[int] = set()
            text_len = [0] * (len(prompts) * n)
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
                        "logprobs": completion_logprobs(tokenizer, co.delta_logprobs, text_len[ci], cache),
                        "finish_reason": co.finish_reason,
                        "stop_reason": co.stop_reason,
                    }
                    text_len[ci] += len(text)
                    if co.finished:
                        tracker.finished.add(ci)
                    chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model}
                    chunk["choices"] = [choice]
                    if body.include_usage:
                        chunk["usage"] = tracker.usage() if body.continuous_usage else None
                    elif tracker.all_finished:
                        chunk["timing"] = tracker.timing()[1]
                    yield sse(chunk)
            if body.include_usage:
                chunk = {"id": request_id, "object": "text_completion", "created": created, "model": model}
                yield sse({**chunk, "choices": [], "usage": tracker.usage(), "timing": tracker.timing()[1]})

        return sse_response(events(), gen, tracker)

    finals = await collect_or_raise(gen, tracker, "prompt")
    if finals is None:
        return disconnected_response()
    response.headers["Server-Timing"] = tracker.timing()[0]
    choices = []
    for idx in range(len(prompts)):
        for co in sorted(finals[idx].outputs, key=lambda c: c.index):
            text = co.text if echo_texts is None else echo_texts[idx] + co.text
            choices.append(
                {
                    "index": idx * n + co.index,
                    "text": text,
                    "logprobs": completion_logprobs(tokenizer, co.logprobs, 0, cache),
                    "finish_reason": co.finish_reason,
                    "stop_reason": co.stop_reason,
                }
            )
    await tracker.done("ok")
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


@functools.cache
def _render_params() -> frozenset[str]:
    """``apply_chat_template``'s own parameters: what ``chat_template_kwargs`` may not set."""
    from transformers import PreTrainedTokenizerBase  # (not at import: the CLI starts light)

    return frozenset(inspect.signature(PreTrainedTokenizerBase.apply_chat_template).parameters) - {"kwargs"}


def _chat_prompt_ids(tokenizer: Any, body: ChatCompletionRequest, limit: int, size: int) -> list[int]:
    """The prompt's ids; a 400 for one that ``size`` characters of content may make too long for
    ``limit`` tokens, from its rendered text before it is tokenized (``refuse_oversized``)."""
    if not getattr(tokenizer, "chat_template", None):
        raise APIError(400, "this model has no chat template; use /v1/completions instead", param="messages")
    try:
        messages = body.template_messages()
    except ValueError as exc:
        raise APIError(400, str(exc), param="messages") from exc
    kwargs: dict[str, Any] = dict(body.chat_template_kwargs or {})
    reserved = sorted(set(kwargs) & _render_params())
    if reserved:  # a client's own template (unbounded Jinja) or tokenizer options (padding to 10M)
        raise APIError(
            400,
            f"chat_template_kwargs sets the template's variables only, not {reserved[0]!r}",
            param=f"chat_template_kwargs.{reserved[0]}",
            code="invalid_value",
        )
    if body.tools is not None:
        kwargs["tools"] = body.tools
    kwargs.update(add_generation_prompt=body.add_generation_prompt, continue_final_message=body.continue_final_message)
    try:
        if size >= limit:  # (a template may drop or trim content: the rendered text is what counts)
            text = render_chat_text(tokenizer, messages, **kwargs)
            refuse_oversized(limit, tokenizer, text, "messages")
            return tokenize_chat_text(tokenizer, text)
        return render_chat(tokenizer, messages, **kwargs)
    except APIError:
        raise
    except Exception as exc:  # template errors (e.g. roles must alternate) are the caller's input
        raise APIError(400, f"the chat template could not render these messages: {exc}", param="messages") from exc


@dataclass(frozen=True)
class _Calls:
    """How a chat reply's tool calls are taken."""

    names: frozenset[str]  # the functions declared
    one: bool  # the first call only (``parallel_tool_calls: false``)
    finish: str  # a reply with calls: "tool_calls", or "stop" when tool_choice named the function (as OpenAI's)


def _chat_choice_chunk(
    co: CompletionOutput,
    tokenizer: Any,
    cache: dict[int, str],
    want_lp: bool,
    calls: ToolCallStream | None,
    policy: _Calls | None,
) -> dict[str, Any]:
    """One choice's delta; with ``calls``, its text goes through the tool-call parser, and the
    calls stream as OpenAI's do: each announced once its name is read, then its arguments as
    they are written (a call the parser can only read whole comes whole)."""
    delta: dict[str, Any] = {"content": co.delta_text}
    finish = co.finish_reason
    if calls is not None and policy is not None:
        delta["content"] = calls.feed(co.delta_text)
        if co.finished:
            delta["content"] += calls.finish()[0]
        updates = [d for d in calls.deltas() if not policy.one or d["index"] == 0]
        if updates:
            delta["tool_calls"] = updates
        if updates or (co.finished and calls.calls):
            delta["content"] = delta["content"] or None
        if co.finished and calls.calls:
            finish = policy.finish if finish == "stop" else finish
    return {
        "index": co.index,
        "delta": delta,
        "logprobs": chat_logprobs(tokenizer, co.delta_logprobs, cache) if want_lp else None,
        "finish_reason": finish,
        "stop_reason": co.stop_reason,
    }


def _chat_message(co: CompletionOutput, policy: _Calls | None) -> tuple[dict[str, Any], str | None]:
    """A finished choice's message and finish reason (calls parsed out with a ``policy``)."""
    text, calls = parse_tool_calls(co.text, policy.names) if policy else (co.text, list[ToolCall]())
    message: dict[str, Any] = {"role": "assistant", "content": text, "refusal": None}
    if not calls or policy is None:
        return message, co.finish_reason
    calls = calls[:1] if policy.one else calls
    message.update(content=text.strip() or None, tool_calls=[c.to_openai() for c in calls])
    return message, policy.finish if co.finish_reason == "stop" else co.finish_reason


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request, response: Response) -> Any:
    """OpenAI ``POST /v1/chat/completions`` (streaming and not)."""
    model, engine = resolve_engine(request, body.model)
    tokenizer = engine.tokenizer
    try:
        parse = check_tools(body.tools, body.tool_choice, tokenizer)
    except ToolError as exc:
        raise APIError(400, str(exc), param=exc.param, code="invalid_value") from exc
    one_call, names = body.parallel_tool_calls is False, declared(body.tools)
    named = forced_function(body.tool_choice, "tool_choice") is not None
    policy = _Calls(names, one_call, "stop" if named else "tool_calls") if parse else None
    grammar = await _grammar(body, body.tools if parse else None, body.tool_choice, not one_call)
    size = sum(len(str(m.content or "")) for m in body.messages) + len(str(body.tools or ""))
    prompt_ids = await run_sized(size, _chat_prompt_ids, tokenizer, body, int(engine.max_model_len), size)
    try:
        params = body.to_sampling_params(len(prompt_ids), int(engine.max_model_len), grammar)
    except ValueError as exc:
        raise APIError(400, str(exc)) from exc
    request_id = f"chatcmpl-{uuid.uuid4().hex}"
    tracker = Tracker(request, model, "chat_completions", body.n, [len(prompt_ids)])
    gen = await start_generation(
        request, engine, [request_id], [prompt_ids], params, body.priority, "messages", tracker
    )
    created = int(time.time())
    cache: dict[int, str] = {}
    want_lp = body.logprobs

    if body.stream:

        def chunk(choices: list[dict[str, Any]]) -> dict[str, Any]:
            out = {"id": request_id, "object": "chat.completion.chunk", "created": created, "model": model}
            out["choices"] = choices
            if body.include_usage:
                out["usage"] = tracker.usage() if body.continuous_usage else None
            return out

        async def events() -> AsyncIterator[str]:
            calls = {i: ToolCallStream(names) for i in range(body.n)} if policy else {}
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
                    choice = _chat_choice_chunk(co, tokenizer, cache, want_lp, calls.get(co.index), policy)
                    if policy and choice["delta"]["content"] == "" and not (co.finished or want_lp):
                        continue  # text held back: it may open a call
                    data = chunk([choice])
                    if not body.include_usage and tracker.all_finished:
                        data["timing"] = tracker.timing()[1]
                    yield sse(data)
            if body.include_usage:
                yield sse({**chunk([]), "usage": tracker.usage(), "timing": tracker.timing()[1]})

        return sse_response(events(), gen, tracker)

    finals = await collect_or_raise(gen, tracker, "messages")
    if finals is None:
        return disconnected_response()
    response.headers["Server-Timing"] = tracker.timing()[0]
    choices = []
    for co in sorted(finals[0].outputs, key=lambda c: c.index):
        message, finish = _chat_message(co, policy)
        choices.append(
            {
                "index": co.index,
                "message": message,
                "logprobs": chat_logprobs(tokenizer, co.logprobs, cache) if want_lp else None,
                "finish_reason": finish,
                "stop_reason": co.stop_reason,
            }
        )
    await tracker.done("ok")
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": tracker.usage(),
        "system_fingerprint": None,
    }
