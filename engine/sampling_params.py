"""Per-request sampling parameters (the engine's user-facing knobs)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from engine.errors import check_token_ids


@dataclass
class SamplingParams:
    """How to pick tokens and when to stop.

    ``temperature == 0`` means greedy. ``top_k <= 0`` disables top-k. ``logprobs`` is the
    number of top alternatives to report per token (``None``: no logprobs at all, ``0``: only
    the chosen token's logprob).
    """

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    # Only these ids may be sampled (vLLM's allowed_token_ids; e.g. audio-codec tokens for AR TTS).
    allowed_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # False: token ids only, no text (vLLM's ``detokenize``; e.g. audio-codec tokens for AR TTS).
    detokenize: bool = True
    # Tokens banned for the first generated token only (Whisper's begin_suppress_tokens).
    begin_suppress_token_ids: list[int] = field(default_factory=list)
    # Report progress every this many new tokens (and at the end), like vLLM's stream_interval:
    # a consumer that acts on groups of tokens (AR TTS: codec frames) is woken once per group.
    stream_interval: int = 1
    # Tokens constrained to this grammar (``engine.structured``: JSON schema or Lark), e.g.
    # response_format json_schema or a required tool call; the sequence ends once it is complete.
    grammar: str | None = None

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.verify()

    @property
    def greedy(self) -> bool:
        return self.temperature < 1e-5

    def check_vocab(self, vocab_size: int) -> None:
        """Raise ``InvalidParamError`` for a token id outside the vocabulary (``check_token_ids``)."""
        check_token_ids(self.logit_bias or (), vocab_size, "logit_bias")
        check_token_ids(self.stop_token_ids, vocab_size, "stop_token_ids")
        check_token_ids(self.allowed_token_ids or (), vocab_size, "allowed_token_ids")
        check_token_ids(self.begin_suppress_token_ids, vocab_size, "begin_suppress_token_ids")

    def verify(self) -> None:
        """Raise ``ValueError`` naming the first invalid field."""
        checks = [
            (self.n >= 1, f"n must be at least 1, got {self.n}"),
            (self.temperature >= 0, f"temperature must be non-negative, got {self.temperature}"),
            (0 < self.top_p <= 1, f"top_p must be in (0, 1], got {self.top_p}"),
            (self.top_k >= -1, f"top_k must be -1 (disable), 0 (disable) or positive, got {self.top_k}"),
            (0 <= self.min_p <= 1, f"min_p must be in [0, 1], got {self.min_p}"),
            (self.repetition_penalty > 0, f"repetition_penalty must be positive, got {self.repetition_penalty}"),
            (-2 <= self.presence_penalty <= 2, f"presence_penalty must be in [-2, 2], got {self.presence_penalty}"),
            (-2 <= self.frequency_penalty <= 2, f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, f"logprobs must be in [0, 20], got {self.logprobs}"),
            (self.max_tokens is None or self.max_tokens >= 1, f"max_tokens must be at least 1, got {self.max_tokens}"),
            (self.min_tokens >= 0, f"min_tokens must be non-negative, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must not exceed max_tokens ({self.max_tokens})",
            ),
            (all(s for s in self.stop), "stop strings must be non-empty"),
            (self.detokenize or not self.stop, "stop strings need detokenize=True"),
            (self.allowed_token_ids is None or len(self.allowed_token_ids) > 0, "allowed_token_ids must not be empty"),
            (self.grammar is None or not self.min_tokens, "min_tokens cannot be combined with a grammar"),
            (self.grammar is None or not self.ignore_eos, "ignore_eos cannot be combined with a grammar"),
            (self.stream_interval >= 1, f"stream_interval must be at least 1, got {self.stream_interval}"),
            (
                self.seed is None or -(1 << 63) <= self.seed < 1 << 64,
                f"seed must be in [-2**63, 2**64), got {self.seed}",  # torch's generator range
            ),
            (math.isfinite(self.repetition_penalty), "repetition_penalty must be finite"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
