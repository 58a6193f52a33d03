"""What the engine tracks per sample: prompt inputs, tokens so far, KV progress, status."""

from __future__ import annotations

import enum
import itertools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    import torch

    from engine.structured import Guide


@dataclass(frozen=True)
class EmbedInput:
    """Precomputed input embeddings replacing the token embeddings at ``offset:offset+len``.

    Used by VLM image features and ASR/TTS conditioning. ``content_hash`` identifies the
    content (e.g. a hash of the image bytes) and is mixed into the prefix-cache keys of every
    block the embeddings touch, so two prompts with the same placeholder tokens but different
    images never share KV.
    """

    offset: int
    embeds: torch.Tensor  # [num_positions, hidden_size]
    content_hash: str

    @property
    def end(self) -> int:
        return self.offset + int(self.embeds.shape[0])


@dataclass
class PromptInputs:
    """Everything a request brings besides sampling parameters."""

    token_ids: list[int]
    embeds: list[EmbedInput] = field(default_factory=list)
    # Encoder output for cross-attention (e.g. Whisper audio features): [enc_len, hidden].
    encoder_output: torch.Tensor | None = None
    # Extra prefix-cache key for every block (e.g. a hash of the encoder input), since the
    # decoder KV depends on it too.
    cache_salt: str | None = None

    def __post_init__(self) -> None:
        if not self.token_ids:
            raise ValueError("prompt must contain at least one token")
        for e in self.embeds:
            if e.offset < 0 or e.end > len(self.token_ids):
                raise ValueError(
                    f"embeddings at [{e.offset}, {e.end}) fall outside the {len(self.token_ids)}-token prompt"
                )


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    # An n>1 sibling waiting for the first sample's prefill, whose KV it will share.
    WAITING_FOR_FORK = "waiting_for_fork"
    FINISHED = "finished"


class FinishReason(str, enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


_seq_counter = itertools.count()


class Sequence:
    """One sample of one request. A request with ``n`` samples owns ``n`` sequences."""

    def __init__(
        self,
        request_id: str,
        index: int,
        inputs: PromptInputs,
        params: SamplingParams,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> None:
        self.seq_id = next(_seq_counter)
        self.request_id = request_id
        self.index = index
        self.inputs = inputs
        self.params = params
        self.priority = priority
        self.arrival_time = time.monotonic() if arrival_time is None else arrival_time
        self.token_ids: list[int] = list(inputs.token_ids)
        self.num_prompt_tokens = len(inputs.token_ids)
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served from the prefix cache at admission
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # chained hashes of the full blocks of token_ids
        self.num_cached_blocks = 0  # leading blocks already registered in the prefix cache
        self.status = SequenceStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | str | None = None
        self.num_preemptions = 0
        self.siblings: list[Sequence] = []  # seqs to fork from this one after its prefill
        self.generator: Any = None  # torch.Generator when the request is seeded
        self.guide: Guide | None = None  # when the request has a grammar
        self.first_token_time: float | None = None

    # -- token views -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        self.token_ids.append(token_id)

    def __repr__(self) -> str:
        return (
            f"Sequence(id={self.seq_id}, req={self.request_id}#{self.index}, tokens={self.num_tokens}, "
            f"computed={self.num_computed_tokens}, status={self.status.value})"
        )
