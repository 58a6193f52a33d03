"""Where does an mmserve engine step spend its time? ``mmserve bench profile``.

Runs a fixed batch (``--batch`` requests of ``--prompt-len`` tokens) through the prefill, then
times ``--steps`` pure decode steps, splitting each step into: scheduler, runner input building,
attention-backend prepare, attention (KV write + gather + SDPA, all layers), the rest of the
model (linear layers, norms, rotary...), LM head, sampler and the engine's output bookkeeping.
Finally prints torch.profiler's top operators over a few decode steps.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any


def add_profile_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--torch-profiler-steps", type=int, default=3)


class _Timers:
    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.enabled = False

    def wrap(self, obj: Any, attr: str, label: str) -> None:
        fn: Callable[..., Any] = getattr(obj, attr)

        def timed(*a: Any, **kw: Any) -> Any:
            if not self.enabled:
                return fn(*a, **kw)
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                self.total[label] += time.perf_counter() - t0

        setattr(obj, attr, timed)

    def wrap_callable(self, obj: Any, attr: str, label: str) -> None:
        """Like ``wrap`` for a callable object (the runner's sampler) whose other attributes are
        still used: its calls are timed, the rest is forwarded."""
        timers = self

        class Timed:
            def __init__(self, inner: Any) -> None:
                self.inner = inner

            def __getattr__(self, name: str) -> Any:
                return getattr(self.inner, name)

            def __call__(self, *a: Any, **kw: Any) -> Any:
                if not timers.enabled:
                    return self.inner(*a, **kw)
                t0 = time.perf_counter()
                try:
                    return self.inner(*a, **kw)
                finally:
                    timers.total[label] += time.perf_counter() - t0

        setattr(obj, attr, Timed(getattr(obj, attr)))


def run_profile(args: argparse.Namespace) -> dict[str, float]:
    import torch

    from bench.workload import resolve_model_dir
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    model = resolve_model_dir(args.model)
    eng = LLMEngine(EngineConfig(model=str(model), num_threads=args.threads, max_num_seqs=max(64, args.batch)))
    rng = random.Random(0)
    vocab = eng.adapter.vocab_size
    sp = SamplingParams(temperature=0, max_tokens=10_000 // 10, ignore_eos=True)
    for i in range(args.batch):
        eng.add_request(f"p{i}", [rng.randrange(100, vocab - 100) for _ in range(args.prompt_len)], sp)
    t0 = time.perf_counter()
    while any(s.num_computed_tokens < s.num_prompt_tokens for s in eng.scheduler.running) or eng.scheduler.waiting:
        eng.step()
    prefill_s = time.perf_counter() - t0
    print(f"prefill of {args.batch}x{args.prompt_len} tokens: {prefill_s:.2f}s")

    tm = _Timers()
    runner, backend, adapter = eng.runner, eng.runner.backend, eng.adapter
    tm.wrap(eng.scheduler, "schedule", "scheduler.schedule")
    tm.wrap(eng.scheduler, "update", "scheduler.update")
    tm.wrap(runner, "execute", "runner.execute (all)")
    tm.wrap(backend, "prepare", "attn prepare (per step)")
    tm.wrap(backend, "forward", "attention (all layers)")
    tm.wrap(adapter, "forward", "model forward (all)")
    tm.wrap(adapter, "compute_logits", "lm head")
    tm.wrap_callable(runner, "sampler", "sampler")
    tm.enabled = True
    step_times = []
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ts = time.perf_counter()
        eng.step()
        step_times.append(time.perf_counter() - ts)
    wall = time.perf_counter() - t0
    tm.enabled = False
    t = tm.total
    rows = {
        "scheduler (schedule+update)": t["scheduler.schedule"] + t["scheduler.update"],
        "runner input building": t["runner.execute (all)"]
        - t["attn prepare (per step)"]
        - t["model forward (all)"]
        - t["lm head"]
        - t["sampler"],
        "attn prepare (per step)": t["attn prepare (per step)"],
        "attention (KV write+gather+SDPA)": t["attention (all layers)"],
        "rest of model (linears, norms, rope)": t["model forward (all)"] - t["attention (all layers)"],
        "lm head": t["lm head"],
        "sampler": t["sampler"],
    }
    rows["engine bookkeeping (outputs, detok)"] = wall - sum(rows.values())
    ctx = sum(s.num_tokens for s in eng.scheduler.running) / max(1, len(eng.scheduler.running))
    print(f"\n{args.steps} decode steps, batch {args.batch}, mean context {ctx:.0f}, {args.threads} threads: ")
    print(f"{wall / args.steps * 1000:.1f} ms/step = {args.batch * args.steps / wall:.1f} tok/s")
    st = sorted(step_times)
    print(f"  step ms: min {st[0] * 1000:.1f}  median {st[len(st) // 2] * 1000:.1f}  max {st[-1] * 1000:.1f}")
    for k, v in sorted(rows.items(), key=lambda kv: -kv[1]):
        print(f"  {k:40s} {v / args.steps * 1000:8.2f} ms/step  {100 * v / wall:5.1f}%")

    if args.torch_profiler_steps > 0:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU]) as prof:
            for _ in range(args.torch_profiler_steps):
                eng.step()
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=40))
    del torch
    return {k: v / args.steps for k, v in rows.items()} | {"step_s": wall / args.steps}
