"""Offline throughput: the same seeded workload through each engine, one fresh subprocess per engine.

Engines: ``mmserve`` (LLMEngine in-process), ``hf-static`` (``model.generate``, fixed batches, left
padding), ``hf-cb`` (transformers continuous batching) and ``vllm`` (the peer venv's vLLM CPU
build). Only the generation call is timed (model load, compilation and a 2-request warm-up are
not). Output-token accounting: every engine is credited with exactly the requested
``max_tokens`` per request; hf-static really computes ``batch_max`` tokens per row, the surplus is
reported as ``computed_output_tokens`` but not counted as useful output.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from bench.report import print_table, save_result, versions_of
from bench.workload import (
    load_workload,
    make_workload,
    resolve_model_dir,
    save_workload,
    usable_token_ids,
    workload_spec,
)

ENGINES = ("mmserve", "hf-static", "hf-cb", "vllm")
DEFAULT_VLLM_VENV = Path("~/.cache/peers/vllm-cpu").expanduser()
REPO_ROOT = Path(__file__).resolve().parent.parent


def add_workload_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--model", default="smollm2", help="HF directory or a name engine.model_loader resolves")
    ap.add_argument("--num-requests", type=int, default=48)
    ap.add_argument("--min-prompt-len", type=int, default=64)
    ap.add_argument("--max-prompt-len", type=int, default=512)
    ap.add_argument("--min-output-len", type=int, default=32)
    ap.add_argument("--max-output-len", type=int, default=256)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="every request's (default 0: greedy)")
    ap.add_argument("--top-p", type=float, default=1.0, help="every request's nucleus (with --temperature > 0)")
    ap.add_argument("--out-dir", type=Path, default=Path("bench_results"))


def add_offline_args(ap: argparse.ArgumentParser) -> None:
    add_workload_args(ap)
    ap.add_argument("--engines", default=",".join(ENGINES), help=f"comma list out of {','.join(ENGINES)}")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch/OpenMP threads per engine")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument(
        "--device", default="cpu", help="where mmserve and transformers run (cpu or cuda; vLLM: its build's)"
    )
    ap.add_argument("--vllm-venv", type=Path, default=DEFAULT_VLLM_VENV)
    ap.add_argument(
        "--vllm-bind",
        default=None,
        help="VLLM_CPU_OMP_THREADS_BIND (default: '0-<threads-1>', i.e. the worker gets all --threads cores; "
        "'auto' is vLLM's own default, which reserves a core for its scheduler: 1 worker thread on 2 cores)",
    )
    ap.add_argument("--timeout", type=float, default=3600, help="seconds per engine")


def vllm_env(threads: int, bind: str | None, kv_gib: float) -> dict[str, str]:
    env = dict(os.environ)
    # The peer runs with its own OpenMP settings, not the ones `mmserve` defaulted for itself.
    ours = env.pop("MMSERVE_OMP_DEFAULTS", "")
    for k in ("OMP_NUM_THREADS", "PYTHONPATH", "VIRTUAL_ENV", *filter(None, ours.split(","))):
        env.pop(k, None)
    env["VLLM_CPU_OMP_THREADS_BIND"] = bind if bind is not None else (f"0-{threads - 1}" if threads > 1 else "0")
    env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(kv_gib)))
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    return env


def _engine_cmd(engine: str, model: Path, workload: Path, out: Path, args: argparse.Namespace) -> list[str]:
    common = ["--model", str(model), "--workload", str(workload), "--out", str(out)]
    sched = ["--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if engine == "vllm":
        return [str(args.vllm_venv / "bin" / "python"), str(REPO_ROOT / "bench" / "vllm_worker.py"), *common, *sched]
    return [
        sys.executable, "-m", "bench.runners", engine, *common, *sched,
        "--threads", str(args.threads), "--kv-cache-gib", str(args.kv_cache_gib),
        "--hf-batch-size", str(args.hf_batch_size), "--device", args.device,
    ]  # fmt: skip


def run_engine(engine: str, model: Path, workload: Path, run_dir: Path, args: argparse.Namespace) -> dict[str, Any]:
    out = run_dir / f"{engine}.json"
    if engine == "vllm":
        if not (args.vllm_venv / "bin" / "python").exists():
            return {"engine": engine, "ok": False, "error": f"no vLLM venv at {args.vllm_venv} (skipped)"}
        env = vllm_env(args.threads, args.vllm_bind, args.kv_cache_gib)
    else:
        env = dict(os.environ, OMP_NUM_THREADS=str(args.threads))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = _engine_cmd(engine, model, workload, out, args)
    print(f"\n=== {engine}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, cwd=REPO_ROOT, timeout=args.timeout)
        rc: int | str = proc.returncode
    except subprocess.TimeoutExpired:
        rc = "timeout"
    res: dict[str, Any] = json.loads(out.read_text()) if out.exists() else {"engine": engine, "ok": False}
    res.setdefault("error", None if res.get("ok") else f"subprocess exit {rc}")
    res["process_s"] = time.perf_counter() - t0
    if engine == "vllm":
        res["env"] = {k: v for k, v in env.items() if k.startswith(("VLLM_CPU", "OMP"))}
    return res


def greedy_check(results: dict[str, dict[str, Any]]) -> list[str]:
    """Compare each engine's first outputs to HF's unpadded batch-of-1 greedy reference."""
    ref = results.get("hf-static", {}).get("reference_token_ids")
    if not ref:
        return ["greedy check: skipped (needs hf-static and a greedy workload)"]
    lines = []
    for name in ("mmserve", "vllm", "hf-static", "hf-cb"):
        got = results.get(name, {}).get("output_token_ids")
        if not got:
            continue
        same, first_diff = 0, []
        for r, g in zip(ref, got, strict=False):
            g = g[: len(r)]
            if g == r:
                same += 1
            else:
                first_diff.append(
                    next((i for i, (a, b) in enumerate(zip(r, g, strict=False)) if a != b), min(len(r), len(g)))
                )
        word = "IDENTICAL" if same == len(ref) else "DIFFERENT"
        extra = f" (first divergence at token {first_diff})" if first_diff else ""
        lines.append(
            f"greedy check: {name} vs HF (batch=1, unpadded) on the first {len(ref)} requests, "
            f"first {max(len(r) for r in ref)} tokens: {word}, {same}/{len(ref)} match{extra}"
        )
    return lines


def summarize(results: dict[str, dict[str, Any]], reqs_prompt: int, reqs_output: int) -> list[dict[str, Any]]:
    base = results.get("mmserve", {})
    base_tps = reqs_output / base["wall_s"] if base.get("ok") else None
    rows = []
    for name, r in results.items():
        row: dict[str, Any] = {"engine": name}
        if not r.get("ok"):
            err = str(r.get("error"))
            row["error"] = err if len(err) <= 100 else err[:97] + "..."

            rows.append(row)
            continue
        tps = reqs_output / r["wall_s"]
        row.update(
            output_tokens=reqs_output,
            wall_s=round(r["wall_s"], 2),
            output_tok_s=round(tps, 1),
            total_tok_s=round((reqs_prompt + reqs_output) / r["wall_s"], 1),
            vs_mmserve=round(tps / base_tps, 3) if base_tps else None,
        )
        if "computed_output_tokens" in r:
            row["note"] = f"computed {r['computed_output_tokens']} output tokens (batch max)"
        rows.append(row)
    return rows


def run_offline(args: argparse.Namespace) -> dict[str, Any]:
    engines = [e.strip() for e in args.engines.split(",") if e.strip()]
    bad = [e for e in engines if e not in ENGINES]
    if bad:
        raise SystemExit(f"unknown engine(s) {bad}; choose from {ENGINES}")
    model = resolve_model_dir(args.model).resolve()
    spec = workload_spec(args)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir = args.out_dir / f"offline-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    wl_path = run_dir / "workload.json"
    save_workload(make_workload(spec, usable_token_ids(model)), wl_path)
    reqs = load_workload(wl_path)
    n_prompt = sum(len(r.prompt_token_ids) for r in reqs)
    n_out = sum(r.max_tokens for r in reqs)
    git_at_start = versions_of()["git"]  # the engine code the subprocesses import
    results = {e: run_engine(e, model, wl_path, run_dir, args) for e in engines}
    rows = summarize(results, n_prompt, n_out)
    checks = greedy_check(results)
    summary = {
        "kind": "offline",
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": getattr(args, "command_line", " ".join(sys.argv)),
        "model": str(model),
        "workload": vars(spec) | {"prompt_tokens": n_prompt, "output_tokens": n_out},
        "threads": args.threads,
        "versions": versions_of(results) | {"git": git_at_start},
        "rows": rows,
        "greedy_check": checks,
        "engines": {k: {kk: vv for kk, vv in v.items() if "token_ids" not in kk} for k, v in results.items()},
    }
    path = save_result(summary, run_dir / "summary.json")
    print(
        f"\nworkload: {spec.num_requests} requests, prompt {spec.min_prompt_len}-{spec.max_prompt_len}, output "
        f"{spec.min_output_len}-{spec.max_output_len} (ignore_eos), seed {spec.seed}: {n_prompt} prompt + {n_out} "
        f"output tokens; {args.threads} threads/engine"
    )
    print_table(
        rows, ["engine", "output_tokens", "wall_s", "output_tok_s", "total_tok_s", "vs_mmserve", "note", "error"]
    )
    for line in checks:
        print(line)
    print(f"results: {path}")
    return summary
