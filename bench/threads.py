"""Engine decode step time on the main thread vs a worker thread: ``mmserve bench threads``.

The served engine steps on its own thread (``AsyncEngine``), and other threads of the process
run torch ops too, each with its own OpenMP team. This builds one engine, fills a decode batch,
then alternates rounds of decode steps on the main thread and on one long-lived worker thread,
and reports the medians. Run it with and without the OpenMP settings to compare, e.g.
``OMP_WAIT_POLICY= GOMP_SPINCOUNT= mmserve bench threads`` (empty values: libgomp's defaults)
against plain ``mmserve bench threads`` (mmserve's defaults, ``gateway.cli.openmp_defaults``).
"""

from __future__ import annotations

import argparse
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable

from bench.step import add_batch_args, engine_config, fill_batch, prefill


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench threads", description=__doc__.splitlines()[0])
    add_batch_args(ap, batch=2, prompt_len=300, steps=15, rounds=6, threads=2)
    args = ap.parse_args(argv)
    run(args)
    return 0


def run(args: argparse.Namespace) -> dict[str, float]:
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(engine_config(args))
    fill_batch(engine, args, args.rounds * 2 * args.steps + 5)  # every sequence outlives the run
    prefill(engine)
    for _ in range(5):  # a few decode steps to warm up
        engine.step()

    def timed() -> list[float]:
        out = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            engine.step()
            out.append(time.perf_counter() - t0)
        return out

    worker = _Worker()
    times: dict[str, list[float]] = {"main thread": [], "worker thread": []}
    for _ in range(args.rounds):
        times["main thread"] += timed()
        times["worker thread"] += worker.call(timed)
    worker.stop()
    medians = {k: 1000 * statistics.median(v) for k, v in times.items()}
    env = {k: os.environ.get(k, "(unset)") for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    print(f"batch {args.batch} x ~{args.prompt_len} tokens, {args.threads} threads, {env}")
    for k, v in medians.items():
        print(f"  {k:14s} decode step median {v:7.2f} ms")
    print(f"  worker / main: {medians['worker thread'] / medians['main thread']:.2f}x")
    return medians


class _Worker:
    """One long-lived thread that runs the calls it is given (as the engine thread does)."""

    def __init__(self) -> None:
        self.calls: queue.Queue[Callable[[], list[float]] | None] = queue.Queue()
        self.results: queue.Queue[list[float]] = queue.Queue()
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (fn := self.calls.get()) is not None:
            self.results.put(fn())

    def call(self, fn: Callable[[], list[float]]) -> list[float]:
        self.calls.put(fn)
        return self.results.get()

    def stop(self) -> None:
        self.calls.put(None)
        self.thread.join()
