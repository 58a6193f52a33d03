"""Shared output helpers: plain-text tables, JSON result files, version stamps."""

from __future__ import annotations

import json
import math
import os
import platform
import sys
from pathlib import Path
from typing import Any


class Playback:
    """A listener that plays streamed audio at ``pace`` x real time from its first chunk:
    ``stall`` is how long the player ran dry waiting for audio, ``end`` when what it has ends."""

    def __init__(self, pace: float = 1.0) -> None:
        self.pace = pace
        self.end = math.nan
        self.stall = 0.0

    def add(self, now: float, seconds: float) -> None:
        """``seconds`` of audio arrived at ``now``."""
        if math.isnan(self.end):  # the first chunk starts playing
            self.end = now
        elif now > self.end:  # the player ran dry
            self.stall += now - self.end
            self.end = now
        self.end += seconds * self.pace


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    cols = [c for c in columns if any(r.get(c) is not None for r in rows)]
    cells = [[("" if r.get(c) is None else str(r[c])) for c in cols] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(cols)]
    line = " | ".join(c.ljust(w) for c, w in zip(cols, widths, strict=False))
    print(line)
    print("-+-".join("-" * w for w in widths))
    for row in cells:
        print(" | ".join(v.ljust(w) for v, w in zip(row, widths, strict=False)))


def result_head(bench: str, args: Any) -> dict[str, Any]:
    """The fields every ``mmserve bench NAME --out`` result starts with: its name, the command
    line, its arguments, the versions and the CPU count."""
    argv = sys.argv[3:] if sys.argv[1:3] == ["bench", bench] else sys.argv[1:]
    return {
        "bench": bench,
        "command": f"mmserve bench {bench} " + " ".join(argv),
        "args": {k: str(v) for k, v in vars(args).items()},
        "versions": versions_of(),
        "cpus": os.cpu_count(),
    }


def save_result(obj: dict[str, Any], path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=str))
    return path


def versions_of(results: dict[str, dict[str, Any]] | None = None) -> dict[str, str]:
    out = {"python": platform.python_version(), "machine": platform.machine(), "git": git_rev()}
    try:
        import torch
        import transformers

        out.update(torch=torch.__version__, transformers=transformers.__version__)
    except ImportError:  # pragma: no cover - the project always has both
        pass
    for r in (results or {}).values():
        if r.get("engine") == "vllm" and r.get("versions"):
            out["vllm"] = r["versions"].get("vllm", "?")
            out["vllm_torch"] = r["versions"].get("torch", "?")
    return out


def git_rev() -> str:
    """Short HEAD of the checkout, with ``+dirty`` when tracked files under engine/ or bench/ changed."""
    import subprocess

    root = Path(__file__).resolve().parent.parent
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True).stdout
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "engine", "bench"],
            cwd=root,
            capture_output=True,
            text=True,
        ).stdout
    except OSError:
        return "unknown"
    return rev.strip() + ("+dirty" if dirty.strip() else "")


def percentiles(values: list[float], ps: tuple[int, ...] = (50, 90, 99)) -> dict[str, float | None]:
    """Linear-interpolated percentiles (numpy's default method) without needing numpy."""
    if not values:
        return {f"p{p}": None for p in ps} | {"mean": None}
    xs = sorted(values)
    out: dict[str, float | None] = {}
    for p in ps:
        k = (len(xs) - 1) * p / 100
        lo = int(k)
        hi = min(lo + 1, len(xs) - 1)
        out[f"p{p}"] = xs[lo] + (xs[hi] - xs[lo]) * (k - lo)
    out["mean"] = sum(xs) / len(xs)
    return out
