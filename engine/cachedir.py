"""Directories built once into a shared cache (converted models, tiny test models), safely
under concurrent processes."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path


def build_once(dst: Path, marker: str, make: Callable[[Path], object]) -> Path:
    """``dst``, built by ``make(tmp)`` on first use.

    ``dst / marker`` existing means complete: it is returned as is. Otherwise ``make`` writes
    into a private temp directory next to ``dst`` that is then renamed into place, so a crash
    never leaves a half-written directory; when another process finishes first, theirs is kept.
    """
    if (dst / marker).is_file():
        return dst
    dst.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dst.name}.", dir=dst.parent))
    try:
        make(tmp)
        tmp.chmod(0o755)  # mkdtemp makes it private; the cache is shared like any model directory
        try:
            tmp.rename(dst)
        except OSError:  # another process won the race: keep theirs
            if not (dst / marker).is_file():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return dst
