"""The async front: concurrent streams, admission errors, abandoned streams, explicit aborts
and priority scheduling, on a tiny random Llama."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import pytest

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.errors import EngineDeadError, PromptTooLongError, QueueFullError, RequestFailedError
from engine.foreground import FOREGROUND
from engine.llm_engine import MAX_FAILED_STEPS, LLMEngine
from engine.model_loader import LoadedModel, load_model
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured import regex_grammar
from tests.helpers import DEADLINE_S, until

MAX_MODEL_LEN = 256
NUM_BLOCKS = 64
PROMPTS = [
    "Hello",
    "The capital of France is",
    "Once upon a time, in a land far away, there lived a",
    "1, 2, 3,",
    "Llamas are",
]
# Long enough to still be running when the test acts on it; it is always aborted early.
LONG = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def loaded(tiny_model_dir) -> LoadedModel:
    return load_model(str(tiny_model_dir("llama")), max_model_len=MAX_MODEL_LEN)


def _llm(loaded: LoadedModel, **config) -> LLMEngine:
    cfg = dict(model=str(loaded.path), max_model_len=MAX_MODEL_LEN, num_kv_blocks=NUM_BLOCKS)
    return LLMEngine(EngineConfig(**{**cfg, **config}), loaded=loaded)


@contextlib.asynccontextmanager
async def _async_engine(loaded: LoadedModel, **config) -> AsyncIterator[AsyncEngine]:
    engine = AsyncEngine(_llm(loaded, **config))
    try:
        yield engine
    finally:
        await engine.shutdown()


def _kv_all_free(engine: LLMEngine) -> bool:
    pool = engine.scheduler.kv.pool
    return pool.num_free == pool.num_blocks and all(b.ref_count == 0 for b in pool.blocks)


async def _idle(engine: AsyncEngine) -> None:
    llm = engine.engine
    await until(lambda: not llm.has_unfinished_requests() and _kv_all_free(llm), "engine idle, KV all free")
    assert not llm.requests and not llm.scheduler.running and not llm.scheduler.waiting


async def _collect(engine: AsyncEngine, prompt, params: SamplingParams, **kw) -> tuple[list[RequestOutput], str]:
    outs, text = [], ""
    async for out in engine.generate(kw.pop("request_id", None), prompt, params, **kw):
        outs.append(out)
        text += out.outputs[0].delta_text
    return outs, text


# -- concurrent streams ----------------------------------------------------------------------------
async def test_concurrent_streams_match_sync_engine(loaded) -> None:
    params = [SamplingParams(temperature=0, max_tokens=6 + 2 * i, ignore_eos=True) for i in range(len(PROMPTS))]
    expected = _llm(loaded).generate(PROMPTS, params)
    async with _async_engine(loaded) as engine:
        results = await asyncio.gather(*(_collect(engine, p, sp) for p, sp in zip(PROMPTS, params, strict=True)))
        for (outs, text), ref in zip(results, expected, strict=True):
            final = outs[-1]
            assert final.finished and all(not o.finished for o in outs[:-1])
            o = final.outputs[0]
            tokens = [t for out in outs for t in out.outputs[0].delta_token_ids]
            assert text == o.text == ref.outputs[0].text
            assert tokens == o.token_ids == ref.outputs[0].token_ids
            assert o.finish_reason == "length"
            assert final.prompt_token_ids == ref.prompt_token_ids
        await _idle(engine)


# -- admission errors ------------------------------------------------------------------------------
async def test_admission_errors_raised_from_the_iterator(loaded) -> None:
    async with _async_engine(loaded) as engine:
        with pytest.raises(PromptTooLongError) as info:
            await _collect(engine, list(range(100, 350)), SamplingParams(max_tokens=10))
        err = info.value
        assert (err.num_prompt_tokens, err.max_tokens, err.max_model_len) == (250, 10, MAX_MODEL_LEN)
        assert "250" in str(err) and str(MAX_MODEL_LEN) in str(err)

        vocab = engine.engine.adapter.vocab_size
        with pytest.raises(ValueError, match=str(vocab + 3)):
            await _collect(engine, [5, vocab + 3, 7], SamplingParams(max_tokens=4))

        with pytest.raises(ValueError):  # -1 is out of range too
            await _collect(engine, [-1], SamplingParams(max_tokens=4))

        # Rejections leave no trace, and the engine still serves.
        outs, text = await _collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=3))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        await _idle(engine)


async def test_duplicate_request_id_rejected_without_hurting_the_original(loaded) -> None:
    async with _async_engine(loaded) as engine:
        params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
        original = engine.generate("same", PROMPTS[1], params)
        first = await original.__anext__()
        with pytest.raises(ValueError, match="already in use"):
            await _collect(engine, "Hi", SamplingParams(max_tokens=3), request_id="same")
        outs = [first] + [out async for out in original]
        o = outs[-1].outputs[0]
        assert o.finish_reason == "length" and len(o.token_ids) == 12
        assert o.token_ids == _llm(loaded).generate([PROMPTS[1]], params)[0].outputs[0].token_ids
        await _idle(engine)


async def test_queue_full_raised_from_the_iterator(loaded) -> None:
    async with _async_engine(loaded, max_waiting=0) as engine:
        with pytest.raises(QueueFullError) as info:
            await _collect(engine, "Hello", SamplingParams(max_tokens=4))
        assert info.value.retry_after_s > 0
        assert not engine.engine.requests

    # The bound counts waiting requests: max_num_seqs=1 keeps the others waiting.
    async with _async_engine(loaded, max_waiting=2, max_num_seqs=1) as engine:
        llm = engine.engine
        blocker = engine.generate("blocker", "Hello", LONG)
        await blocker.__anext__()  # running: it occupies the only slot
        waiters = [engine.generate(f"w{i}", "Hi", SamplingParams(max_tokens=2)) for i in range(2)]
        tasks = [asyncio.ensure_future(w.__anext__()) for w in waiters]
        await until(lambda: len(llm.scheduler.waiting) == 2, "two requests waiting")
        with pytest.raises(QueueFullError):
            await _collect(engine, "Hello", SamplingParams(max_tokens=2))
        await blocker.aclose()  # frees the slot: the waiters run to completion
        for task, waiter in zip(tasks, waiters, strict=True):
            await task
            async for _ in waiter:
                pass
        await _idle(engine)


# -- abandoning and aborting -----------------------------------------------------------------------
async def test_abandoned_stream_aborts_the_request(loaded) -> None:
    async with _async_engine(loaded) as engine:
        llm = engine.engine
        seen = 0
        stream = engine.generate("gone", PROMPTS[2], LONG)
        async for out in stream:
            seen += len(out.outputs[0].delta_token_ids)
            assert not out.finished
            if seen >= 2:
                break
        await stream.aclose()
        await _idle(engine)
        assert llm.num_generation_tokens < LONG.max_tokens

        # Cancelling the consuming task aborts it too.
        started = asyncio.Event()

        async def consume() -> None:
            async for _ in engine.generate("cancelled", PROMPTS[1], LONG):
                started.set()

        task = asyncio.ensure_future(consume())
        await started.wait()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await _idle(engine)


async def test_abort_ends_a_running_stream(loaded) -> None:
    async with _async_engine(loaded) as engine:
        other = asyncio.ensure_future(
            _collect(engine, PROMPTS[1], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        )
        outs, text = [], ""
        async for out in engine.generate("victim", PROMPTS[0], LONG):
            outs.append(out)
            text += out.outputs[0].delta_text
            if len(outs) == 2:
                await engine.abort("victim")
        final = outs[-1]
        assert final.finished and final.outputs[0].finish_reason == "abort"
        assert 0 < len(final.outputs[0].token_ids) < LONG.max_tokens
        assert final.outputs[0].text == text
        # The neighbour is unaffected.
        other_outs, _ = await other
        assert other_outs[-1].outputs[0].finish_reason == "length"
        assert len(other_outs[-1].outputs[0].token_ids) == 8
        await _idle(engine)
        # Aborting an unknown or finished request is a no-op.
        await engine.abort("victim")
        await engine.abort("no-such-request")
        outs, _ = await _collect(engine, "Hello", SamplingParams(max_tokens=2))
        assert outs[-1].finished


async def test_requests_submitted_together_are_admitted_in_one_step(loaded) -> None:
    """Tasks started together (a burst of TTS requests) each do some work on the event loop, then
    submit: the engine sees all of them at its first step, not the first one alone."""
    async with _async_engine(loaded) as engine:
        llm = engine.engine
        seen: list[int] = []
        step = llm.step

        def recording() -> list[RequestOutput]:
            seen.append(llm.scheduler.num_unfinished)
            return step()

        llm.step = recording  # type: ignore[method-assign]

        async def run(prompt: str) -> None:
            time.sleep(0.005)  # tokenising, say: the engine thread may run meanwhile
            async for _ in engine.generate(None, prompt, SamplingParams(max_tokens=2)):
                pass

        await asyncio.gather(*(run(p) for p in PROMPTS))
        assert seen[0] == len(PROMPTS)
        await _idle(engine)


# -- priority --------------------------------------------------------------------------------------
async def test_priority_serves_lower_value_first(loaded) -> None:
    async with _async_engine(loaded, scheduling_policy="priority", max_num_seqs=1) as engine:
        llm = engine.engine
        blocker = engine.generate("blocker", "Hello", LONG, priority=-10)
        await blocker.__anext__()  # running, so everything after it has to wait

        order: list[str] = []

        async def run(name: str, priority: int) -> None:
            async for out in engine.generate(name, f"Request {name}", SamplingParams(max_tokens=3), priority=priority):
                if out.outputs[0].token_ids and name not in order:
                    order.append(name)

        submitted = [("p5", 5), ("p1", 1), ("p3", 3), ("p0", 0)]  # arrival order differs from priority
        tasks = [asyncio.ensure_future(run(name, prio)) for name, prio in submitted]
        await until(lambda: len(llm.scheduler.waiting) == len(submitted), "all requests waiting")
        assert [s.request_id for s in llm.scheduler.waiting] == ["p0", "p1", "p3", "p5"]
        await blocker.aclose()
        await asyncio.gather(*tasks)
        assert order == ["p0", "p1", "p3", "p5"]
        await _idle(engine)


def test_the_serve_flag_picks_the_scheduling_policy() -> None:
    from gateway.cli import build_parser
    from modalities.llm.plugin import engine_config

    args = build_parser().parse_args(["serve", "--scheduling-policy", "priority"])
    assert engine_config(args, "m").scheduling_policy == "priority"
    assert engine_config(build_parser().parse_args(["serve"]), "m").scheduling_policy == "fcfs"


def test_a_cpu_step_holds_at_most_256_tokens_unless_told(loaded) -> None:
    """On a CPU a step's token budget defaults to 256 (``default_batched_tokens``: a 2048-token
    prefill step there stalls every stream and abort for seconds), so a long prompt is prefilled
    in chunks of 256 beside the running decodes; ``--max-num-batched-tokens`` overrides it, and a
    GPU keeps 2048."""
    from engine.config import default_batched_tokens
    from gateway.cli import build_parser
    from modalities.llm.plugin import engine_config

    def budget(*flags: str) -> int | None:
        return engine_config(build_parser().parse_args(["serve", *flags]), "m").max_num_batched_tokens

    assert budget() == 256 and budget("--max-num-batched-tokens", "1024") == 1024
    assert default_batched_tokens("cuda:0") == 2048
    llm = LLMEngine(EngineConfig(model=str(loaded.path), max_model_len=1024), loaded=load_model(str(loaded.path)))
    steps: list[int] = []
    schedule = llm.scheduler.schedule

    def recorded() -> Any:
        out = schedule()
        steps.append(out.num_batched_tokens)
        return out

    llm.scheduler.schedule = recorded  # type: ignore[method-assign]
    llm.add_request("decode", list(range(100, 110)), SamplingParams(max_tokens=40, ignore_eos=True))
    llm.step()
    llm.add_request("long", list(range(100, 700)), SamplingParams(max_tokens=1, ignore_eos=True))
    while "long" in llm.requests:
        llm.step()
    assert steps == [10, 256, 256, 91], steps  # (the decode's token and 255, 255, 90 of the prompt)


def test_the_serve_flag_bounds_the_waiting_queue() -> None:
    """``--max-waiting N``: the LLM engine's queue bound (429 past it); 0, as the speech bounds'
    flags: no bound; a negative count is a usage error."""
    from gateway.cli import build_parser
    from modalities.llm.plugin import engine_config

    def waiting(*flags: str) -> int:
        return engine_config(build_parser().parse_args(["serve", *flags]), "m").max_waiting

    assert waiting() == 1024 and waiting("--max-waiting", "8") == 8 and waiting("--max-waiting", "0") > 1 << 30
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--max-waiting", "-1"])


async def test_fcfs_ignores_priority(loaded) -> None:
    async with _async_engine(loaded, max_num_seqs=1) as engine:
        llm = engine.engine
        blocker = engine.generate("blocker", "Hello", LONG)
        await blocker.__anext__()
        gens = [
            engine.generate(name, "Hi", SamplingParams(max_tokens=2), priority=p) for name, p in [("a", 5), ("b", 1)]
        ]
        tasks = [asyncio.ensure_future(g.__anext__()) for g in gens]
        await until(lambda: len(llm.scheduler.waiting) == 2, "both waiting")
        assert [s.request_id for s in llm.scheduler.waiting] == ["a", "b"]
        await blocker.aclose()
        for task, g in zip(tasks, gens, strict=True):
            await task
            async for _ in g:
                pass
        await _idle(engine)


# -- work between steps ------------------------------------------------------------------------
async def test_call_between_steps_runs_on_the_engine_thread_between_steps(loaded) -> None:
    import threading

    async with _async_engine(loaded) as engine:
        llm = engine.engine
        seen: list[tuple[str, int]] = []

        def probe() -> int:
            seen.append((threading.current_thread().name, llm.num_generation_tokens))
            return len(seen)

        def fail() -> None:
            raise RuntimeError("codec broke")

        gen = engine.generate("long", PROMPTS[0], LONG)
        await gen.__anext__()
        assert await engine.call_between_steps(probe) == 1
        with pytest.raises(RuntimeError, match="codec broke"):
            await engine.call_between_steps(fail)
        # The loop goes on after a failed call: wait for a token generated after the first probe
        # (an output already queued before it would let the next probe share its command batch).
        while len((await gen.__anext__()).outputs[0].token_ids) <= seen[0][1]:
            pass
        assert await engine.call_between_steps(probe) == 2
        await gen.aclose()
        assert [name for name, _ in seen] == ["mmserve-engine"] * 2
        assert seen[1][1] > seen[0][1]  # steps ran in between
        await _idle(engine)


async def test_a_grammar_compiles_off_the_engine_thread_while_others_step(loaded) -> None:
    """A big schema takes a while to compile: done on the engine thread, it would stall every
    running stream's steps for that long."""
    import threading

    async with _async_engine(loaded) as engine:
        llm = engine.engine
        compile_guides = llm.guides.new
        seen: list[tuple[str, int, int]] = []

        def slow_compile(grammar: str, n: int = 1) -> list:
            before = llm.num_generation_tokens
            time.sleep(0.5)  # a slow compile
            seen.append((threading.current_thread().name, before, llm.num_generation_tokens))
            return compile_guides(grammar, n)

        llm.guides.new = slow_compile  # type: ignore[method-assign]
        gen = engine.generate("long", PROMPTS[0], LONG)
        await gen.__anext__()
        params = SamplingParams(temperature=0, max_tokens=8, grammar=regex_grammar("(yes|no)"))
        _, text = await _collect(engine, PROMPTS[1], params)
        await gen.aclose()
        [(thread, before, after)] = seen
        assert thread != "mmserve-engine"
        assert after > before  # the running request kept stepping through the compile
        assert text in ("yes", "no")
        await _idle(engine)


async def test_an_engine_that_dies_during_a_compile_refuses_the_request(loaded) -> None:
    async with _async_engine(loaded) as engine:
        llm = engine.engine
        compile_guides = llm.guides.new

        def crash() -> list:
            raise RuntimeError("the device fell over")

        def compile_while_it_dies(grammar: str, n: int = 1) -> list:
            llm.step = crash  # type: ignore[method-assign]
            time.sleep(0.3)  # the loop steps the running request meanwhile: it dies
            return compile_guides(grammar, n)

        llm.guides.new = compile_while_it_dies  # type: ignore[method-assign]
        gen = engine.generate("long", PROMPTS[0], LONG)
        await gen.__anext__()
        params = SamplingParams(temperature=0, max_tokens=8, grammar=regex_grammar("(yes|no)"))
        with pytest.raises(EngineDeadError):
            await asyncio.wait_for(_collect(engine, PROMPTS[1], params), DEADLINE_S)
        with pytest.raises(EngineDeadError):
            await gen.__anext__()


async def test_detokenize_false_gives_the_same_tokens_without_text(loaded) -> None:
    params = dict(temperature=0, max_tokens=12, ignore_eos=True)
    async with _async_engine(loaded) as engine:
        with_text, text = await _collect(engine, PROMPTS[2], SamplingParams(**params))
        ids_only, no_text = await _collect(engine, PROMPTS[2], SamplingParams(**params, detokenize=False))
    assert text and no_text == ""
    assert ids_only[-1].outputs[0].token_ids == with_text[-1].outputs[0].token_ids
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


async def test_stream_interval_reports_every_k_tokens_and_the_end(loaded) -> None:
    params = dict(temperature=0, max_tokens=10, ignore_eos=True)
    (ref,) = _llm(loaded).generate([PROMPTS[1]], SamplingParams(**params))
    async with _async_engine(loaded) as engine:
        outs, text = await _collect(engine, PROMPTS[1], SamplingParams(**params, stream_interval=4))
    assert [len(o.outputs[0].delta_token_ids) for o in outs] == [4, 4, 2]  # the rest with the end
    assert [t for o in outs for t in o.outputs[0].delta_token_ids] == ref.outputs[0].token_ids
    assert text == ref.outputs[0].text and outs[-1].finished
    # A stop string ends the request between reports: the end is reported at once.
    stop = ref.outputs[0].text[-3:]
    async with _async_engine(loaded) as engine:
        outs, _ = await _collect(engine, PROMPTS[1], SamplingParams(**params, stream_interval=100, stop=[stop]))
    assert len(outs) == 1 and outs[0].finished and outs[0].outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="stream_interval"):
        SamplingParams(stream_interval=0)


async def test_a_yielding_engine_steps_only_once_the_foreground_hold_ends(loaded) -> None:
    async with _async_engine(loaded, foreground_wait_s=DEADLINE_S) as engine:
        with FOREGROUND.hold():
            first = asyncio.ensure_future(anext(engine.generate(None, "Hello", LONG)))
            await asyncio.sleep(1.0)
            assert not first.done()  # the engine waits for the hold
        out = await asyncio.wait_for(first, DEADLINE_S)  # released: it steps at once
        assert out.outputs[0].token_ids
        # (its wait began a little after the test's 1 s sleep did: 0.9995 s was seen)
        assert engine.stats()["foreground_wait_seconds_total"] >= 0.9


@pytest.mark.parametrize("wait_s", [0.0, 0.3])
async def test_a_hold_delays_steps_at_most_half_the_time(loaded, wait_s: float) -> None:
    """0: the engine ignores holds. Otherwise it waits at most ``wait_s`` and then steps as long
    as it waited before it waits again: a hold that never ends costs one wait over a few steps."""
    async with _async_engine(loaded, foreground_wait_s=wait_s) as engine:
        with FOREGROUND.hold():
            stream = engine.generate(None, "Hello", SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
            outs = [o async for o in stream]
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 4
        waited = engine.stats()["foreground_wait_seconds_total"]
        assert (waited == 0.0) if wait_s == 0 else (wait_s * 0.9 <= waited < 2 * wait_s), waited


# -- failed steps ----------------------------------------------------------------------------------
def _fail_steps(engine: LLMEngine, times: int) -> list[int]:
    """Make the runner's next ``times`` steps raise after running (their KV written, nothing
    taken); returns the list of step sizes that failed, filled as they fail."""
    real, failed = engine.runner.execute, []

    def execute(sched):
        result = real(sched)
        if len(failed) < times:
            failed.append(len(sched.scheduled))
            raise RuntimeError("injected step failure")
        return result

    engine.runner.execute = execute  # type: ignore[method-assign]
    return failed


def _fail_runs_holding(engine: LLMEngine, prompt_ids: list[int]) -> list[int]:
    """Make every run whose batch holds a sequence of ``prompt_ids`` raise after running (its KV
    written, nothing taken); returns the list of the failed runs' sizes, filled as they fail."""
    real, failed = engine.runner.execute, []

    def execute(sched):
        result = real(sched)
        if any(item.seq.token_ids[: len(prompt_ids)] == prompt_ids for item in sched.scheduled):
            failed.append(len(sched.scheduled))
            raise RuntimeError("injected failure of one request")
        return result

    engine.runner.execute = execute  # type: ignore[method-assign]
    return failed


async def test_a_failed_step_drops_only_the_request_that_fails_alone(loaded) -> None:
    culprit = PROMPTS[2] * 3  # a few full KV blocks: its failed prefill must not cache them
    prompts = [PROMPTS[1], PROMPTS[4], culprit]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = _llm(loaded).generate(prompts, params)
    async with _async_engine(loaded) as engine:
        real = engine.engine.runner.execute
        failed = _fail_runs_holding(engine.engine, engine.engine.tokenizer(culprit).input_ids)
        tasks = [asyncio.ensure_future(_collect(engine, p, params)) for p in prompts]  # one step holds all
        with pytest.raises(RequestFailedError, match="RuntimeError"):
            await tasks[2]
        # The step of 3 was rerun as [first] and [second, culprit], that as [second] and [culprit].
        assert failed == [3, 2, 1]
        for task, ref in zip(tasks[:2], expected, strict=False):  # the others ran on, exactly
            outs, text = await task
            assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids and text == ref.outputs[0].text
        assert engine.dead is None and engine.stats()["failed_steps_total"] == 1
        await _idle(engine)  # the culprit's blocks were freed
        engine.engine.runner.execute = real  # type: ignore[method-assign]
        outs, text = await _collect(engine, culprit, params)
        assert outs[-1].outputs[0].token_ids == expected[2].outputs[0].token_ids and text == expected[2].outputs[0].text
        assert outs[-1].num_cached_tokens == 0  # nothing of its failed prefill was cached
        await _idle(engine)


async def test_a_token_that_cannot_be_taken_fails_its_request_alone(loaded, monkeypatch) -> None:
    """Taking one request's token raises (its detokenizing, say): that request fails, the others
    of the step run on exactly."""
    from engine.output_processor import RequestState

    culprit = PROMPTS[2]
    prompts = [PROMPTS[1], PROMPTS[4], culprit]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    expected = _llm(loaded).generate(prompts, params)
    async with _async_engine(loaded) as engine:
        bad = engine.engine.tokenizer(culprit).input_ids
        real = RequestState.add_token

        def add_token(self, seq, logprob):
            if seq.token_ids[: len(bad)] == bad and seq.num_output_tokens >= 2:
                raise UnicodeDecodeError("utf-8", b"\xff", 0, 1, "injected")
            return real(self, seq, logprob)

        monkeypatch.setattr(RequestState, "add_token", add_token)
        tasks = [asyncio.ensure_future(_collect(engine, p, params)) for p in prompts]  # one step holds all
        with pytest.raises(RequestFailedError, match="UnicodeDecodeError"):
            await tasks[2]
        for task, ref in zip(tasks[:2], expected, strict=False):
            outs, text = await task
            assert outs[-1].outputs[0].token_ids == ref.outputs[0].token_ids and text == ref.outputs[0].text
        assert engine.dead is None
        await _idle(engine)  # the culprit's blocks were freed
        # Alone in its step, again and again: the engine works (its forward passes ran) and serves on.
        for _ in range(MAX_FAILED_STEPS + 1):
            with pytest.raises(RequestFailedError):
                await _collect(engine, culprit, params)
        assert engine.dead is None


async def test_a_step_that_fails_once_loses_none_of_its_requests(loaded) -> None:
    """A transient failure (the run fails after sampling, its halves do not): every request runs
    on exactly as without it, seeded sampled ones too (their generators are put back), n=2 too."""
    prompts = [PROMPTS[2] * 3, PROMPTS[1], PROMPTS[3]]
    params = [
        SamplingParams(temperature=0, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=1.0, seed=5, max_tokens=8, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=9, n=2, max_tokens=8, ignore_eos=True),
    ]
    expected = _llm(loaded).generate(prompts, params)
    async with _async_engine(loaded) as engine:
        failed = _fail_steps(engine.engine, 1)
        results = await asyncio.gather(*(_collect(engine, p, sp) for p, sp in zip(prompts, params, strict=True)))
        assert failed == [3]
        for (outs, _), ref in zip(results, expected, strict=True):
            got = [co.token_ids for co in outs[-1].outputs]
            assert got == [co.token_ids for co in ref.outputs]
        assert engine.dead is None and engine.stats()["failed_steps_total"] == 1
        await _idle(engine)


async def test_a_running_request_fails_mid_stream_and_later_ones_run(loaded) -> None:
    async with _async_engine(loaded) as engine:
        stream = engine.generate(None, "Hello", LONG)
        first = await anext(stream)
        assert first.outputs[0].token_ids and not first.finished
        _fail_steps(engine.engine, 1)
        with pytest.raises(RequestFailedError):
            async for _ in stream:
                pass
        outs, _ = await _collect(engine, "Hello", SamplingParams(temperature=0, max_tokens=3))
        assert outs[-1].finished and len(outs[-1].outputs[0].token_ids) == 3
        await _idle(engine)


async def test_failed_steps_in_a_row_stop_the_engine(loaded) -> None:
    params = SamplingParams(temperature=0, max_tokens=4)
    async with _async_engine(loaded) as engine:
        _fail_steps(engine.engine, MAX_FAILED_STEPS)
        for _ in range(MAX_FAILED_STEPS - 1):
            with pytest.raises(RequestFailedError):
                await _collect(engine, "Hello", params)
            assert engine.dead is None
        with pytest.raises(EngineDeadError):  # the last one in a row: the engine is broken
            await _collect(engine, "Hello", params)
        assert isinstance(engine.dead, RuntimeError)
        with pytest.raises(EngineDeadError):
            await _collect(engine, "Hello", params)


def test_the_sync_engine_raises_a_failed_request(loaded) -> None:
    engine = _llm(loaded, max_num_seqs=1)  # one prompt a step: the failed step holds the first only
    _fail_steps(engine, 1)
    with pytest.raises(RequestFailedError):
        engine.generate(["Hello", "Llamas are"], SamplingParams(temperature=0, max_tokens=2))
    assert not engine.requests  # the other prompt was stopped too
    engine.step()  # (hands out the aborted one's last output)
    assert not engine.has_unfinished_requests() and _kv_all_free(engine)
    out = engine.generate(["Hello"], SamplingParams(temperature=0, max_tokens=2))[0]
    assert len(out.outputs[0].token_ids) == 2 and _kv_all_free(engine)
