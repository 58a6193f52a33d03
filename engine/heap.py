"""The garbage collector in a server: start-up's objects frozen, pauses recorded.

A loaded server tracks ~400k objects (torch modules, tokenizers, transformers' registries), and
CPython's full collection (generation 2) walks every one with the GIL held: 140-250 ms on a
2-core VM, every engine thread and event loop stopped (docs/BENCHMARKS.md). A full collection
comes each time the objects promoted since the last one pass 25% of those already in generation
2, so a busy server pays such a pause every so often. ``freeze_startup_heap`` moves start-up's
objects to the permanent generation, which collections skip (vLLM and SGLang do the same): a full
collection then walks only what serving made. ``record_pauses`` times every collection, for
``/metrics``.
"""

from __future__ import annotations

import gc
import time
from collections import deque

# (generation, seconds) of collections not yet taken by ``take_pauses``; bounded so a process
# whose metrics nobody reads keeps only the latest
_pauses: deque[tuple[int, float]] = deque(maxlen=4096)
_started = [0.0]  # the running collection's start (collections never overlap: one slot)


def freeze_startup_heap() -> int:
    """Collect once, then freeze every object left: call when start-up (loading, warm-up) is
    done. Returns how many objects were frozen. (Frozen cycles are never freed: only objects
    made at start-up, which live as long as the process, should be frozen.)"""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


def _on_gc(phase: str, info: dict[str, int]) -> None:
    if phase == "start":
        _started[0] = time.perf_counter()
    else:
        _pauses.append((info["generation"], time.perf_counter() - _started[0]))


def record_pauses() -> None:
    """Time every collection of this process from now on (once per process; a no-op after)."""
    if _on_gc not in gc.callbacks:
        gc.callbacks.append(_on_gc)


def take_pauses() -> list[tuple[int, float]]:
    """The (generation, seconds) of the collections recorded since the last call, oldest first."""
    out = []
    while _pauses:
        out.append(_pauses.popleft())
    return out
