"""``mmserve bench tts``: time-to-first-audio (TTFA) and real-time factor, 1 vs N concurrent.

For each backend (``piper``: the packaged voice; ``ar``: the AR TTS on the shared engine, the
tiny random model unless ``--ar-model`` names one) and each concurrency ``c``, ``--rounds``
rounds each start ``c`` requests at once (multi-sentence texts; ``--arrivals closed``: ``c``
clients each send ``--rounds`` requests back to back) and time, per request, the first audio
chunk and the last. Reported: P50/P99 TTFA and their ratio to the ``c=1`` figures (the
target is within 2x at 8), P99 playback stall (how long a listener playing each request's audio
at real time from its first chunk waited for more), P50 per-request real-time factor (wall time /
audio seconds) and the aggregate audio seconds produced per second. ``--url`` measures the same through a running
server's ``/v1/audio/speech`` (time to the first body byte) instead of the engine in-process.
"""

from __future__ import annotations

import argparse
import asyncio
import shlex
import sys
import time
from typing import Any

import numpy as np

from bench.report import Playback
from gateway.argtypes import at_least, counts, output_file

TEXTS = [
    "Sure, I can help with that. The meeting is at three o'clock in the main conference room. "
    "Bring the quarterly report and your notes from last week.",
    "Good morning! Today will be mostly sunny with a high of twenty two degrees. "
    "A light breeze is expected in the afternoon, and the evening should stay clear.",
    "To reset your password, open the settings page and choose security. "
    "Then follow the link we send to your email address.",
    "The train to the airport leaves every fifteen minutes. "
    "The trip takes about half an hour, so plan to arrive early.",
]


def add_tts_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--backends", default="piper,ar", help="comma list of piper, ar")
    ap.add_argument("--concurrency", type=counts, default="1,8", help="comma list of concurrent request counts")
    ap.add_argument("--rounds", type=at_least(int, 1), default=5, help="rounds per concurrency (c requests each)")
    ap.add_argument(
        "--arrivals",
        choices=("burst", "closed"),
        default="burst",
        help="burst: each round's c requests start at once (the target's reading); closed: c clients "
        "each send their next request when the last one's audio is all in (rounds requests each)",
    )
    ap.add_argument("--workers", type=int, default=2, help="Piper workers")
    ap.add_argument("--threads", type=int, default=None, help="onnxruntime threads per Piper worker")
    ap.add_argument("--ar-model", default=None, help="AR TTS directory (default: the tiny random one)")
    ap.add_argument("--ar-max-frames", type=int, default=150, help="frame cap per text piece (AR)")
    ap.add_argument("--ar-device", default="cpu", help="where the AR TTS model and codec run: cpu or cuda")
    ap.add_argument("--url", default=None, help="measure a running server's /v1/audio/speech instead")
    ap.add_argument("--model", default=None, help="with --url: the model to request")
    ap.add_argument("--voice", default=None, help="with --url: the voice to request")
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")


def _pct(xs: list[float], q: float) -> float:
    return float(np.percentile(xs, q)) if xs else float("nan")


async def _one_engine(engine: Any, text: str, voice: str | None) -> dict[str, float]:
    from modalities.tts.protocol import TTSRequest

    start = time.perf_counter()
    first = None
    samples = 0
    player = Playback()
    async for chunk in engine.stream(TTSRequest(text, voice)):
        now = time.perf_counter()
        if first is None:
            first = now - start
        samples += chunk.size
        player.add(now, chunk.size / engine.sample_rate)
    total = time.perf_counter() - start
    return {"ttfa": first or total, "total": total, "audio_s": samples / engine.sample_rate, "stall": player.stall}


async def _one_http(client: Any, url: str, text: str, model: str | None, voice: str | None) -> dict[str, float]:
    body = {"input": text, "response_format": "pcm", **({"model": model} if model else {})}
    body.update({"voice": voice} if voice else {})
    start = time.perf_counter()
    first = None
    size = 0
    player = Playback()
    async with client.stream("POST", f"{url.rstrip('/')}/v1/audio/speech", json=body) as resp:
        resp.raise_for_status()
        async for data in resp.aiter_bytes():
            now = time.perf_counter()
            if first is None and data:
                first = now - start
            size += len(data)
            player.add(now, len(data) / 2 / 24_000)
    total = time.perf_counter() - start
    return {"ttfa": first or total, "total": total, "audio_s": size / 2 / 24_000, "stall": player.stall}


async def _closed_loop(one: Any, c: int, rounds: int) -> list[dict[str, float]]:
    """``c`` clients, each sending its next request as soon as its last one's audio is all in."""

    async def client(i: int) -> list[dict[str, float]]:
        return [await one(TEXTS[(r + i) % len(TEXTS)]) for r in range(rounds)]

    return [run for runs in await asyncio.gather(*(client(i) for i in range(c))) for run in runs]


async def _measure(one: Any, concurrencies: list[int], rounds: int, arrivals: str = "burst") -> list[dict[str, Any]]:
    await one(TEXTS[0])  # warm-up
    rows: list[dict[str, Any]] = []
    for c in concurrencies:
        runs: list[dict[str, float]] = []
        start = time.perf_counter()
        if arrivals == "closed":
            runs = await _closed_loop(one, c, rounds)
        else:
            for r in range(rounds):
                runs += await asyncio.gather(*(one(TEXTS[(r + i) % len(TEXTS)]) for i in range(c)))
        wall = time.perf_counter() - start
        ttfa = [x["ttfa"] for x in runs]
        rows.append(
            {
                "concurrency": c,
                "requests": len(runs),
                "ttfa_p50_ms": round(_pct(ttfa, 50) * 1000, 1),
                "ttfa_p99_ms": round(_pct(ttfa, 99) * 1000, 1),
                "stall_p99_ms": round(_pct([x["stall"] for x in runs], 99) * 1000, 1),
                "rtf_p50": round(_pct([x["total"] / x["audio_s"] for x in runs if x["audio_s"]], 50), 3),
                "audio_s_per_s": round(sum(x["audio_s"] for x in runs) / wall, 2),
            }
        )
    base = rows[0]
    for row in rows:
        row["p50_vs_c1"] = round(row["ttfa_p50_ms"] / base["ttfa_p50_ms"], 2)
        row["p99_vs_c1"] = round(row["ttfa_p99_ms"] / base["ttfa_p99_ms"], 2)
    return rows


async def _bench_backend(name: str, args: argparse.Namespace, concurrencies: list[int]) -> list[dict[str, Any]]:
    if name == "piper":
        from modalities.tts.piper_engine import PiperEngine

        engine: Any = PiperEngine(workers=args.workers, threads=args.threads)
    elif name == "ar":
        from modalities.tts.ar_engine import ARTTSEngine
        from modalities.tts.tiny import tiny_tts_ar_dir

        engine = ARTTSEngine.from_dir(
            args.ar_model or tiny_tts_ar_dir(), max_frames=args.ar_max_frames, device=args.ar_device
        )
    else:
        raise SystemExit(f"unknown backend {name!r} (piper, ar)")
    await engine.start()
    try:
        return await _measure(lambda text: _one_engine(engine, text, None), concurrencies, args.rounds, args.arrivals)
    finally:
        await engine.shutdown()


def run_tts(args: argparse.Namespace) -> dict[str, Any]:
    from bench.report import print_table, save_result, versions_of

    concurrencies = [int(c) for c in args.concurrency.split(",")]
    results: dict[str, Any] = {"command": args.command_line, "versions": versions_of(), "backends": {}}
    if args.url:
        import httpx

        async def http() -> list[dict[str, Any]]:
            async with httpx.AsyncClient(timeout=300) as client:
                return await _measure(
                    lambda t: _one_http(client, args.url, t, args.model, args.voice),
                    concurrencies,
                    args.rounds,
                    args.arrivals,
                )

        results["backends"]["http"] = asyncio.run(http())
    else:
        for name in args.backends.split(","):
            results["backends"][name] = asyncio.run(_bench_backend(name, args, concurrencies))
    for name, rows in results["backends"].items():
        print(f"\n{name}:")
        print_table(rows, list(rows[0]))
    if args.out:
        print(f"wrote {save_result(results, args.out)}")
    return results


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser(prog="mmserve bench tts", description=__doc__.split("\n\n")[0])
    add_tts_args(ap)
    args = ap.parse_args(argv)
    args.command_line = "mmserve bench tts " + shlex.join(argv)
    run_tts(args)
    return 0
