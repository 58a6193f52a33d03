"""vLLM offline run, executed by the *peer* venv's python (stdlib + vllm only, no project imports).

    VENV/bin/python bench/vllm_worker.py --model DIR --workload W.json --out R.json

Thread placement comes from the environment the caller sets (``VLLM_CPU_OMP_THREADS_BIND`` etc.):
see ``bench.offline.vllm_env``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--workload", type=Path, required=True)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--max-model-len", type=int, default=2048)
    args = ap.parse_args()
    reqs = json.loads(args.workload.read_text())
    result: dict[str, Any] = {
        "engine": "vllm",
        "env": {k: v for k, v in os.environ.items() if "OMP" in k or "VLLM" in k},
    }
    try:
        import torch
        import vllm
        from vllm import LLM, SamplingParams
        from vllm.inputs import TokensPrompt

        result["versions"] = {"vllm": vllm.__version__, "torch": torch.__version__}
        t0 = time.perf_counter()
        llm = LLM(
            model=args.model,
            dtype="float32",
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            gpu_memory_utilization=0.3,
            seed=0,
        )
        result["load_s"] = time.perf_counter() - t0

        def params(k: int, temperature: float = 0.0, top_p: float = 1.0) -> SamplingParams:
            return SamplingParams(temperature=temperature, top_p=top_p, max_tokens=k, ignore_eos=True)

        warm = [TokensPrompt(prompt_token_ids=list(range(100, 100 + n))) for n in (32, 48)]
        llm.generate(warm, [params(8)] * len(warm), use_tqdm=False)
        prompts = [TokensPrompt(prompt_token_ids=r["prompt_token_ids"]) for r in reqs]
        sps = [params(r["max_tokens"], r.get("temperature", 0.0), r.get("top_p", 1.0)) for r in reqs]
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sps, use_tqdm=True)
        result["wall_s"] = time.perf_counter() - t0
        result["output_token_ids"] = [list(o.outputs[0].token_ids) for o in outs]
        result["config"] = {
            "max_num_seqs": args.max_num_seqs,
            "max_num_batched_tokens": args.max_num_batched_tokens,
            "max_model_len": args.max_model_len,
            "kv_cache_space_gib": os.environ.get("VLLM_CPU_KVCACHE_SPACE"),
        }
        result["ok"] = True
    except Exception as e:
        import traceback

        traceback.print_exc()
        result.update(ok=False, error=f"{type(e).__name__}: {e}")
    args.out.write_text(json.dumps(result))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
