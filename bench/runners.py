"""One offline engine run per process: ``python -m bench.runners ENGINE --model DIR --workload W --out R``.

``bench.offline`` starts each engine in its own subprocess so their memory, thread pools and
allocator state never interfere. Every runner loads the model, does a small untimed warm-up,
then times only the generation of the whole workload and writes a JSON result.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from bench.workload import BenchRequest, load_workload

SAMPLE_REQUESTS = 4  # outputs of the first N requests are kept for the cross-engine greedy check
SANITY_TOKENS = 32  # HF reference (batch of 1, no padding) is computed for this many tokens


def _setup_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def _warmup_requests(vocab_hi: int) -> list[BenchRequest]:
    return [BenchRequest(list(range(100, 100 + n)), 8) for n in (32, 48)] if vocab_hi > 200 else []


# -- mmserve ---------------------------------------------------------------------------------
def run_mmserve(model: str, reqs: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.sampling_params import SamplingParams

    t0 = time.perf_counter()
    cfg = EngineConfig(
        model=model,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        kv_cache_memory_bytes=int(args.kv_cache_gib * (1 << 30)),
        num_threads=args.threads,
        device=args.device,
    )
    eng = LLMEngine(cfg)
    load_s = time.perf_counter() - t0

    def params(r: BenchRequest) -> SamplingParams:
        return SamplingParams(temperature=r.temperature, top_p=r.top_p, max_tokens=r.max_tokens, ignore_eos=True)

    warm = _warmup_requests(1000)
    eng.generate([w.prompt_token_ids for w in warm], [params(w) for w in warm])
    t0 = time.perf_counter()
    outs = eng.generate([r.prompt_token_ids for r in reqs], [params(r) for r in reqs], use_tqdm=True)
    wall = time.perf_counter() - t0
    token_ids = [list(o.outputs[0].token_ids) for o in outs]
    stats = eng.stats() if hasattr(eng, "stats") else {}
    return {"load_s": load_s, "wall_s": wall, "output_token_ids": token_ids, "config": vars(cfg), "stats": stats}


# -- transformers: static batching -----------------------------------------------------------
def _load_hf(model: str, device: str, attn: str | None = None) -> Any:
    import torch
    from transformers import AutoModelForCausalLM

    kw: dict[str, Any] = {"dtype": torch.float32}
    if attn:
        kw["attn_implementation"] = attn
    m = AutoModelForCausalLM.from_pretrained(model, **kw).to(device).eval()
    # ignore EOS: with no eos id, generate() always runs to max_new_tokens (no logits are altered)
    m.generation_config.eos_token_id = None
    m.generation_config.do_sample = False
    m.generation_config.temperature = None
    m.generation_config.top_p = None
    m.generation_config.top_k = None
    if m.generation_config.pad_token_id is None:
        m.generation_config.pad_token_id = m.config.pad_token_id if m.config.pad_token_id is not None else 0
    return m


def _hf_sampling(r: BenchRequest) -> dict[str, Any]:
    """``generate()`` keyword arguments for the workload's sampling (none when greedy)."""
    return {"do_sample": True, "temperature": r.temperature, "top_p": r.top_p} if r.temperature > 0 else {}


def _hf_static_batch(m: Any, batch: list[BenchRequest]) -> tuple[list[list[int]], int]:
    import torch

    pad = int(m.generation_config.pad_token_id)
    width = max(len(r.prompt_token_ids) for r in batch)
    ids = torch.full((len(batch), width), pad, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for i, r in enumerate(batch):  # left padding
        n = len(r.prompt_token_ids)
        ids[i, width - n :] = torch.tensor(r.prompt_token_ids)
        mask[i, width - n :] = 1
    new = max(r.max_tokens for r in batch)
    with torch.inference_mode():
        out = m.generate(
            input_ids=ids.to(m.device),
            attention_mask=mask.to(m.device),
            max_new_tokens=new,
            min_new_tokens=new,
            **_hf_sampling(batch[0]),
        )
    gen = out[:, width:].tolist()
    return [g[: r.max_tokens] for g, r in zip(gen, batch, strict=False)], new * len(batch)


def run_hf_static(model: str, reqs: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from tqdm import tqdm

    t0 = time.perf_counter()
    m = _load_hf(model, args.device)
    load_s = time.perf_counter() - t0
    _hf_static_batch(m, _warmup_requests(1000))
    bs = args.hf_batch_size
    token_ids: list[list[int]] = []
    computed = 0
    t0 = time.perf_counter()
    for s in tqdm(range(0, len(reqs), bs), desc="hf-static batches", file=sys.stderr):
        got, n = _hf_static_batch(m, reqs[s : s + bs])
        token_ids.extend(got)
        computed += n
    wall = time.perf_counter() - t0
    # Untimed reference for the greedy sanity check: batch of 1, no padding at all.
    ref = []
    with torch.inference_mode():
        for r in reqs[:SAMPLE_REQUESTS] if reqs[0].temperature == 0 else []:
            k = min(SANITY_TOKENS, r.max_tokens)
            ids = torch.tensor([r.prompt_token_ids], device=m.device)
            out = m.generate(input_ids=ids, max_new_tokens=k, min_new_tokens=k)
            ref.append(out[0, len(r.prompt_token_ids) :].tolist())
    return {
        "load_s": load_s,
        "wall_s": wall,
        "output_token_ids": token_ids,
        "computed_output_tokens": computed,
        "reference_token_ids": ref,
        "config": {"batch_size": bs, "padding": "left", "attn_implementation": m.config._attn_implementation},
    }


# -- transformers: continuous batching -------------------------------------------------------
def run_hf_cb(model: str, reqs: list[BenchRequest], args: argparse.Namespace) -> dict[str, Any]:
    from tqdm import tqdm
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    t0 = time.perf_counter()
    m = _load_hf(model, args.device, attn=args.hf_cb_attn)
    load_s = time.perf_counter() - t0
    gen_cfg = m.generation_config
    gen_cfg.eos_token_id = -1  # continuous batching uses -1 for "no EOS"
    for key, value in _hf_sampling(reqs[0]).items():
        setattr(gen_cfg, key, value)
    cb_cfg = ContinuousBatchingConfig(max_batch_tokens=args.max_num_batched_tokens)
    hints = WorkloadHints(
        max_prompt_length=max(len(r.prompt_token_ids) for r in reqs),
        max_generated_length=max(r.max_tokens for r in reqs),
        num_requests=len(reqs),
    )
    cm = m.continuous_batching_context_manager(
        generation_config=gen_cfg, continuous_batching_config=cb_cfg, block=True, timeout=5, workload_hints=hints
    )
    results: dict[str, Any] = {}
    with cm as manager:

        def run(batch: list[BenchRequest], bar: bool) -> tuple[list[str], float]:
            start = time.perf_counter()
            rids = [
                manager.add_request(r.prompt_token_ids, max_new_tokens=r.max_tokens, eos_token_id=-1) for r in batch
            ]
            pending = set(rids)
            with tqdm(total=len(batch), desc="hf-cb requests", file=sys.stderr, disable=not bar) as pbar:
                while pending:
                    res = manager.get_result(timeout=1)
                    if res is None:
                        if not manager.is_running():
                            raise RuntimeError("transformers continuous batching thread died")
                        continue
                    if res.is_finished() and res.request_id in pending:
                        if res.error is not None:
                            raise RuntimeError(f"transformers continuous batching failed: {res.error}")
                        results[res.request_id] = res
                        pending.discard(res.request_id)
                        pbar.update(1)
            return rids, time.perf_counter() - start

        run(_warmup_requests(1000), bar=False)
        rids, wall = run(reqs, bar=True)
    token_ids = [list(results[r].generated_tokens)[: q.max_tokens] for r, q in zip(rids, reqs, strict=False)]
    return {
        "load_s": load_s,
        "wall_s": wall,
        "output_token_ids": token_ids,
        "config": {"max_batch_tokens": args.max_num_batched_tokens, "attn_implementation": args.hf_cb_attn},
    }


RUNNERS = {"mmserve": run_mmserve, "hf-static": run_hf_static, "hf-cb": run_hf_cb}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("engine", choices=sorted(RUNNERS))
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--kv-cache-gib", type=float, default=2.0)
    ap.add_argument("--hf-batch-size", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--hf-cb-attn", default=None, help="default: let continuous batching pick (paged|sdpa)")
    args = ap.parse_args(argv)
    _setup_threads(args.threads)
    import torch
    import transformers

    reqs = load_workload(args.workload)
    result: dict[str, Any] = {"engine": args.engine, "threads": torch.get_num_threads()}
    result["versions"] = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        result.update(RUNNERS[args.engine](args.model, reqs, args))
        result["ok"] = True
    except Exception as e:  # reported in the table, not fatal for the other engines
        import traceback

        traceback.print_exc()
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    args.out.write_text(json.dumps(result, default=str))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
