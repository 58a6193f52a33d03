"""Online latency: Poisson load against any OpenAI-compatible ``/v1/completions`` (streaming).

Per request: TTFT (send → first streamed token chunk), ITL (every gap between token chunks),
TPOT = (E2E − TTFT) / (output_tokens − 1), E2E. Output tokens come from the server's usage
(``stream_options.include_usage``) when it sends one, else from the number of token chunks.
Goodput counts the requests that meet both SLOs (TTFT and TPOT) per second of benchmark time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from bench.report import percentiles, print_table, save_result, versions_of
from bench.workload import BenchRequest, make_workload, resolve_model_dir, usable_token_ids, workload_spec


@dataclass
class RequestResult:
    ok: bool
    prompt_tokens: int
    max_tokens: int
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str | None = None

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


def add_online_args(ap: argparse.ArgumentParser, with_workload: bool = True) -> None:
    if with_workload:
        from bench.offline import add_workload_args

        add_workload_args(ap)
        ap.add_argument("--threads", type=int, default=None, help="threads for a launched server (default: all)")
        ap.add_argument("--max-num-seqs", type=int, default=64)
        ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
        ap.add_argument("--kv-cache-gib", type=float, default=2.0)
        ap.add_argument("--vllm-venv", type=Path, default=None)
        ap.add_argument("--vllm-bind", default=None)
        ap.add_argument(
            "--quantization",
            default="none",
            choices=["none", "auto", "gguf"],
            help="a launched mmserve's --quantization (default none: fp32, as vLLM runs it)",
        )
    ap.add_argument("--base-url", default=None, help="e.g. http://127.0.0.1:8000 (or use --launch)")
    ap.add_argument("--launch", default=None, help="mmserve, vllm or mmserve,vllm: start each on a free port in turn")
    ap.add_argument("--served-model", default=None, help="model name for requests (default: first of /v1/models)")
    ap.add_argument("--rate", type=float, default=1.0, help="Poisson arrival rate, req/s (inf: all at once)")
    ap.add_argument("--prompt-mode", choices=["ids", "text"], default="ids", help="send token ids or decoded text")
    ap.add_argument("--slo-ttft-ms", type=float, default=2000.0)
    ap.add_argument("--slo-tpot-ms", type=float, default=200.0)
    ap.add_argument("--warmup-requests", type=int, default=2)
    ap.add_argument("--request-timeout", type=float, default=600.0)
    ap.add_argument("--no-plot", action="store_true")


async def _one_request(
    client: httpx.AsyncClient, url: str, model: str, prompt: list[int] | str, req: BenchRequest
) -> RequestResult:
    body = {
        "model": model,
        "prompt": prompt,
        "max_tokens": req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,  # vLLM and mmserve extension
    }
    res = RequestResult(ok=False, prompt_tokens=len(req.prompt_token_ids), max_tokens=req.max_tokens)
    t0 = time.perf_counter()
    last = None
    chunks = 0
    usage_tokens = None
    try:
        async with client.stream("POST", url, json=body) as resp:
            if resp.status_code != 200:
                res.error = f"HTTP {resp.status_code}: {(await resp.aread())[:300]!r}"
                return res
            async for line in resp.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                msg = json.loads(data)
                if msg.get("usage"):
                    usage_tokens = msg["usage"].get("completion_tokens")
                if not msg.get("choices"):
                    continue
                now = time.perf_counter()
                if last is None:
                    res.ttft = now - t0
                else:
                    res.itl.append(now - last)
                last = now
                chunks += 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = time.perf_counter() - t0
    res.output_tokens = usage_tokens if usage_tokens is not None else chunks
    res.ok = chunks > 0
    if not res.ok:
        res.error = "no streamed tokens"
    return res


async def run_load(
    base_url: str,
    model: str,
    reqs: list[BenchRequest],
    prompts: list[list[int] | str],
    rate: float,
    seed: int,
    timeout: float,
    warmup: int = 2,
) -> tuple[list[RequestResult], float]:
    url = f"{base_url.rstrip('/')}/v1/completions"
    limits = httpx.Limits(max_connections=len(reqs) + 8, max_keepalive_connections=len(reqs) + 8)
    async with httpx.AsyncClient(timeout=httpx.Timeout(timeout), limits=limits) as client:
        for i in range(min(warmup, len(reqs))):  # untimed: lets the server compile/allocate first
            w = BenchRequest(reqs[i].prompt_token_ids[:32], 4)
            await _one_request(client, url, model, w.prompt_token_ids, w)
        rng = random.Random(seed + 1)
        from tqdm import tqdm

        bar = tqdm(total=len(reqs), desc=f"online @ {rate} req/s", file=sys.stderr)

        async def fire(delay: float, i: int) -> RequestResult:
            await asyncio.sleep(delay)
            r = await _one_request(client, url, model, prompts[i], reqs[i])
            bar.update(1)
            return r

        delays, t = [], 0.0
        for _ in reqs:
            delays.append(t)
            if rate != float("inf"):
                t += rng.expovariate(rate)
        start = time.perf_counter()
        results = await asyncio.gather(*(fire(d, i) for i, d in enumerate(delays)))
        duration = time.perf_counter() - start
        bar.close()
    return list(results), duration


def summarize(results: list[RequestResult], duration: float, slo_ttft_ms: float, slo_tpot_ms: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    ms = 1000.0
    ttft = [r.ttft * ms for r in ok]
    tpot = [t * ms for r in ok if (t := r.tpot) is not None]
    itl = [g * ms for r in ok for g in r.itl]
    e2e = [r.e2e * ms for r in ok]
    good = [r for r in ok if r.ttft * ms <= slo_ttft_ms and (r.tpot is None or r.tpot * ms <= slo_tpot_ms)]
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "errors": sorted({r.error for r in results if r.error})[:5],
        "duration_s": duration,
        "request_throughput": len(ok) / duration,
        "output_throughput": out_tokens / duration,
        "output_tokens": out_tokens,
        "goodput_req_s": len(good) / duration,
        "slo_attainment": len(good) / len(results),
        "slo": {"ttft_ms": slo_ttft_ms, "tpot_ms": slo_tpot_ms},
        "ttft_ms": percentiles(ttft),
        "tpot_ms": percentiles(tpot),
        "itl_ms": percentiles(itl),
        "e2e_ms": percentiles(e2e),
    }


def plot(runs: dict[str, list[RequestResult]], path: Path, title: str) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for name, results in runs.items():
        ok = [r for r in results if r.ok]
        series = {
            "TTFT (ms)": [r.ttft * 1000 for r in ok],
            "TPOT (ms)": [t * 1000 for r in ok if (t := r.tpot) is not None],
            "ITL (ms)": [g * 1000 for r in ok for g in r.itl],
        }
        for ax, (label, xs) in zip(axes, series.items(), strict=False):
            xs = sorted(xs)
            if xs:
                ax.plot(xs, [(i + 1) / len(xs) for i in range(len(xs))], label=name)
            ax.set_xlabel(label)
            ax.set_ylabel("CDF")
            ax.grid(alpha=0.3)
    axes[2].set_xscale("log")
    for ax in axes:
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _served_model(base_url: str) -> str:
    data = httpx.get(f"{base_url.rstrip('/')}/v1/models", timeout=10).json()
    return str(data["data"][0]["id"])


def _run_one(
    args: argparse.Namespace, name: str, model_dir: Path, reqs: list[BenchRequest], prompts: list[list[int] | str],
    run_dir: Path,
) -> tuple[dict[str, Any], list[RequestResult]]:  # fmt: skip
    import os

    from bench.offline import DEFAULT_VLLM_VENV
    from bench.servers import free_port, launch, server_command

    server = None
    info: dict[str, Any] = {}
    if name in ("mmserve", "vllm"):
        threads = args.threads or os.cpu_count() or 1
        cmd, env = server_command(
            name, model_dir, free_port(), threads, args.max_num_seqs, args.max_num_batched_tokens,
            args.kv_cache_gib, args.vllm_venv or DEFAULT_VLLM_VENV, args.vllm_bind, args.quantization,
        )  # fmt: skip
        server = launch(name, cmd, env, run_dir)
        base_url = server.base_url
        info = {"server_cmd": " ".join(cmd), "startup_s": server.startup_s, "threads": threads}
        info["env"] = {k: v for k, v in env.items() if k.startswith(("VLLM_CPU", "OMP"))}
    else:
        base_url = args.base_url
    try:
        model = args.served_model or _served_model(base_url)
        results, duration = asyncio.run(
            run_load(base_url, model, reqs, prompts, args.rate, args.seed, args.request_timeout, args.warmup_requests)
        )
    finally:
        if server is not None:
            server.stop()
    stats = summarize(results, duration, args.slo_ttft_ms, args.slo_tpot_ms)
    summary = {"kind": "online", "server": name, "base_url": base_url, "rate": args.rate, **info, **stats}
    summary["requests"] = [asdict(r) | {"tpot": r.tpot} for r in results]
    save_result(summary, run_dir / f"{name}.json")
    return summary, results


def run_online_cli(args: argparse.Namespace) -> dict[str, Any]:
    """``--base-url URL`` benchmarks a running server; ``--launch mmserve,vllm`` starts each in turn."""
    names = [n.strip() for n in (args.launch or "").split(",") if n.strip()]
    bad = [n for n in names if n not in ("mmserve", "vllm")]
    if bad or (not names and not args.base_url):
        raise SystemExit("give --base-url URL or --launch with a comma list of mmserve,vllm")
    if not names:
        names = ["server"]
    model_dir = resolve_model_dir(args.model).resolve()
    spec = workload_spec(args)
    reqs = make_workload(spec, usable_token_ids(model_dir))
    prompts: list[list[int] | str] = [r.prompt_token_ids for r in reqs]
    if args.prompt_mode == "text":
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(str(model_dir))
        prompts = [tok.decode(r.prompt_token_ids) for r in reqs]
    run_dir = args.out_dir / f"online-{'-'.join(names)}-{time.strftime('%Y%m%d-%H%M%S')}"
    versions = versions_of()  # at start: the engine code a launched mmserve imports
    runs = {name: _run_one(args, name, model_dir, reqs, prompts, run_dir) for name in names}
    summaries = [s for s, _ in runs.values()]
    summary: dict[str, Any] = {
        "kind": "online",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": getattr(args, "command_line", " ".join(sys.argv)),
        "model": str(model_dir),
        "rate": args.rate,
        "workload": asdict(spec) | {"prompt_mode": args.prompt_mode},
        "versions": versions,
        "servers": [{k: v for k, v in s.items() if k != "requests"} for s in summaries],
    }
    if not args.no_plot:
        title = f"{' vs '.join(names)} @ {args.rate} req/s, {spec.num_requests} requests"
        summary["plot"] = str(plot({n: r for n, (_, r) in runs.items()}, run_dir / "latency.png", title))
    save_result(summary, run_dir / "summary.json")
    print_online(summaries)
    print(f"results: {run_dir / 'summary.json'}" + (f", plot: {summary['plot']}" if "plot" in summary else ""))
    return summary


def print_online(summaries: list[dict[str, Any]]) -> None:
    rows = []
    for s in summaries:
        row: dict[str, Any] = {"server": s["server"], "rate": s["rate"], "ok": s["completed"], "fail": s["failed"]}
        for m in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
            for p in ("p50", "p90", "p99"):
                v = s[m][p]
                row[f"{m[:-3]} {p}"] = None if v is None else round(v, 1)
        row["req/s"] = round(s["request_throughput"], 3)
        row["out tok/s"] = round(s["output_throughput"], 1)
        row["goodput"] = round(s["goodput_req_s"], 3)
        rows.append(row)
    print_table(rows, list(rows[0]))
    for s in summaries:
        if s["errors"]:
            print(f"{s['server']} errors: {s['errors']}")
