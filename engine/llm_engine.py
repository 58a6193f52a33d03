"""The synchronous engine: ``add_request`` … ``step()`` where a step is schedule → run → update."""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence as Seq
from typing import TYPE_CHECKING

import torch

from engine import fast_decoder
from engine.block_manager import KVCacheManager
from engine.config import EngineConfig
from engine.cpu_linear import onednn_available, use_onednn_linears
from engine.errors import PromptTooLongError, QueueFullError, RequestFailedError, check_token_ids
from engine.model_adapter import HFCausalLM, ModelAdapter
from engine.model_runner import ModelRunner
from engine.output_processor import RequestState
from engine.outputs import RequestOutput
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler import SampledToken, ScheduledSeq, Scheduler, SchedulerOutput
from engine.sequence import FinishReason, PromptInputs, Sequence, SequenceStatus
from engine.structured import Guide, Guides

if TYPE_CHECKING:
    from engine.model_loader import LoadedModel

logger = logging.getLogger(__name__)

Prompt = str | list[int] | PromptInputs
# A step that raises drops the requests that fail on their own (``_run``) and the engine serves on;
# this many failed steps in a row, none of whose requests ran, mean the engine itself is broken:
# ``step`` raises, and the loop stops for good.
MAX_FAILED_STEPS = 3


def _gguf_blocks(config: EngineConfig, loaded: LoadedModel, lean: bool) -> dict | None:
    """The GGUF blocks of ``loaded``'s weights, or None where they cannot serve it; none (an
    empty dict: fp32 only) where the block kernel cannot run here, found before reading the file."""
    from engine.gguf_blocks import model_blocks
    from engine.model_loader import gguf_origin
    from engine.native import blockq_linear_kernel

    origin = gguf_origin(loaded.path)
    if origin is None or not lean or config.device != "cpu" or config.dtype != "float32":
        return None
    return model_blocks(loaded.model, origin) if blockq_linear_kernel() is not None else {}


def _eos_ids(loaded: LoadedModel) -> set[int]:
    ids: set[int] = set()
    gen = getattr(loaded.model, "generation_config", None) if loaded.model is not None else None
    for value in (getattr(gen, "eos_token_id", None), getattr(loaded.tokenizer, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids


def _by_request(items: list[ScheduledSeq]) -> dict[str, list[ScheduledSeq]]:
    """``items`` grouped by request (an n>1 request's sequences run and fail together), in order."""
    groups: dict[str, list[ScheduledSeq]] = {}
    for item in items:
        groups.setdefault(item.seq.request_id, []).append(item)
    return groups


def _generator_states(sched: SchedulerOutput) -> list[tuple[Sequence, torch.Generator | None, torch.Tensor | None]]:
    """Each seeded sequence that samples in ``sched``: its generator and that generator's state."""
    return [
        (seq, seq.generator, None if seq.generator is None else seq.generator.get_state())
        for item in sched.scheduled
        for seq in item.sample_seqs
        if seq.params.seed is not None
    ]


def _restore_generators(saved: list[tuple[Sequence, torch.Generator | None, torch.Tensor | None]]) -> None:
    """Undo the draws of a failed run: a rerun samples what the run would have."""
    for seq, generator, state in saved:
        seq.generator = generator
        if generator is not None and state is not None:
            generator.set_state(state)


class LLMEngine:
    """One model, one KV cache, many requests.

    ``adapter`` overrides the model wrapper (toy models in tests, other modalities' decoders);
    otherwise ``loaded.model`` (or ``config.model`` loaded from disk) is wrapped by
    ``_make_adapter``.
    """

    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, adapter: ModelAdapter | None = None):
        if config.num_threads and config.device == "cpu":
            torch.set_num_threads(config.num_threads)
        if loaded is None:
            from engine.model_loader import load_model

            loaded = load_model(config.model, config.dtype, config.device, config.max_model_len)
        self.config = config
        self.tokenizer = loaded.tokenizer
        self.model_name = loaded.name
        self.max_model_len = config.max_model_len or loaded.max_model_len
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError("without chunked prefill, max_num_batched_tokens must be at least max_model_len")
        if adapter is None:
            adapter = self._make_adapter(config, loaded)
        self.adapter = adapter
        self.eos_token_ids = _eos_ids(loaded)
        dtype = getattr(torch, config.dtype)
        self.runner = ModelRunner(config, adapter, Sampler(self.eos_token_ids), dtype)
        self.guides = Guides(self.tokenizer, adapter.vocab_size, self.eos_token_ids)
        kv = KVCacheManager(self.runner.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, kv, self.eos_token_ids, self.max_model_len)
        self.requests: dict[str, RequestState] = {}
        self._aborted: list[RequestState] = []
        self.num_failed_steps = 0
        self._failed_in_a_row = 0
        self._ran = False  # a forward pass of this step ran (a failure after it is not the engine's)
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0

    @staticmethod
    def _make_adapter(config: EngineConfig, loaded: LoadedModel) -> ModelAdapter:
        """The lean Llama-family path where it applies, else transformers' own modules; then the
        module swaps (quantization, oneDNN linears) the config asks for. ``quantization="gguf"``
        keeps a GGUF file's own quantized blocks for the lean path's small batches."""
        model = loaded.model
        onednn = config.cpu_linear == "onednn" or (
            config.cpu_linear == "auto" and config.device == "cpu" and config.dtype == "float32" and onednn_available()
        )
        lean = config.model_impl != "hf" and fast_decoder.supports(model)
        quant = config.quantization
        if quant in ("gguf", "auto"):
            blocks = _gguf_blocks(config, loaded, lean)
            if blocks is not None:
                return fast_decoder.FastDecoderLM(model, use_onednn=onednn, blocks=blocks)
            if quant == "gguf":
                raise ValueError(
                    "quantization 'gguf' serves a .gguf model's own blocks: it needs a model loaded from a "
                    ".gguf file, fp32 on CPU, on the lean Llama-family path"
                )
            quant = None
        if lean and not quant:
            return fast_decoder.FastDecoderLM(model, use_onednn=onednn)
        if config.model_impl == "fast":
            raise ValueError(f"no fast path for model type {model.config.model_type!r} (or with quantization)")
        adapter = HFCausalLM(model)
        if quant:
            from engine.quantization import quantize

            quantize(adapter, quant)
        if onednn:
            use_onednn_linears(adapter)
        return adapter

    # -- admission -----------------------------------------------------------------------------
    def _to_inputs(self, prompt: Prompt) -> PromptInputs:
        if isinstance(prompt, PromptInputs):
            inputs = prompt
        elif isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: send token ids")
            inputs = PromptInputs(self.tokenizer(prompt).input_ids)
        else:
            inputs = PromptInputs(list(prompt))
        check_token_ids(inputs.token_ids, self.adapter.vocab_size, "prompt")
        return inputs

    def add_request(
        self,
        request_id: str,
        prompt: Prompt,
        params: SamplingParams,
        priority: int = 0,
        guides: list[Guide] | None = None,
    ) -> None:
        """Queue a request. Raises ``ValueError``/``PromptTooLongError`` for bad input and
        ``QueueFullError`` when the waiting queue is at ``max_waiting``. ``guides``: one per
        sequence, made by ``self.guides`` for ``params.grammar`` beforehand (else made here)."""
        if request_id in self.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        if len(self.scheduler.waiting) >= self.config.max_waiting:
            raise QueueFullError(len(self.scheduler.waiting))
        if params.n > self.config.max_num_seqs:
            raise ValueError(f"n={params.n} exceeds the server's max_num_seqs={self.config.max_num_seqs}")
        params.check_vocab(self.adapter.vocab_size)
        inputs = self._to_inputs(prompt)
        num_prompt = len(inputs.token_ids)
        max_tokens = params.max_tokens if params.max_tokens is not None else self.max_model_len - num_prompt
        if max_tokens < 1 or num_prompt + max_tokens > self.max_model_len:
            raise PromptTooLongError(num_prompt, max(max_tokens, 1), self.max_model_len)
        if params.max_tokens is None:
            params = SamplingParams(**{**params.__dict__, "max_tokens": max_tokens})
        seqs = [Sequence(request_id, i, inputs, params, priority) for i in range(params.n)]
        if params.grammar is not None:
            for seq, guide in zip(seqs, guides or self.guides.new(params.grammar, len(seqs)), strict=True):
                seq.guide = guide
        for sibling in seqs[1:]:
            sibling.status = SequenceStatus.WAITING_FOR_FORK
        seqs[0].siblings = seqs[1:]
        self.requests[request_id] = RequestState(request_id, seqs, self.tokenizer)
        self.scheduler.add(seqs[0])
        self.num_prompt_tokens += num_prompt

    def abort_request(self, request_id: str) -> None:
        state = self.requests.pop(request_id, None)
        if state is None:
            return
        for seq in state.seqs:
            self.scheduler.finish(seq, FinishReason.ABORT)
        self._aborted.append(state)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests) or bool(self._aborted)

    # -- the loop ------------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """One iteration: schedule → run → update. Returns outputs of requests that progressed."""
        outputs = [state.make_output() for state in self._aborted]
        self._aborted.clear()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            return outputs
        now = time.time()
        for item in sched.scheduled:
            state = self.requests.get(item.seq.request_id)
            if state is not None and state.scheduled_time is None:
                state.scheduled_time = now
        self._ran = False
        try:
            progressed, failed, exc = self._run(sched)
        except Exception as update_exc:  # updating the scheduler failed: the step's requests are in doubt
            progressed, failed, exc = {}, sched.scheduled, update_exc
        if exc is not None:
            self.num_failed_steps += 1
            if self._ran:  # a forward pass ran: the engine works, what failed failed alone
                self._failed_in_a_row = 0
            else:
                self._failed_in_a_row += 1
                if self._failed_in_a_row >= MAX_FAILED_STEPS:
                    raise exc
            if failed:
                logger.error("an engine step failed: %d request(s) dropped", len(failed), exc_info=exc)
                outputs += self._fail(failed, exc)
        else:
            self._failed_in_a_row = 0
        for request_id, state in progressed.items():
            if state.output_due:
                outputs.append(state.make_output())
            if state.finished:
                del self.requests[request_id]
        return outputs

    def _run(
        self, sched: SchedulerOutput, budget: list[int] | None = None
    ) -> tuple[dict[str, RequestState], list[ScheduledSeq], Exception | None]:
        """Run ``sched`` and take its sampled tokens: ``(the requests that got one, the items that
        failed, the failure)``. A forward pass that raises is rerun on halves of its requests,
        recursively, so that only a request that fails on its own is dropped: the reruns write
        the same KV slots again, nothing of a failed forward was taken, and seeded requests'
        generators are put back as they were. ``budget``: reruns left for this step (2 x the
        bits of its request count: enough to find one culprit; an engine failing every request
        gives up there)."""
        seeded = _generator_states(sched)
        try:
            sampled = self.runner.execute(sched)
            self._ran = True
        except Exception as exc:
            _restore_generators(seeded)
            groups = list(_by_request(sched.scheduled).values())
            budget = budget if budget is not None else [2 * len(groups).bit_length()]
            if len(groups) == 1 or budget[0] <= 0:
                return {}, sched.scheduled, exc
            logger.warning("an engine step of %d requests failed (%r): rerunning them apart", len(groups), exc)
            progressed: dict[str, RequestState] = {}
            failed: list[ScheduledSeq] = []
            half = len(groups) // 2
            # The block copies ran before the failed forward; the first rerun repeats them (whole
            # blocks, before any rerun writes into them), the others must not.
            for i, part in enumerate((groups[:half], groups[half:])):
                items = [item for group in part for item in group]
                copies = sched.block_copies if i == 0 else []
                sub = SchedulerOutput(items, copies, [], sum(item.num_new_tokens for item in items))
                budget[0] -= 1
                try:
                    got, lost, _ = self._run(sub, budget)
                except Exception:  # taking its tokens failed: these requests are in doubt
                    logger.exception("taking a rerun's tokens failed")
                    got, lost = {}, items
                progressed.update(got)
                failed += lost
            return progressed, failed, exc
        return self._take(sched, sampled)

    def _take(
        self, sched: SchedulerOutput, sampled: dict[int, SampledToken]
    ) -> tuple[dict[str, RequestState], list[ScheduledSeq], Exception | None]:
        """Take ``sched``'s sampled tokens: as ``_run`` returns. A request whose token cannot be
        taken (its detokenizing or stop check raises) fails alone; the others go on."""
        touched = self.scheduler.update(sched, sampled)
        progressed: dict[str, RequestState] = {}
        broken: dict[str, Exception] = {}
        for seq in touched:
            if seq.request_id in broken:
                continue
            state = self.requests[seq.request_id]
            self.num_generation_tokens += 1
            try:
                stop_str = state.add_token(seq, sampled[seq.seq_id].logprob)
            except Exception as exc:  # noqa: BLE001 - this request's own fault
                logger.warning("taking a token of request %s failed (%r)", seq.request_id, exc)
                broken[seq.request_id] = exc
                progressed.pop(seq.request_id, None)  # (a sibling's token was taken: all fail)
                continue
            if seq.guide is not None and seq.guide.error is not None:
                # Its grammar could not go on (and forced the end): the output is cut short.
                seq.finish_reason, seq.stop_reason = FinishReason.LENGTH, f"grammar: {seq.guide.error}"
            elif stop_str is not None:
                if seq.finish_reason == FinishReason.LENGTH:  # max_tokens hit on the same token:
                    seq.finish_reason, seq.stop_reason = FinishReason.STOP, stop_str  # the text was cut
                else:
                    self.scheduler.finish(seq, FinishReason.STOP, stop_str)
            progressed[seq.request_id] = state
        failed = [item for item in sched.scheduled if item.seq.request_id in broken]
        return progressed, failed, next(iter(broken.values()), None)

    def _fail(self, items: list[ScheduledSeq], exc: Exception) -> list[RequestOutput]:
        """Drop the requests of failed ``items`` (their blocks are freed; the prefix cache
        registers blocks only after a step succeeds, so it holds nothing of theirs): their last
        outputs carry the error."""
        error = f"the engine failed while running this request ({type(exc).__name__}); the engine serves on"
        outputs = []
        for request_id in _by_request(items):
            state = self.requests.pop(request_id, None)
            if state is None:
                continue
            for seq in state.seqs:
                self.scheduler.finish(seq, FinishReason.ABORT)
            out = state.make_output()
            out.error = error
            outputs.append(out)
        return outputs

    def generate(
        self, prompts: Seq[Prompt], params: SamplingParams | Seq[SamplingParams], use_tqdm: bool = False
    ) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        params_list = [params] * len(prompts) if isinstance(params, SamplingParams) else list(params)
        ids = [f"gen-{id(self)}-{i}" for i in range(len(prompts))]
        for request_id, prompt, p in zip(ids, prompts, params_list, strict=True):
            self.add_request(request_id, prompt, p)
        final: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm:
            from tqdm import tqdm

            bar = tqdm(total=len(prompts), desc="generate")
        while self.has_unfinished_requests():
            for out in self.step():
                if out.error is not None:  # the call fails: its other prompts stop too
                    for request_id in ids:
                        self.abort_request(request_id)
                    raise RequestFailedError(out.error)
                if out.finished:
                    final[out.request_id] = out
                    if bar is not None:
                        bar.update(1)
        if bar is not None:
            bar.close()
        return [final[i] for i in ids]

    def stats(self) -> dict[str, float]:
        kv = self.scheduler.kv
        return {
            "num_running": len(self.scheduler.running),
            "num_waiting": len(self.scheduler.waiting),
            "kv_cache_usage": kv.pool.usage(),
            "num_kv_blocks": kv.pool.num_blocks,
            "prefix_cache_hit_rate": kv.prefix_hit_rate,
            "prefix_cache_queries": kv.query_tokens,
            "prefix_cache_hits": kv.hit_tokens,
            "num_preemptions": self.scheduler.num_preemptions,
            "prompt_tokens_total": self.num_prompt_tokens,
            "generation_tokens_total": self.num_generation_tokens,
            "failed_steps_total": self.num_failed_steps,
        }
