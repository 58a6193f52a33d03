"""Encoding generated pixels: PNG images and H.264 MP4 videos (PyAV, which bundles ffmpeg)."""

from __future__ import annotations

import io

import numpy as np


def to_uint8(pixels: np.ndarray) -> np.ndarray:
    """Float pixels in [0, 1] to uint8, rounding as diffusers' ``numpy_to_pil`` does."""
    return (np.clip(pixels, 0.0, 1.0) * 255).round().astype(np.uint8)


def encode_png(image: np.ndarray) -> bytes:
    """``[H, W, 3]`` float in [0, 1] (or uint8) to PNG bytes."""
    from PIL import Image

    arr = image if image.dtype == np.uint8 else to_uint8(image)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def encode_mp4(frames: np.ndarray, fps: int = 16, crf: int = 18) -> bytes:
    """``[F, H, W, 3]`` float in [0, 1] (or uint8) to an H.264 (yuv420p) MP4. Odd sides are padded
    by one edge pixel, since 4:2:0 chroma needs even sizes."""
    import av

    arr = frames if frames.dtype == np.uint8 else to_uint8(frames)
    pad_h, pad_w = arr.shape[1] % 2, arr.shape[2] % 2
    if pad_h or pad_w:
        arr = np.pad(arr, ((0, 0), (0, pad_h), (0, pad_w), (0, 0)), mode="edge")
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("libx264", rate=fps)
        stream.width, stream.height = arr.shape[2], arr.shape[1]
        stream.pix_fmt = "yuv420p"
        stream.options = {"crf": str(crf), "preset": "veryfast"}
        for frame in arr:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")))
        container.mux(stream.encode(None))
    return buf.getvalue()


def decode_mp4(data: bytes) -> np.ndarray:
    """MP4 bytes to ``[F, H, W, 3]`` uint8 RGB frames (tests and clients)."""
    import av

    with av.open(io.BytesIO(data)) as container:
        return np.stack([f.to_ndarray(format="rgb24") for f in container.decode(video=0)])
