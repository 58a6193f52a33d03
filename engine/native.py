"""Native CPU kernels: plain C compiled once with the system C compiler and called via ctypes.

No torch headers and no build step at install time: the shared library is built on first use
(well under a second) into the mmserve cache, keyed by the source hash. Where there is no C
compiler or the CPU lacks the kernel's ISA (AVX2/FMA for decode, the small-batch linears also built
for AVX-512 where the CPU has it; AVX-512F for prefill), the ``*_kernel()`` getters return None and
callers fall back to the portable PyTorch path.
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
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from engine.gguf_blocks import BlockWeight

logger = logging.getLogger(__name__)
_CSRC = Path(__file__).parent / "csrc"
_FLAGS = ["-O3", "-fopenmp", "-shared", "-fPIC"]
_DECODE_FLAGS = ["-mavx2", "-mfma", "-ffast-math"]  # fast-math: vector expf
_PREFILL_FLAGS = ["-mavx512f", "-mavx512dq", "-mfma"]  # its own exp: no fast-math


def _cpu_has(*features: str) -> bool:
    try:
        flags = set(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return False
    return all(f in flags for f in features)


def _build(src: Path, flags: list[str]) -> Path:
    from engine.model_loader import cache_root

    root = cache_root()
    flags = [*_FLAGS, *flags]
    headers = b"".join(h.read_bytes() for h in sorted(src.parent.glob("*.h")))  # what it may include
    digest = hashlib.sha256(src.read_bytes() + headers + " ".join(flags).encode()).hexdigest()[:12]
    lib = root / "native" / f"{src.stem}-{digest}.so"
    if not lib.exists():
        lib.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=lib.parent) as tmp:  # atomic: build, then rename
            out = Path(tmp) / lib.name
            subprocess.run(["cc", *flags, "-o", str(out), str(src), "-lm"], check=True, capture_output=True)
            out.replace(lib)
    return lib


def _load(name: str, flags: list[str], features: tuple[str, ...]) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """Function ``<name>_f32`` of ``csrc/<name>.c``, or None when it cannot run here."""
    if os.environ.get("MMSERVE_NO_NATIVE") or not _cpu_has(*features) or shutil.which("cc") is None:
        return None
    try:
        fn = getattr(ctypes.CDLL(str(_build(_CSRC / f"{name}.c", flags))), f"{name}_f32")
    except (OSError, subprocess.CalledProcessError) as exc:
        logger.warning("native %s unavailable (%s); using the PyTorch path", name, exc)
        return None
    fn.restype = None
    return fn


@functools.cache
def paged_decode_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C paged-decode function, or None when it cannot run here."""
    fn = _load("paged_decode", _DECODE_FLAGS, ("avx2", "fma"))
    if fn is None:
        return None
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


@functools.cache
def rms_norm_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C RMSNorm function (AVX2 + FMA; no fast-math: the order of operations is fixed), or
    None when it cannot run here."""
    fn = _load("rms_norm", ["-mavx2", "-mfma"], ("avx2", "fma"))
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 2 + [ctypes.c_float]
    return fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' LlamaRMSNorm of ``x`` [..., n] (fp32, contiguous) with ``weight`` [n] (fp32,
    contiguous), one call for all rows."""
    fn = rms_norm_kernel()
    assert fn is not None
    n = x.shape[-1]
    y = torch.empty_like(x)
    fn(y.data_ptr(), x.data_ptr(), weight.data_ptr(), x.numel() // n, n, eps)
    return y


@functools.cache
def prefill_attn_kernel() -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C causal prefill-attention function (AVX-512F), or None when it cannot run here."""
    fn = _load("prefill_attn", _PREFILL_FLAGS, ("avx512f", "avx512dq", "fma"))
    if fn is None:
        return None
    fn.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 9 + [ctypes.c_float, ctypes.c_int]
    return fn


def prefill_attn(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int, scale: float) -> torch.Tensor:
    """Causal attention of one prefill chunk: q [n, H, D] are the last n of ``seq_len`` positions,
    keys/values [seq_len, Hkv, D]; fp32, each row's [heads, D] contiguous, D % 16 == 0, D <= 256."""
    fn = prefill_attn_kernel()
    assert fn is not None
    n, h, d = q.shape
    out = torch.empty_like(q)
    fn(
        out.data_ptr(),
        q.data_ptr(),
        keys.data_ptr(),
        values.data_ptr(),
        n,
        seq_len,
        h,
        keys.shape[1],
        d,
        q.stride(0),
        keys.stride(0),
        values.stride(0),
        out.stride(0),
        scale,
        torch.get_num_threads(),
    )
    return out


# Builds of the small-batch linear kernels, widest first: AVX-512 unpacks and widens the weights
# in half the instructions.
BLOCKQ_ISAS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "avx512": ([*_DECODE_FLAGS, "-mavx512f"], ("avx2", "fma", "avx512f")),
    "avx2": (_DECODE_FLAGS, ("avx2", "fma")),
}
# Rows up to which each build of the block kernel beats oneDNN's fp32 matmul on 2 cores: a short
# prefill reads the blocks (6.4x fewer bytes than fp32 for Q4_1) through the kernel's staged path.
# Measured in SmolLM2 prefills on an AVX-512 VM: AVX-512 ahead up to 128 rows (even with hot
# caches up to ~64), the AVX2 build ahead up to 20 and even at 30 against AVX-512 oneDNN; an
# AVX2-only CPU's oneDNN is slower than that (docs/BENCHMARKS.md).
BLOCKQ_MAX_ROWS = {"avx512": 64, "avx2": 32}
F16_ISAS: dict[str, tuple[list[str], tuple[str, ...]]] = {
    "avx512": ([*_DECODE_FLAGS, "-mf16c", "-mavx512f"], ("avx2", "fma", "f16c", "avx512f")),
    "avx2": ([*_DECODE_FLAGS, "-mf16c"], ("avx2", "fma", "f16c")),
}


def _widest_build(
    name: str, isas: dict[str, tuple[list[str], tuple[str, ...]]], isa: str | None
) -> tuple[str, ctypes._CFuncPtr] | None:  # type: ignore[name-defined]
    """``(key, function <name>_f32)`` of the widest build of ``isas`` this CPU runs (or the one
    ``isa`` names), or None when none can run here."""
    for key in [isa] if isa else isas:
        flags, features = isas[key]
        fn = _load(name, flags, features)
        if fn is not None:
            return key, fn
    return None


def _widest(
    name: str, isas: dict[str, tuple[list[str], tuple[str, ...]]], isa: str | None, argtypes: list[Any]
) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The function of ``_widest_build``, with ``argtypes`` set, or None."""
    found = _widest_build(name, isas, isa)
    if found is None:
        return None
    found[1].argtypes = argtypes
    return found[1]


@functools.cache
def blockq_linear_kernel(isa: str | None = None) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C linear on GGUF Q4_1/Q8_0 blocks, a build of ``BLOCKQ_ISAS`` (``_widest``)."""
    return _widest("blockq_linear", BLOCKQ_ISAS, isa, [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 3 + [ctypes.c_int] * 2)


@functools.cache
def blockq_max_rows(isa: str | None = None) -> int:
    """``BLOCKQ_MAX_ROWS`` of the build ``blockq_linear_kernel(isa)`` runs (0: none runs here)."""
    found = _widest_build("blockq_linear", BLOCKQ_ISAS, isa)
    return 0 if found is None else BLOCKQ_MAX_ROWS[found[0]]


@functools.cache
def f16_linear_kernel(isa: str | None = None) -> ctypes._CFuncPtr | None:  # type: ignore[name-defined]
    """The C linear on fp16-stored weights, a build of ``F16_ISAS`` (``_widest``)."""
    return _widest("f16_linear", F16_ISAS, isa, [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 3 + [ctypes.c_int])


def f16_linear(
    x: torch.Tensor, w16: torch.Tensor, bias: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """``x @ w16.float().T (+ bias)``; x: [..., K] fp32, w16: [N, K] fp16 contiguous, K % 16 == 0."""
    fn = f16_linear_kernel(isa)
    assert fn is not None
    return _small_batch_linear(fn, x, w16.shape, (w16.data_ptr(),), bias)


def blockq_linear(
    x: torch.Tensor, w: BlockWeight, bias: torch.Tensor | None = None, isa: str | None = None
) -> torch.Tensor:
    """``x @ w.T (+ bias)`` read from ``w``'s blocks; x: [M, K] fp32 (any rows, made contiguous);
    ``isa``: a given build of the kernel (default: the widest)."""
    fn = blockq_linear_kernel(isa)
    assert fn is not None
    weights = (w.q.data_ptr(), w.d.data_ptr(), None if w.m is None else w.m.data_ptr())
    return _small_batch_linear(fn, x, w.shape, weights, bias, (w.fmt,))


def _small_batch_linear(
    fn: ctypes._CFuncPtr,  # type: ignore[name-defined]
    x: torch.Tensor,
    shape: tuple[int, int],
    weights: tuple[int | None, ...],
    bias: torch.Tensor | None,
    extra: tuple[int, ...] = (),
) -> torch.Tensor:
    """y [..., N] = ``fn(y, x, *weights, bias, M, N, K, *extra, threads)`` on ``x`` made
    contiguous (the kernels' shared calling convention)."""
    x = x.contiguous()
    bias = None if bias is None else bias.contiguous()  # held: the kernel reads its memory
    n, k = shape
    y = torch.empty(*x.shape[:-1], n, dtype=x.dtype)
    bias_ptr = None if bias is None else bias.data_ptr()
    fn(y.data_ptr(), x.data_ptr(), *weights, bias_ptr, x.numel() // k, n, k, *extra, torch.get_num_threads())
    return y
