"""OpenAI-compatible request/response models for ``/v1/completions`` and ``/v1/chat/completions``.

Requests accept the OpenAI fields plus vLLM's sampling extras (``top_k``, ``min_p``,
``repetition_penalty``, ``ignore_eos``, ``min_tokens``, ``stop_token_ids``,
``skip_special_tokens``, ``include_stop_str_in_output``, ``priority`` >= 0). Unknown fields are
ignored, as OpenAI does. Documented limitations (rejected with a 400 naming the field):
completions ``echo`` together with ``logprobs`` (prompt logprobs are not computed), ``suffix``, and
``best_of`` different from ``n``. ``response_format`` (``json_object``, ``json_schema``) and
``tool_choice`` ("required" or a named function) hold the reply to a grammar
(``modalities.llm.structured``).
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from engine.sampling_params import SamplingParams

MAX_N = 16
MAX_LOGPROBS = 20


class _Model(BaseModel):
    # Strict: JSON's true is no number and "3" no integer (pydantic would take both); no inf/NaN.
    model_config = ConfigDict(extra="ignore", protected_namespaces=(), strict=True, allow_inf_nan=False)


class StreamOptions(_Model):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JSONSchemaFormat(_Model):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")  # (None: any JSON)
    strict: bool | None = None  # (the reply always follows the schema)


class ResponseFormat(_Model):
    type: Literal["text", "json_object", "json_schema"] = "text"
    json_schema: JSONSchemaFormat | None = None

    @model_validator(mode="after")
    def _check_schema(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise ValueError("response_format of type 'json_schema' needs a 'json_schema' object")
        return self

    def schema_of_reply(self) -> dict[str, Any] | None:
        """The JSON schema the reply must follow (None: free text)."""
        if self.type == "json_object":
            return {"type": "object"}
        if self.type == "json_schema" and self.json_schema is not None:
            return self.json_schema.schema_ or {}
        return None


class StructuredOutputs(_Model):
    """vLLM's ``structured_outputs`` (the newer name of its ``guided_*`` fields)."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class _SamplingRequest(_Model):
    """Fields shared by completions and chat completions."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=-(1 << 63), lt=1 << 64)  # torch's generator range
    presence_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    frequency_penalty: float = Field(default=0.0, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0.0, le=1.0)
    repetition_penalty: float | None = Field(default=None, gt=0.0)
    ignore_eos: bool = False
    min_tokens: int = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0  # lower first under --scheduling-policy priority
    # vLLM's guided decoding: at most one (``modalities.llm.structured.guided_grammar``)
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None

    @field_validator("priority")
    @classmethod
    def _check_priority(cls, v: int) -> int:
        # A client sending -1 would go ahead of live voice turns (engine.foreground.INTERACTIVE).
        if v < 0:
            raise ValueError(f"priority must be >= 0 (negative priorities are kept for live voice turns), got {v}")
        return v

    @field_validator("stop")
    @classmethod
    def _check_stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError(f"at most 16 stop strings are supported, got {len(stops)}")
        return v

    @field_validator("logit_bias")
    @classmethod
    def _check_logit_bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not (key.isascii() and key.isdigit()):  # ("٣".isdigit() too; int() took it as 3)
                raise ValueError(f"logit_bias keys must be token ids, got {key!r}")
            if not -100 <= bias <= 100:
                raise ValueError(f"logit_bias values must be in [-100, 100], got {bias}")
        return v

    @model_validator(mode="after")
    def _check_guided(self) -> _SamplingRequest:
        guided = self.guided()
        if len(guided) > 1:
            raise ValueError("give at most one of guided_json, guided_regex, guided_choice, guided_grammar")
        if guided and self.response_format is not None and self.response_format.schema_of_reply() is not None:
            raise ValueError("guided decoding cannot be combined with a JSON response_format")
        return self

    def guided(self) -> list[tuple[str, Any, str]]:
        """vLLM's guided decoding fields given, as ``(kind, value, param)``."""
        s = self.structured_outputs
        fields = [
            ("json", self.guided_json, "guided_json"),
            ("regex", self.guided_regex, "guided_regex"),
            ("choice", self.guided_choice, "guided_choice"),
            ("grammar", self.guided_grammar, "guided_grammar"),
        ]
        if s is not None:
            fields += [
                (k, getattr(s, "json_" if k == "json" else k), f"structured_outputs.{k}") for k, _, _ in fields[:4]
            ]
        return [(kind, value, param) for kind, value, param in fields if value is not None]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    @property
    def continuous_usage(self) -> bool:
        """Every chunk carries the usage so far (vLLM's ``stream_options.continuous_usage_stats``,
        with ``include_usage``), not only the last."""
        return self.include_usage and bool(self.stream_options and self.stream_options.continuous_usage_stats)

    def _sampling_kwargs(self) -> dict[str, Any]:
        return dict(
            n=self.n,
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0,
            min_p=self.min_p or 0.0,
            repetition_penalty=1.0 if self.repetition_penalty is None else self.repetition_penalty,
            presence_penalty=self.presence_penalty,
            frequency_penalty=self.frequency_penalty,
            logit_bias={int(k): float(b) for k, b in self.logit_bias.items()} if self.logit_bias else None,
            seed=self.seed,
            min_tokens=self.min_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else list(self.stop or []),
            stop_token_ids=list(self.stop_token_ids or []),
            ignore_eos=self.ignore_eos,
            include_stop_str_in_output=self.include_stop_str_in_output,
            skip_special_tokens=self.skip_special_tokens,
        )


# --------------------------------------------------------------------------------------------
# /v1/completions
# --------------------------------------------------------------------------------------------

PromptType = str | list[int] | list[list[int]] | list[str]


class CompletionRequest(_SamplingRequest):
    """``POST /v1/completions``. ``prompt`` may be a string, a list of strings, a list of token
    ids or a list of token-id lists; each prompt becomes one engine request with ``n`` samples."""

    prompt: PromptType
    max_tokens: int | None = Field(default=16, ge=1)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @field_validator("prompt", mode="before")
    @classmethod
    def _check_prompt_shape(cls, v: Any) -> Any:
        def is_ids(x: Any) -> bool:
            return isinstance(x, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in x)

        ok = isinstance(v, str) or (
            isinstance(v, list) and (is_ids(v) or all(isinstance(p, str) for p in v) or all(is_ids(p) for p in v))
        )
        if not ok:
            raise ValueError(
                "prompt must be a string, a list of strings, a list of token ids, or a list of token-id lists"
            )
        return v

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, v: PromptType) -> PromptType:
        if isinstance(v, list):
            if not v:
                raise ValueError("prompt must not be an empty list")
            if any(isinstance(p, list) and not p for p in v):
                raise ValueError("token-id prompts must not be empty")
            if any(isinstance(t, int) and t < 0 for t in v):
                raise ValueError("token ids must be non-negative")
            if any(isinstance(p, list) and any(t < 0 for t in p) for p in v):
                raise ValueError("token ids must be non-negative")
        return v

    @model_validator(mode="after")
    def _check_unsupported(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("'suffix' is not supported (no fill-in-the-middle)")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("'best_of' different from 'n' is not supported")
        if self.echo and self.logprobs is not None:
            raise ValueError("'echo' together with 'logprobs' is not supported: prompt logprobs are not computed")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The prompts as a list (strings or token-id lists)."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and all(isinstance(t, int) for t in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]

    def to_sampling_params(self, grammar: str | None = None) -> SamplingParams:
        """Engine sampling parameters; ``max_tokens`` defaults to 16 as in OpenAI."""
        return SamplingParams(
            **self._sampling_kwargs(), max_tokens=self.max_tokens or 16, logprobs=self.logprobs, grammar=grammar
        )


class CompletionLogprobs(_Model):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(_Model):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class Usage(_Model):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class CompletionResponse(_Model):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionStreamResponse(CompletionResponse):
    """One SSE chunk of a streamed completion (same shape as the non-streamed response)."""


# --------------------------------------------------------------------------------------------
# /v1/chat/completions
# --------------------------------------------------------------------------------------------


class ContentPart(_Model):
    type: str
    text: str | None = None

    @model_validator(mode="after")
    def _check_text(self) -> ContentPart:
        if self.type == "text" and self.text is None:
            raise ValueError("a 'text' content part needs its 'text'")
        return self


class ChatMessage(_Model):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_tool_turns(self) -> ChatMessage:
        """A tool's message names its call; an assistant's calls are named functions (the chat
        template renders them, and a malformed one would fail there with a template error); only
        an assistant's message with calls, or a legacy function's, may go without content (OpenAI's
        ``null``)."""
        if self.content is None and not (self.role == "assistant" and self.tool_calls) and self.role != "function":
            raise ValueError(
                f"a '{self.role}' message needs 'content'" + (" or 'tool_calls'" * (self.role == "assistant"))
            )
        if self.role == "tool" and not self.tool_call_id:
            raise ValueError("a 'tool' message needs the 'tool_call_id' of the call it answers")
        for call in self.tool_calls or []:
            fn = call.get("function")
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
                raise ValueError("each tool call needs a 'function' with a 'name' and 'arguments'")
            if not isinstance(fn.get("arguments"), str | dict):
                raise ValueError("a tool call's 'arguments' is a JSON object as a string")
        return self

    def text(self) -> str | None:
        """The content as one string: text parts joined by newlines; other parts are rejected."""
        if self.content is None or isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.type != "text":
                raise ValueError(f"content part type {part.type!r} is not supported by this (text-only) model")
            texts.append(part.text or "")
        return "\n".join(texts)

    def to_template_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"role": self.role, "content": self.text() or ""}  # (templates read it as text)
        for key in ("name", "tool_calls", "tool_call_id"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class ChatCompletionRequest(_SamplingRequest):
    """``POST /v1/chat/completions``. The messages are rendered with the tokenizer's own chat
    template; ``max_tokens`` defaults to the rest of the context window."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # vLLM extras for the template
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("'top_logprobs' requires 'logprobs' to be true")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("'continue_final_message' and 'add_generation_prompt' cannot both be true")
        return self

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as plain dicts for ``tokenizer.apply_chat_template``."""
        return [m.to_template_dict() for m in self.messages]

    def to_sampling_params(
        self, num_prompt_tokens: int, max_model_len: int, grammar: str | None = None
    ) -> SamplingParams:
        """Engine sampling parameters; without ``max_tokens`` the rest of the context is allowed;
        ``grammar``: what ``response_format`` and ``tool_choice`` hold the reply to."""
        max_tokens = self.max_completion_tokens or self.max_tokens
        if max_tokens is None:
            max_tokens = max(1, max_model_len - num_prompt_tokens)
        logprobs = (self.top_logprobs or 0) if self.logprobs else None
        return SamplingParams(**self._sampling_kwargs(), max_tokens=max_tokens, logprobs=logprobs, grammar=grammar)


class TopLogprob(_Model):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Model):
    content: list[ChatLogprob] | None = None
    refusal: list[ChatLogprob] | None = None


class ChatResponseMessage(_Model):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None


class ChatChoice(_Model):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Model):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class DeltaMessage(_Model):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatStreamChoice(_Model):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionStreamResponse(_Model):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


# --------------------------------------------------------------------------------------------
# /v1/models
# --------------------------------------------------------------------------------------------


class ModelCard(_Model):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "mmserve"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Model):
    object: Literal["list"] = "list"
    data: list[ModelCard] = Field(default_factory=list)
