"""OpenAI-compatible ``POST /v1/embeddings``.

Embedding engines live in ``app.state.engines`` next to the LLM engines; this router only
answers for ``EmbeddingEngine`` instances (``model`` may be omitted when exactly one is served).
``dimensions`` truncates each vector (Matryoshka) and renormalises it; ``encoding_format:
"base64"`` returns the little-endian float32 bytes, as OpenAI does.

Each request is charged ``len(inputs)`` ``embed_inputs`` against its tenant's rate limit before
it reaches the engine (refunded when it fails), and answers with ``Server-Timing: queue;dur=…,
inference;dur=…, total;dur=…`` (ms; queue = until its first batch started).
"""

from __future__ import annotations

import base64
import time
from typing import TYPE_CHECKING, Any

import numpy as np
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from gateway.errors import APIError, from_engine_error, pick_engine
from gateway.logs import annotate
from gateway.metrics import record_timing, server_timing_header
from gateway.streaming import charged
from modalities.embed.protocol import EmbeddingRequest

if TYPE_CHECKING:  # the engine module imports torch; plugin loading must not
    from modalities.embed.engine import EmbeddingEngine

router = APIRouter(tags=["embeddings"], strict_content_type=False)


def resolve_embedding_engine(request: Request, model: str | None) -> tuple[str, EmbeddingEngine]:
    """``(served_name, engine)`` for ``model`` among the served embedding engines."""
    from modalities.embed.engine import EmbeddingEngine

    engines: dict[str, Any] = request.app.state.engines
    embedders = {name: e for name, e in engines.items() if isinstance(e, EmbeddingEngine)}
    aliases = getattr(request.app.state, "aliases", {})
    return pick_engine(
        engines,
        aliases,
        model,
        embedders,
        none_served="no embedding model is served (include embed in --only; --embed picks the model)",
        unsupported="does not support embeddings",
    )


def check_dimensions(dimensions: int | None, model_dim: int) -> None:
    """400 when ``dimensions`` exceeds the model's embedding size."""
    if dimensions is not None and dimensions > model_dim:
        raise APIError(
            400,
            f"dimensions={dimensions} is larger than this model's embedding size of {model_dim}",
            param="dimensions",
            code="invalid_value",
        )


def shape_vectors(vectors: np.ndarray, dimensions: int | None, model_dim: int) -> np.ndarray:
    """Truncate to ``dimensions`` and renormalise (L2); unchanged when ``dimensions`` is omitted."""
    if dimensions is None or dimensions == model_dim:
        return vectors
    check_dimensions(dimensions, model_dim)
    cut = np.ascontiguousarray(vectors[:, :dimensions])
    norms = np.linalg.norm(cut, axis=1, keepdims=True)
    return (cut / np.maximum(norms, 1e-12)).astype(np.float32)


def encode_vectors(vectors: np.ndarray, encoding_format: str) -> list[Any]:
    """One JSON value per row: a float list, or base64 of little-endian float32 bytes."""
    if encoding_format == "base64":
        le = vectors.astype("<f4", copy=False)
        return [base64.b64encode(row.tobytes()).decode("ascii") for row in le]
    return vectors.tolist()


@router.post("/v1/embeddings")
async def create_embeddings(body: EmbeddingRequest, request: Request) -> Any:
    """OpenAI ``POST /v1/embeddings``."""
    from modalities.embed.engine import InputTooLongError

    start = time.perf_counter()
    model, engine = resolve_embedding_engine(request, body.model)
    check_dimensions(body.dimensions, engine.dim)
    inputs = body.inputs()
    try:  # (a client gone: its queued inputs are dropped)
        result = await charged(
            request, "embed_inputs", len(inputs), lambda: engine.embed(inputs, truncate=body.truncation())
        )
    except InputTooLongError as exc:
        raise APIError(400, str(exc), param="input", code="context_length_exceeded") from exc
    except Exception as exc:
        mapped = from_engine_error(exc, param="input")
        if mapped is None:
            raise
        raise mapped from exc
    vectors = shape_vectors(result.embeddings, body.dimensions, engine.dim)
    encoded = encode_vectors(vectors, body.encoding_format)
    tokens = result.prompt_tokens
    total = time.perf_counter() - start
    timing = record_timing(request, "embed", model, result.queue_s, result.inference_s, total)
    annotate(request, prompt_tokens=tokens, inputs=len(inputs))
    content = {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": e} for i, e in enumerate(encoded)],
        "model": model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }
    # JSONResponse directly: skips FastAPI's per-float jsonable_encoder walk
    return JSONResponse(content, headers={"Server-Timing": server_timing_header(timing)})
