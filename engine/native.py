"""Native CPU kernels: plain C compiled once with the system C compiler and called via ctypes.

No torch headers and no build step at install time: the shared library is built on first use
(well under a second) into the mmserve cache, keyed by the source hash. Where there is no C
compiler or the CPU lacks AVX2/FMA, ``paged_decode_kernel()`` returns None and callers fall
back to the portable PyTorch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)
_SRC = Path(__file__).parent / "csrc" / "paged_decode.c"
_FLAGS = ["-O3", "-mavx2", "-mfma", "-ffast-math", "-fopenmp", "-shared", "-fPIC"]  # fast-math: vector expf


def _cpu_has_avx2_fma() -> bool:
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return " avx2" in flags and " fma" in flags


def _build(src: Path) -> Path:
    from engine.model_loader import cache_root

    root = cache_root()
    digest = hashlib.sha256(src.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:12]
    lib = root / "native" / f"{src.stem}-{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # atomic: build, then rename
            out = Path(tmp) / lib.name
            subprocess.run(["cc", *_FLAGS, "-o", str(out), str(src), "-lm"], check=True, capture_output=True)
            out.replace(lib)
    return lib


@functools.cache
def paged_decode_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C paged-decode function, or None when it cannot run here."""
    if os.environ.get("MMSERVE_NO_NATIVE") or not _cpu_has_avx2_fma() or shutil.which("cc") is None:
        return None
    try:
        fn = ctypes.CDLL(str(_build(_SRC))).paged_decode_f32
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("native paged attention unavailable (%s); using the PyTorch path", exc)
        return None
    fn.restype = None
    fn.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 6 + [ctypes.c_float, ctypes.c_int64, ctypes.c_int]
    return fn


def paged_decode(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    block_size: int,
    scale: float,
    window: int | None,
) -> torch.Tensor:
    """Decode attention read in place from the paged cache. q: [B, H, D] fp32 contiguous;
    caches: [slots, Hkv, D]; block_tables: [B, max_blocks] int64; seq_lens: [B] int64."""
    fn = paged_decode_kernel()
    assert fn is not None
    b, h, d = q.shape
    out = torch.empty_like(q)
    fn(
        out.data_ptr(),
        q.data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        block_tables.data_ptr(),
        seq_lens.data_ptr(),
        b,
        block_tables.shape[1],
        h,
        k_cache.shape[1],
        d,
        block_size,
        scale,
        window or 0,
        torch.get_num_threads(),
    )
    return out
