"""``mmserve bench embed``: embedding throughput and latency.

1. In-process: our ``EmbeddingEngine`` (one ``embed`` call with every text; the engine thread
   buckets them by length under a token budget) against ``sentence-transformers``
   ``encode(batch_size=32)`` on the same seeded mixed-length texts, in the same process, with
   the same torch thread count; vectors are compared (cosine) and throughput reported.
2. HTTP: ``mmserve serve --only embed`` on a free loopback port, N concurrent clients each
   sending one text per request; throughput and P50/P99 latency.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import random
import socket
import subprocess
import sys
import time
from typing import Any

import numpy as np

from gateway.argtypes import at_least


def make_texts(tokenizer: Any, n: int, seed: int, min_words: int = 2, max_words: int = 160) -> list[str]:
    """``n`` seeded texts of log-uniform word counts, words drawn from the tokenizer's vocabulary."""
    rng = random.Random(seed)
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 2)
    texts = []
    for _ in range(n):
        count = int(round(math.exp(rng.uniform(math.log(min_words), math.log(max_words)))))
        sentence = " ".join(rng.choice(words) for _ in range(count))
        texts.append(sentence[:1].upper() + sentence[1:] + rng.choice(".?!"))
    return texts


def _report(name: str, seconds: float, n: int, tokens: int) -> dict[str, float]:
    print(f"  {name:<34} {seconds:7.2f} s  {n / seconds:8.1f} texts/s  {tokens / seconds:9.0f} tokens/s")
    return {"s": seconds, "texts_per_s": n / seconds, "tokens_per_s": tokens / seconds}


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    """Our engine vs sentence-transformers in this process; returns the figures."""
    import torch
    from sentence_transformers import SentenceTransformer

    from modalities.embed.engine import EmbeddingEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    engine = EmbeddingEngine.from_path(
        args.model,
        max_batch_tokens=args.max_batch_tokens,
        num_workers=args.workers,
        threads_per_worker=args.worker_threads,
    )
    texts = make_texts(engine.tokenizer, args.n, args.seed)
    tokens = sum(len(x) for x in engine.prepare(texts, truncate=-1))
    st = SentenceTransformer(str(engine.model.path), device="cpu")
    print(
        f"{args.n} texts (seed {args.seed}), {tokens} tokens (mean {tokens / args.n:.1f}); torch threads "
        f"{torch.get_num_threads()}; engine {engine.num_workers} workers x {engine.threads_per_worker or 'all'} threads"
    )

    def ours() -> np.ndarray:
        return asyncio.run(engine.embed(texts, truncate=-1)).embeddings

    def ref() -> np.ndarray:
        return np.asarray(st.encode(texts, batch_size=args.batch_size, normalize_embeddings=True))

    def timed(fn: Any) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - start

    st.encode(texts[:64], batch_size=args.batch_size)  # warm-up (before our engine's threads exist)
    times: dict[str, list[float]] = {"mmserve": [], "st": []}
    for i in range(args.repeats):  # interleaved, sentence-transformers first; best of each (shared machine)
        theirs, dt_st = timed(ref)
        if i == 0:
            asyncio.run(engine.embed(texts[:64], truncate=-1))  # warm-up
        mine, dt = timed(ours)
        times["st"].append(dt_st)
        times["mmserve"].append(dt)
        print(f"  run {i}: sentence-transformers {dt_st:.2f} s, mmserve {dt:.2f} s")
    best = {k: min(v) for k, v in times.items()}
    cos = (mine * theirs).sum(1) / (np.linalg.norm(mine, axis=1) * np.linalg.norm(theirs, axis=1))
    stats = engine.stats()
    out = {
        "mmserve": _report("mmserve EmbeddingEngine", best["mmserve"], args.n, tokens),
        "st": _report(f"sentence-transformers bs={args.batch_size}", best["st"], args.n, tokens),
    }
    ratio = best["st"] / best["mmserve"]
    pad = stats["num_padded_tokens"] / max(1, stats["num_tokens"]) - 1
    print(
        f"  speed-up {ratio:.2f}x; min cosine {cos.min():.6f}; engine batches {stats['num_batches']:.0f}, padding {pad:.1%}"
    )
    if cos.min() < 0.9999:
        print("  WARNING: vectors differ from sentence-transformers (cosine < 0.9999)", file=sys.stderr)
    return {**out, "ratio": ratio, "min_cos": float(cos.min())}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_http(args: argparse.Namespace) -> dict[str, float]:
    """Start ``mmserve serve --only embed`` and drive it with ``args.clients`` concurrent clients."""
    import httpx
    from transformers import AutoTokenizer

    from modalities.embed.model import resolve_embed_path

    texts = make_texts(AutoTokenizer.from_pretrained(str(resolve_embed_path(args.model))), args.http_n, args.seed + 1)
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "gateway.cli",
        "serve",
        "--only",
        "embed",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    if args.model:
        cmd += ["--embed", args.model]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    proc = subprocess.Popen(cmd, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{base}/ready", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("mmserve serve --only embed did not become ready")
            time.sleep(0.25)
        return asyncio.run(_drive(base, texts, args.clients))
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()


async def _drive(base: str, texts: list[str], clients: int) -> dict[str, float]:
    import httpx

    latencies: list[float] = []
    queue = list(reversed(texts))
    async with httpx.AsyncClient(base_url=base, timeout=120) as client:
        for t in texts[:8]:  # warm-up
            (await client.post("/v1/embeddings", json={"input": t})).raise_for_status()

        async def worker() -> None:
            while queue:
                text = queue.pop()
                start = time.perf_counter()
                resp = await client.post("/v1/embeddings", json={"input": text, "encoding_format": "base64"})
                resp.raise_for_status()
                latencies.append(time.perf_counter() - start)

        start = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(clients)))
        wall = time.perf_counter() - start
    p50, p99 = np.percentile(np.array(latencies) * 1000, [50, 99])
    print(
        f"  HTTP {clients} clients, {len(texts)} requests: {len(texts) / wall:.1f} req/s, P50 {p50:.0f} ms, P99 {p99:.0f} ms"
    )
    return {"req_per_s": len(texts) / wall, "p50_ms": float(p50), "p99_ms": float(p99)}


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="mmserve bench embed", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="local model directory (default: packaged all-MiniLM-L6-v2)")
    ap.add_argument("--n", type=at_least(int, 1), default=2000, help="texts for the in-process comparison")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=32, help="sentence-transformers batch size")
    ap.add_argument("--max-batch-tokens", type=int, default=4096, help="our engine's padded-token budget")
    ap.add_argument("--workers", type=int, default=None, help="engine model threads (default: min(4, torch threads))")
    ap.add_argument("--worker-threads", type=int, default=None, help="intra-op threads per engine worker")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--threads", type=int, default=None, help="torch threads for both (default: torch's)")
    ap.add_argument("--clients", type=int, default=16, help="concurrent HTTP clients")
    ap.add_argument("--http-n", type=int, default=500, help="HTTP requests (one text each)")
    ap.add_argument("--skip-offline", action="store_true")
    ap.add_argument("--skip-http", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    args = build_parser().parse_args(argv)
    print(f"mmserve bench embed  {time.strftime('%Y-%m-%d %H:%M')}  {' '.join(sys.argv)}")
    if not args.skip_offline:
        run_offline(args)
    if not args.skip_http:
        run_http(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
