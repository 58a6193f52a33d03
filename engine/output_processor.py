"""Per-request output state: detokenises new tokens, applies stop strings, builds deltas."""

from __future__ import annotations

import time

from transformers import PreTrainedTokenizerBase

from engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from engine.outputs import CompletionOutput, RequestOutput, TokenLogprob
from engine.sequence import Sequence


class _SeqText:
    def __init__(self, seq: Sequence, tokenizer: PreTrainedTokenizerBase | None) -> None:
        p = seq.params
        self.detok = (
            IncrementalDetokenizer(tokenizer, seq.inputs.token_ids, p.skip_special_tokens)
            if tokenizer and p.detokenize
            else None
        )
        self.stops = StopStringMatcher(p.stop, p.include_stop_str_in_output)
        self.text = ""
        self.logprobs: list[TokenLogprob] | None = [] if p.logprobs is not None else None
        self.sent_chars = 0
        self.sent_tokens = 0
        self.sent_logprobs = 0
        self.done = False  # final output already sent


class RequestState:
    """Everything needed to report one request's progress; ``seqs[i]`` is sample ``i``."""

    def __init__(self, request_id: str, seqs: list[Sequence], tokenizer: PreTrainedTokenizerBase | None) -> None:
        self.request_id = request_id
        self.seqs = seqs
        self.texts = [_SeqText(s, tokenizer) for s in seqs]
        self.arrival_time = time.time()
        self.scheduled_time: float | None = None  # first time any of its tokens ran
        self.first_token_time: float | None = None

    @property
    def finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    @property
    def output_due(self) -> bool:
        """Whether to report now: a sample finished, or has ``stream_interval`` unreported tokens."""
        interval = self.seqs[0].params.stream_interval
        return any(
            (s.is_finished and not st.done) or s.num_output_tokens - st.sent_tokens >= interval
            for s, st in zip(self.seqs, self.texts, strict=True)
        )

    def add_token(self, seq: Sequence, logprob: TokenLogprob | None) -> str | None:
        """Account one new token of ``seq``; return a matched stop string, if any."""
        if self.first_token_time is None:
            self.first_token_time = time.time()
        st = self.texts[seq.index]
        if st.logprobs is not None and logprob is not None:
            st.logprobs.append(logprob)
        if st.detok is None:
            return None
        delta = st.detok.step([seq.token_ids[-1]])
        if not delta:
            return None
        st.text += delta
        if seq.num_output_tokens < seq.params.min_tokens:
            return None
        match = st.stops.find(st.text, len(delta))
        if match is None:
            return None
        cut, stop_str = match
        st.text = st.text[:cut]
        return stop_str

    def make_output(self) -> RequestOutput:
        outputs = []
        for seq, st in zip(self.seqs, self.texts, strict=True):
            finished = seq.is_finished
            shown = st.stops.releasable(st.text, finished)
            tokens = seq.output_token_ids
            out = CompletionOutput(
                index=seq.index,
                text=st.text[:shown],
                token_ids=list(tokens),
                logprobs=list(st.logprobs) if st.logprobs is not None else None,
                finish_reason=seq.finish_reason.value if seq.finish_reason else None,
                stop_reason=seq.stop_reason,
                delta_text=st.text[st.sent_chars : max(shown, st.sent_chars)],
                delta_token_ids=list(tokens[st.sent_tokens :]),
                delta_logprobs=st.logprobs[st.sent_logprobs :] if st.logprobs is not None else None,
            )
            st.sent_chars, st.sent_tokens = max(shown, st.sent_chars), len(tokens)
            st.sent_logprobs = len(st.logprobs) if st.logprobs is not None else 0
            st.done = finished
            outputs.append(out)
        seq0 = self.seqs[0]
        metrics = {"arrival_time": self.arrival_time}
        if self.scheduled_time is not None:
            metrics["scheduled_time"] = self.scheduled_time
        if self.first_token_time is not None:
            metrics["first_token_time"] = self.first_token_time
        return RequestOutput(
            request_id=self.request_id,
            prompt_token_ids=list(seq0.inputs.token_ids),
            outputs=outputs,
            finished=self.finished,
            num_cached_tokens=seq0.num_cached_tokens,
            metrics=metrics,
        )
