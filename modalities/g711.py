"""G.711 μ-law and A-law (ITU-T G.711, 8-bit companded telephone audio), vectorised.

The bytes are those of the reference C code (Sun's ``g711.c``, which CPython's ``audioop``
carried): μ-law encodes the top 14 bits of a 16-bit sample, A-law the top 13. Each direction is
one table lookup: 65536 entries for encoding (one per int16), 256 for decoding.
"""

from __future__ import annotations

from functools import cache

import numpy as np

from modalities.audio import from_pcm16, to_pcm16

_ULAW_SEGMENTS = np.array([0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF])
_ALAW_SEGMENTS = np.array([0x1F, 0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF])


def _ulaw_of(linear: np.ndarray) -> np.ndarray:
    x = linear.astype(np.int32) >> 2  # 14 bits, an arithmetic shift as in C
    mask = np.where(x < 0, 0x7F, 0xFF)
    x = np.minimum(np.abs(x), 8159) + (0x84 >> 2)
    seg = np.searchsorted(_ULAW_SEGMENTS, x)  # the first segment whose end is >= x
    code = (np.minimum(seg, 7) << 4) | ((x >> (np.minimum(seg, 7) + 1)) & 0xF)
    return (np.where(seg >= 8, 0x7F, code) ^ mask).astype(np.uint8)


def _alaw_of(linear: np.ndarray) -> np.ndarray:
    x = linear.astype(np.int32) >> 3  # 13 bits
    mask = np.where(x >= 0, 0xD5, 0x55)
    x = np.where(x >= 0, x, -x - 1)
    seg = np.searchsorted(_ALAW_SEGMENTS, x)
    shift = np.where(seg < 2, 1, np.minimum(seg, 7))
    code = (np.minimum(seg, 7) << 4) | ((x >> shift) & 0xF)
    return (np.where(seg >= 8, 0x7F, code) ^ mask).astype(np.uint8)


def _linear_of_ulaw(code: np.ndarray) -> np.ndarray:
    u = ~code.astype(np.int32) & 0xFF
    t = (((u & 0xF) << 3) + 0x84) << ((u & 0x70) >> 4)
    return np.where(u & 0x80, 0x84 - t, t - 0x84).astype(np.int16)


def _linear_of_alaw(code: np.ndarray) -> np.ndarray:
    a = code.astype(np.int32) ^ 0x55
    t = (a & 0xF) << 4
    seg = (a & 0x70) >> 4
    t = np.where(seg == 0, t + 8, (t + 0x108) << np.maximum(seg - 1, 0))
    return np.where(a & 0x80, t, -t).astype(np.int16)


@cache
def _tables(law: str) -> tuple[np.ndarray, np.ndarray]:
    """(encode: int16 + 32768 -> byte, decode: byte -> int16) for ``law`` "ulaw" or "alaw"."""
    every = np.arange(-32768, 32768)
    codes = np.arange(256)
    if law == "ulaw":
        return _ulaw_of(every), _linear_of_ulaw(codes)
    if law == "alaw":
        return _alaw_of(every), _linear_of_alaw(codes)
    raise ValueError(f"unknown G.711 law {law!r}")


def encode(samples: np.ndarray, law: str) -> bytes:
    """Float samples in [-1, 1] (clipped) as G.711 bytes, one per sample."""
    linear = np.frombuffer(to_pcm16(samples), dtype="<i2").astype(np.int32)
    return _tables(law)[0][linear + 32768].tobytes()


def decode(data: bytes, law: str) -> np.ndarray:
    """G.711 bytes as float32 samples in [-1, 1)."""
    linear = _tables(law)[1][np.frombuffer(data, dtype=np.uint8)]
    return from_pcm16(linear.astype("<i2").tobytes())
