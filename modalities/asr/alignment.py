"""Word timestamps from Whisper's cross-attention, the method of openai-whisper's ``timing.py``.

Once a window's tokens are decoded, one teacher-forced pass of transformers' Whisper decoder over
``prompt + tokens`` (eager attention, so the attention weights come out) reads the cross-attention
of the model's alignment heads: row ``k`` is the query that predicts token ``k`` (the last prompt
token predicts the first text token, the last text token predicts end-of-text). The weights over
the window's audio frames (20 ms per encoder frame) are normalised per frame across tokens,
median-filtered along time, averaged over heads, and aligned to the frames by dynamic time
warping: token ``k`` spans from the first frame of row ``k`` on the path to the first frame of row
``k + 1``. Words are the window text's whitespace-separated words (punctuation stays attached, as
in the text), each spanning its tokens. The alignment heads come from the generation config
(``alignment_heads``, which the CTranslate2 import copies); a model without them uses every head
of the decoder's second half, as openai-whisper does.
"""

from __future__ import annotations

import bisect
import codecs
import copy
import functools
import itertools
import logging
import re
from typing import TYPE_CHECKING, Any

import numpy as np

from modalities.asr.longform import Window, stitched_spans
from modalities.asr.quality import WindowResult
from modalities.asr.types import TokenLogprob, Word

if TYPE_CHECKING:
    import torch

logger = logging.getLogger("mmserve.asr")
FRAME_S = 0.02  # one encoder frame: two 10 ms mel frames
SAMPLES_PER_MEL_FRAME = 160
SENTENCE_END = ".。!！?？"
_WORD = re.compile(r"\S+")


def alignment_heads(model: Any) -> list[tuple[int, int]]:
    """``(decoder layer, head)`` pairs whose cross-attention follows the speech: the generation
    config's ``alignment_heads``, else every head of the second half of the decoder layers."""
    heads = getattr(model.generation_config, "alignment_heads", None)
    if heads:
        return [(int(layer), int(head)) for layer, head in heads]
    cfg = model.config
    return [
        (layer, h)
        for layer in range(cfg.decoder_layers // 2, cfg.decoder_layers)
        for h in range(cfg.decoder_attention_heads)
    ]


def median_filter(x: torch.Tensor, width: int) -> torch.Tensor:
    """Median over a sliding window of odd ``width`` along the last axis of ``x`` [a, b, n]
    (edges reflected)."""
    import torch.nn.functional as F

    pad = width // 2
    if width <= 1 or x.shape[-1] <= pad:
        return x
    return F.pad(x, (pad, pad), mode="reflect").unfold(-1, width, 1).sort()[0][..., pad]


def dtw_row_starts(cost: np.ndarray) -> np.ndarray:
    """First column of each row on the cheapest monotonic path from the top-left to the
    bottom-right cell of ``cost`` [rows, cols] (steps: diagonal, down, right; ties as
    transformers' ``_dynamic_time_warping`` breaks them)."""
    rows, cols = cost.shape
    acc = np.full((rows + 1, cols + 1), np.inf)
    acc[0, 0] = 0.0
    for i in range(1, rows + 1):
        # acc[i, j] = cost[i-1, j-1] + min(acc[i-1, j-1], acc[i-1, j], acc[i, j-1]): enter row i
        # from above at some column k <= j, then walk right, so
        # acc[i, j] = min over k <= j of (entry[k] + cost[i-1, k-1..j-1]) - one running minimum.
        entry = np.minimum(acc[i - 1, :-1], acc[i - 1, 1:])
        csum = np.cumsum(cost[i - 1])
        acc[i, 1:] = csum + np.minimum.accumulate(entry - (csum - cost[i - 1]))
    starts = np.zeros(rows, dtype=np.int64)
    i, j = rows, cols
    while i > 0:
        starts[i - 1] = j - 1
        if j == 1:  # the first column: only up
            i -= 1
            continue
        diag, up, left = acc[i - 1, j - 1], acc[i - 1, j], acc[i, j - 1]
        if diag < up and diag < left:
            i, j = i - 1, j - 1
        elif up < diag and up < left:
            i -= 1
        else:
            j -= 1
    return starts


def token_boundaries(weights: torch.Tensor, num_frames: int, filter_width: int) -> np.ndarray:
    """Seconds where each row's token starts on the alignment path, from the cross-attention
    ``weights`` [heads, rows, frames] of the alignment heads (only the first ``num_frames``
    encoder frames hold the window's audio)."""
    import torch

    w = weights[..., :num_frames].float()
    std, mean = torch.std_mean(w, dim=-2, keepdim=True, unbiased=False)
    w = median_filter((w - mean) / std.clamp_min(1e-8), filter_width)
    matrix = w.mean(dim=0).double().cpu().numpy()
    return dtw_row_starts(-matrix) * FRAME_S


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet (Whisper's vocabulary): a printable byte is its own
    character, every other byte a code point from 256 up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    others = [b for b in range(256) if b not in table.values()]
    table.update({chr(256 + n): b for n, b in enumerate(others)})
    return table


def _token_bytes(tokenizer: Any, tokens: list[int], first_special: int) -> list[bytes]:
    """Each token's UTF-8 bytes (a special token's: none)."""
    decode = _byte_decoder()
    pieces = tokenizer.convert_ids_to_tokens(tokens)
    return [bytes(decode[c] for c in p) if t < first_special else b"" for t, p in zip(tokens, pieces, strict=True)]


def word_token_spans(tokenizer: Any, tokens: list[int], first_special: int) -> list[tuple[str, int, int]]:
    """``(word, first token, last token + 1)`` for each whitespace-separated word of the decoded
    ``tokens`` (special tokens, ids from ``first_special`` on, decode to nothing): the words are
    exactly ``text.split()`` of the decoded text; a word's tokens are those holding any of its
    bytes (a character may be split across tokens)."""
    token_bytes = _token_bytes(tokenizer, tokens, first_special)
    token_end = list(itertools.accumulate(len(b) for b in token_bytes))
    data = b"".join(token_bytes)
    # Decode a byte at a time, noting after how many bytes each character came out.
    utf8 = codecs.getincrementaldecoder("utf-8")(errors="replace")
    text, char_end = "", []
    for i in range(len(data) + 1):
        out = utf8.decode(data[i : i + 1], final=i == len(data))
        text += out
        char_end += [min(i + 1, len(data))] * len(out)
    spans = []
    for m in _WORD.finditer(text):
        first_byte = char_end[m.start() - 1] if m.start() else 0
        spans.append(
            (
                m.group(),
                bisect.bisect_right(token_end, first_byte),
                bisect.bisect_left(token_end, char_end[m.end() - 1]) + 1,
            )
        )
    return spans


def clamp_long_words(words: list[Word]) -> list[Word]:
    """openai-whisper's guard against the path parking a pause on a word: with ``max`` twice the
    median word duration (at most 1.4 s), a word ending a sentence keeps at most ``max`` after its
    start, a window's first word or one following a sentence end at most ``max`` before its end."""
    durations = [w.end - w.start for w in words if w.end > w.start]
    if not durations:
        return words
    longest = 2 * min(0.7, float(np.median(durations)))
    out = []
    for i, w in enumerate(words):
        start, end = w.start, w.end
        if end - start > longest:
            if i == 0 or words[i - 1].word[-1] in SENTENCE_END:
                start = end - longest
            elif w.word[-1] in SENTENCE_END:
                end = start + longest
        out.append(Word(w.word, start, end))
    return out


class WordAligner:
    """Word timestamps for one decoded window (see the module docstring). Runs off the event
    loop; the eager decoder shares its weights with ``model``."""

    def __init__(self, model: Any, tokenizer: Any) -> None:
        import torch
        from transformers.models.whisper.modeling_whisper import WhisperDecoder

        cfg = copy.deepcopy(model.config)
        cfg._attn_implementation = "eager"  # the only attention that returns its weights
        with torch.device("meta"):
            decoder = WhisperDecoder(cfg)
        decoder.load_state_dict(model.model.decoder.state_dict(), assign=True)
        self.decoder = decoder.eval()
        self.tokenizer = tokenizer
        self.heads = alignment_heads(model)
        self.filter_width = int(getattr(cfg, "median_filter_width", 7))
        self.first_special = int(model.generation_config.eos_token_id)

    def cross_weights(self, enc: torch.Tensor, prompt_ids: list[int], tokens: list[int]) -> torch.Tensor:
        """Alignment heads' cross-attention [heads, len(tokens) + 1, frames]: the rows of the
        queries that predict each token, then end-of-text."""
        import torch

        ids = torch.tensor([[*prompt_ids, *tokens]], device=enc.device)
        with torch.inference_mode():
            out = self.decoder(
                input_ids=ids,
                encoder_hidden_states=enc[None].to(self.decoder.dtype),
                output_attentions=True,
                use_cache=False,
            )
        first = len(prompt_ids) - 1
        return torch.stack([out.cross_attentions[layer][0, head, first:] for layer, head in self.heads])

    def token_times(self, enc: torch.Tensor, prompt_ids: list[int], tokens: list[int], num_samples: int) -> np.ndarray:
        """Seconds (window-relative) [len(tokens) + 1]: token ``k`` spans ``[t[k], t[k + 1]]``."""
        num_frames = max(1, -(-num_samples // SAMPLES_PER_MEL_FRAME) // 2)
        return token_boundaries(self.cross_weights(enc, prompt_ids, tokens), num_frames, self.filter_width)

    def words(self, enc: torch.Tensor, prompt_ids: list[int], tokens: list[int], num_samples: int) -> list[Word]:
        """The window's words (``text.split()`` of its decoded text) with window-relative times."""
        if not tokens:
            return []
        times = self.token_times(enc, prompt_ids, tokens, num_samples)
        spans = word_token_spans(self.tokenizer, tokens, self.first_special)
        return clamp_long_words([Word(w, float(times[a]), float(times[b])) for w, a, b in spans])


def transcript_words(windows: list[Window], texts: list[str], results: list[WindowResult]) -> list[Word]:
    """The transcript's words with absolute times: each window's aligned words offset by its
    start, minus those the overlap stitching drops from its text (the same word ranges), kept
    inside the window's segment and in order (no word starts before the previous one ends)."""
    out: list[Word] = []
    last_end = 0.0
    for w, text, (lo, hi), r in zip(windows, texts, stitched_spans(windows, texts), results, strict=True):
        words = r.words or []
        if len(words) != len(text.split()):  # the engine's text and the tokens' own decode differ
            logger.warning("word timestamps skipped for the window at %.2f s: its words do not match its text", w.start)
            continue
        seg_start, seg_end = round(w.start, 3), round(w.end, 3)  # the segment's bounds
        for word in words[lo:hi]:
            start = min(max(w.start + word.start, seg_start, last_end), seg_end)
            end = min(max(w.start + word.end, start), seg_end)
            out.append(Word(word.word, round(start, 3), round(end, 3)))
            last_end = end
    return out


def transcript_logprobs(
    windows: list[Window], texts: list[str], results: list[WindowResult], tokenizer: Any, first_special: int
) -> list[TokenLogprob]:
    """The transcript's tokens with their logprobs: each window's kept decode's tokens that hold
    the words the overlap stitching keeps of its text (``stitched_spans``), in order."""
    out: list[TokenLogprob] = []
    for text, (lo, hi), r in zip(texts, stitched_spans(windows, texts), results, strict=True):
        lps = span_logprobs(tokenizer, r.tokens, r.token_logprobs, text, lo, hi, first_special)
        if lps is None:
            logger.warning("logprobs skipped for a window: its tokens' words do not match its text")
        out += lps or []
    return out


def span_logprobs(
    tokenizer: Any, tokens: list[int], lps: list[float], text: str, lo: int, hi: int, first_special: int
) -> list[TokenLogprob] | None:
    """The tokens (with their logprobs ``lps``) of a decode holding words ``[lo, hi)`` of its
    ``text`` (the live text of a decode still running, whose last word may be cut); None when
    its tokens' words are not the text's."""
    if not text or lo >= hi:
        return []
    words = text.split()
    if (lo, hi) != (0, len(words)):
        spans = word_token_spans(tokenizer, tokens, first_special)
        # As many words (a last character cut mid-byte may differ), or the same words up to ``hi``
        # (a live text, whose last word may be held back or cut).
        if len(spans) != len(words) and [w for w, _, _ in spans[:hi]] != words[:hi]:
            return None
        tokens, lps = tokens[spans[lo][1] : spans[hi - 1][2]], lps[spans[lo][1] : spans[hi - 1][2]]
    pairs = zip(_token_bytes(tokenizer, tokens, first_special), lps, strict=True)
    return [TokenLogprob(b.decode("utf-8", errors="replace"), float(lp), list(b)) for b, lp in pairs if b]
