"""Seeded synthetic workloads shared by the offline and online benchmarks.

Prompts are random token ids drawn from the vocabulary with every special token removed, so no
engine sees an accidental EOS/BOS/chat marker in the prompt; outputs always run to ``max_tokens``
(``ignore_eos``), so every engine does exactly the same amount of work.
"""

from __future__ import annotations

import argparse
import json
import random
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class BenchRequest:
    prompt_token_ids: list[int]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0


@dataclass
class WorkloadSpec:
    num_requests: int = 48
    min_prompt_len: int = 64
    max_prompt_len: int = 512
    min_output_len: int = 32
    max_output_len: int = 256
    seed: int = 0
    temperature: float = 0.0  # every request's; 0 is greedy (sampled outputs keep their lengths: EOS is ignored)
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (1 <= self.min_prompt_len <= self.max_prompt_len):
            raise ValueError("need 1 <= min_prompt_len <= max_prompt_len")
        if not (1 <= self.min_output_len <= self.max_output_len):
            raise ValueError("need 1 <= min_output_len <= max_output_len")
        if self.num_requests < 1:
            raise ValueError("num_requests must be positive")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise ValueError("need temperature >= 0 and 0 < top_p <= 1")


def workload_spec(args: argparse.Namespace) -> WorkloadSpec:
    """The ``WorkloadSpec`` that ``bench.offline.add_workload_args``' flags describe."""
    return WorkloadSpec(
        args.num_requests, args.min_prompt_len, args.max_prompt_len, args.min_output_len, args.max_output_len,
        args.seed, args.temperature, args.top_p,
    )  # fmt: skip


def usable_token_ids(model_dir: str | Path) -> list[int]:
    """All vocabulary ids except special/added tokens, read from the HF tokenizer in ``model_dir``."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_dir))
    special: set[int] = set(tok.all_special_ids)
    special.update(getattr(tok, "added_tokens_decoder", {}).keys())
    vocab_size = len(tok)
    return [i for i in range(vocab_size) if i not in special]


def make_workload(spec: WorkloadSpec, vocab: list[int]) -> list[BenchRequest]:
    rng = random.Random(spec.seed)
    reqs = []
    for _ in range(spec.num_requests):
        plen = rng.randint(spec.min_prompt_len, spec.max_prompt_len)
        olen = rng.randint(spec.min_output_len, spec.max_output_len)
        reqs.append(BenchRequest([rng.choice(vocab) for _ in range(plen)], olen, spec.temperature, spec.top_p))
    return reqs


def save_workload(reqs: list[BenchRequest], path: Path) -> None:
    path.write_text(json.dumps([asdict(r) for r in reqs]))


def load_workload(path: Path) -> list[BenchRequest]:
    return [BenchRequest(**r) for r in json.loads(Path(path).read_text())]


def resolve_model_dir(model: str) -> Path:
    """A local HF directory as-is; otherwise ask ``engine.model_loader`` to resolve/convert the name."""
    p = Path(model).expanduser()
    if p.is_dir():
        return p
    from engine import model_loader

    resolve = getattr(model_loader, "resolve_model_path", None)
    if resolve is None:
        raise FileNotFoundError(f"{model!r} is not a directory and engine.model_loader has no resolve_model_path")
    return Path(resolve(model))
