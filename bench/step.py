"""A/B of engine step time on one machine: ``mmserve bench step``.

Builds one engine per ``--variants`` entry on the same loaded weights, one per variant of the
lean Llama-family forward (``packed``: oneDNN weights prepacked once, the default; ``unpacked``:
plain weights that oneDNN reorders on every call; ``gguf``: packed plus the GGUF file's own
blocks for decode-sized batches and short prefills, ``quantization="auto"``), feeds each the same
batch, then times the prefill and the decode steps alternating between them, round by round.
``--turn-tokens`` then times what a chat turn pays: the prefill of that many new tokens after the
batch's first prompt, which is in the prefix cache. Same-run ratios stay meaningful on a machine
shared with other jobs; absolute times do not.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import time
from typing import Any

from gateway.argtypes import at_least

VARIANTS = ("unpacked", "packed", "gguf")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench step", description=__doc__.splitlines()[0])
    add_batch_args(ap, batch=6, prompt_len=128, steps=10, rounds=5, threads=os.cpu_count() or 1)
    ap.add_argument("--variants", default="unpacked,packed", help=f"comma list of {', '.join(VARIANTS)}")
    ap.add_argument(
        "--guided-regex",
        default=None,
        help="hold every sequence to this regex (structured outputs' mask per step); it must not "
        "end before the run does, e.g. '[a-z ]{4000,}'",
    )
    ap.add_argument(
        "--turn-tokens",
        default="",
        help="comma list: also time the prefill of this many new tokens after a cached prompt (a turn)",
    )
    args = ap.parse_args(argv)
    args.variants = [v for v in args.variants.split(",") if v]
    if not args.variants or set(args.variants) - set(VARIANTS):
        ap.error(f"--variants: choose from {', '.join(VARIANTS)}")
    try:
        args.turn_tokens = [int(n) for n in args.turn_tokens.split(",") if n]
    except ValueError:
        ap.error("--turn-tokens: a comma list of token counts")
    run_step_ab(args)
    return 0


def add_batch_args(
    ap: argparse.ArgumentParser, batch: int, prompt_len: int, steps: int, rounds: int, threads: int
) -> None:
    """The flags of a decode-batch timing (here and ``bench.threads``)."""
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=at_least(int, 1), default=batch, help="concurrent sequences")
    ap.add_argument("--prompt-len", type=int, default=prompt_len)
    ap.add_argument("--steps", type=int, default=steps, help="decode steps per round")
    ap.add_argument("--rounds", type=at_least(int, 1), default=rounds)
    ap.add_argument("--threads", type=int, default=threads, help="torch threads")


def engine_config(args: argparse.Namespace) -> Any:
    """An ``EngineConfig`` that holds ``args.batch`` sequences of ``args.prompt_len`` tokens."""
    from bench.workload import resolve_model_dir
    from engine.config import EngineConfig

    return EngineConfig(
        model=str(resolve_model_dir(args.model)),
        num_threads=args.threads,
        max_num_seqs=max(64, args.batch),
        max_num_batched_tokens=max(2048, args.prompt_len),
        kv_cache_memory_bytes=512 << 20,
    )


def batch_prompts(engine: Any, args: argparse.Namespace) -> list[list[int]]:
    """``args.batch`` random prompts of ``args.prompt_len`` tokens (seeded: the same every time)."""
    rng = random.Random(0)
    vocab = engine.adapter.vocab_size
    return [[rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)] for _ in range(args.batch)]


def fill_batch(engine: Any, args: argparse.Namespace, decode_steps: int) -> None:
    """Add ``batch_prompts`` as requests that outlive ``decode_steps`` decode steps."""
    from engine.sampling_params import SamplingParams

    grammar = None
    if getattr(args, "guided_regex", None):
        from engine.structured import regex_grammar

        grammar = regex_grammar(args.guided_regex)
    sp = SamplingParams(temperature=0, max_tokens=decode_steps + 8, ignore_eos=grammar is None, grammar=grammar)
    for i, prompt in enumerate(batch_prompts(engine, args)):
        engine.add_request(f"r{i}", prompt, sp)


def prefill(engine: Any) -> None:
    """Step until every added prompt is computed."""
    sched = engine.scheduler
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in sched.running) or sched.waiting:
        engine.step()


def _engines(args: argparse.Namespace) -> dict[str, Any]:
    from engine import fast_decoder
    from engine.gguf_blocks import model_blocks
    from engine.llm_engine import LLMEngine
    from engine.model_loader import gguf_origin, load_model
    from engine.native import blockq_linear_kernel

    config = engine_config(args)
    loaded = load_model(config.model, config.dtype, config.device, config.max_model_len)
    if not fast_decoder.supports(loaded.model):
        raise SystemExit(f"{args.model}: not a Llama-family model, no lean forward to compare")
    origin = gguf_origin(loaded.path)
    if "gguf" in args.variants and origin is None:
        raise SystemExit(f"{args.model}: not converted from a .gguf file, no blocks to compare")
    if "gguf" in args.variants and blockq_linear_kernel() is None:
        raise SystemExit("the GGUF block kernel cannot run here (needs AVX2/FMA and a C compiler)")

    def adapter(name: str) -> Any:
        blocks = model_blocks(loaded.model, origin) if name == "gguf" else None  # type: ignore[arg-type]
        return fast_decoder.FastDecoderLM(loaded.model, prepack=name != "unpacked", blocks=blocks)

    return {name: LLMEngine(config, loaded, adapter=adapter(name)) for name in args.variants}


def run_step_ab(args: argparse.Namespace) -> dict[str, dict[str, float]]:
    engines = _engines(args)
    prefill_s: dict[str, float] = {}
    for name, eng in engines.items():  # alternating per engine: prefill is one step per batch
        fill_batch(eng, args, args.rounds * args.steps)  # no sequence finishes during the timed steps
        t0 = time.perf_counter()
        prefill(eng)
        prefill_s[name] = time.perf_counter() - t0
    decode: dict[str, list[float]] = {name: [] for name in engines}
    for _ in range(args.rounds):
        for name, eng in engines.items():
            t0 = time.perf_counter()
            for _ in range(args.steps):
                eng.step()
            decode[name].append((time.perf_counter() - t0) / args.steps)
    for name, eng in engines.items():
        if len(eng.scheduler.running) < args.batch:
            print(f"warning: {name}: a sequence finished during the timed steps (not a full batch throughout)")
    first = next(iter(engines))
    base = statistics.median(decode[first])
    print(f"batch {args.batch}, prompt {args.prompt_len}, {args.threads} threads, {args.rounds}x{args.steps} steps")
    out = {}
    for name in engines:
        med = statistics.median(decode[name])
        spread = f"{min(decode[name]) * 1e3:.1f}-{max(decode[name]) * 1e3:.1f}"
        print(
            f"  {name:9s} prefill {prefill_s[name]:6.2f} s   decode median {med * 1e3:7.1f} ms/step "
            f"(rounds {spread})   speed-up vs {first} {base / med:.2f}x"
        )
        out[name] = {"prefill_s": prefill_s[name], "decode_step_s": med}
    for n in args.turn_tokens:
        turn = _turn_prefills(engines, batch_prompts(engines[first], args)[0], n, args.rounds)
        for name, times in turn.items():
            med = statistics.median(times)
            print(
                f"  {name:9s} turn of {n:4d} new tokens: prefill median {med * 1e3:7.1f} ms "
                f"(rounds {min(times) * 1e3:.1f}-{max(times) * 1e3:.1f})   speed-up vs {first} "
                f"{statistics.median(turn[first]) / med:.2f}x"
            )
            out[name][f"turn_{n}_prefill_s"] = med
    return out


def _turn_prefills(engines: dict[str, Any], base: list[int], n: int, rounds: int) -> dict[str, list[float]]:
    """Per engine, ``rounds`` timings (alternating) of a prefill of ``n`` new tokens after ``base``
    (the batch's first prompt: prefix-cached), each with its own random tokens (no hit on them)."""
    from engine.sampling_params import SamplingParams

    rng = random.Random(n)
    one = SamplingParams(temperature=0, max_tokens=1)
    times: dict[str, list[float]] = {name: [] for name in engines}
    for eng in engines.values():
        while eng.scheduler.running or eng.scheduler.waiting:  # the batch's last tokens
            eng.step()
    for r in range(rounds):
        for name, eng in engines.items():
            new = [rng.randrange(100, eng.adapter.vocab_size - 100) for _ in range(n)]
            eng.add_request(f"turn-{n}-{r}", base + new, one)
            t0 = time.perf_counter()
            while eng.scheduler.running or eng.scheduler.waiting:
                eng.step()
            times[name].append(time.perf_counter() - t0)
    return times
