"""``mmserve bench asr``: speech-to-text throughput, mmserve's engine vs the transformers pipeline.

The same ``--clips`` clips (each ``--sentences-per-clip`` sentences of the fixed corpus, alternating
the Piper and eSpeak NG voices, 0.5 s pauses) are transcribed, in one process with the same torch
thread count:

1. mmserve: ``AsrEngine``, every clip submitted at once (encoder batched across clips, decoder
   steps continuously batched on the shared engine);
2. transformers: ``pipeline("automatic-speech-recognition", model=<the same converted directory>)``
   over the list of clips, once per ``--baseline-batch-size`` (1 = the pipeline's default; e.g.
   ``1 8 16`` runs all three);
3. optionally (``--generate-batch-size``), transformers ``model.generate()`` called directly on
   batches of clips' features, the leanest transformers path (no pipeline pre/post-processing).

Reports audio-seconds per second for each, our speedup over each baseline, and each side's WER
against the known text.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import time
from typing import Any

import numpy as np

from gateway.argtypes import at_least, output_file
from modalities.asr.speech_corpus import word_error_rate

RATE = 16_000


def make_clips(n: int, per_clip: int) -> tuple[list[np.ndarray], list[str]]:
    from modalities.asr.speech_corpus import SENTENCES, corpus

    voices = [corpus("piper"), corpus("espeak")]
    pause = np.zeros(RATE // 2, np.float32)
    clips, refs = [], []
    for i in range(n):
        idx = [(i * per_clip + j) % len(SENTENCES) for j in range(per_clip)]
        parts = [p for k in idx for p in (voices[i % 2][k], pause)]
        clips.append(np.concatenate(parts))
        refs.append(" ".join(SENTENCES[k] for k in idx))
    return clips, refs


def run_mmserve(args: argparse.Namespace, clips: list[np.ndarray]) -> tuple[float, list[str], Any]:
    from modalities.asr.engine import AsrConfig, AsrEngine, TranscriptionRequest
    from modalities.asr.model import load_whisper

    engine = AsrEngine(
        load_whisper(args.model, device=args.device),
        AsrConfig(max_num_seqs=max(64, len(clips)), max_encoder_batch=args.encoder_batch),
    )

    def request(clip: np.ndarray) -> TranscriptionRequest:
        return TranscriptionRequest(clip, word_timestamps=args.words)

    async def go() -> tuple[float, list[str]]:
        await engine.run(request(clips[0]))  # warm-up (kernels, threads)
        start = time.perf_counter()
        results = await asyncio.gather(*(engine.run(request(c)) for c in clips))
        elapsed = time.perf_counter() - start
        await engine.shutdown()
        return elapsed, [r.text for r in results]

    elapsed, texts = asyncio.run(go())
    return elapsed, texts, engine


def run_transformers(path: str, clips: list[np.ndarray], batch_size: int, device: str) -> tuple[float, list[str]]:
    import torch
    from transformers import pipeline

    pipe = pipeline("automatic-speech-recognition", model=path, device=device, dtype=torch.float32)
    kw = {"generate_kwargs": {"max_new_tokens": 224}, "batch_size": batch_size}
    pipe({"raw": clips[0], "sampling_rate": RATE}, **kw)  # warm-up
    start = time.perf_counter()
    out = pipe([{"raw": c, "sampling_rate": RATE} for c in clips], **kw)
    return time.perf_counter() - start, [o["text"] for o in out]


def run_generate(whisper: Any, clips: list[np.ndarray], batch_size: int) -> tuple[float, list[str]]:
    """The leanest transformers baseline: feature extraction and ``model.generate()`` on batches
    of ``batch_size`` clips, no pipeline around them."""
    import torch

    def go(batch: list[np.ndarray]) -> list[str]:
        feats = whisper.feature_extractor(batch, sampling_rate=RATE, return_tensors="pt").input_features
        with torch.inference_mode():
            out = whisper.model.generate(feats.to(whisper.model.device), max_new_tokens=224)
        return list(whisper.tokenizer.batch_decode(out, skip_special_tokens=True))

    go(clips[:batch_size])  # warm-up
    start = time.perf_counter()
    texts = [t for i in range(0, len(clips), batch_size) for t in go(clips[i : i + batch_size])]
    return time.perf_counter() - start, texts


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench asr", description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny.en", help="ASR model spec (as --asr)")
    ap.add_argument("--clips", type=at_least(int, 1), default=32, help="concurrent clips")
    ap.add_argument("--sentences-per-clip", type=int, default=3)
    ap.add_argument("--encoder-batch", type=int, default=8, help="max windows per encoder forward")
    ap.add_argument(
        "--baseline-batch-size", type=int, nargs="+", default=[1], help="transformers pipeline batch_size(s)"
    )
    ap.add_argument(
        "--generate-batch-size",
        type=int,
        nargs="*",
        default=[],
        help="also time transformers generate() directly (no pipeline) at these batch sizes",
    )
    ap.add_argument("--skip-baseline", action="store_true")
    ap.add_argument("--words", action="store_true", help="mmserve also aligns word timestamps (their cost)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")
    ap.add_argument("--device", default="cpu", help="where every side runs: cpu or cuda (fp32, TF32 off)")
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")
    args = ap.parse_args(argv)

    import torch

    from modalities.asr.model import resolve_asr_path

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.backends.cuda.matmul.allow_tf32 = False  # fp32 on every side, as on the CPU
    path = str(resolve_asr_path(args.model))
    clips, refs = make_clips(args.clips, args.sentences_per_clip)
    audio_s = sum(len(c) for c in clips) / RATE
    rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"mmserve bench asr @ {rev}: {args.clips} clips, {audio_s:.1f} s of audio, model {args.model}, "
          f"{torch.get_num_threads()} threads, device {args.device}")  # fmt: skip
    ours_s, ours_text, engine = run_mmserve(args, clips)
    result: dict[str, Any] = {
        "git_rev": rev,
        "clips": args.clips,
        "word_timestamps": args.words,
        "audio_s": audio_s,
        "threads": torch.get_num_threads(),
        "device": args.device,
        "mmserve": {
            "s": ours_s,
            "audio_s_per_s": audio_s / ours_s,
            "wer": word_error_rate(refs, ours_text),
            "fallback_decodes": engine.num_fallback_decodes,
        },
    }
    print(
        f"  mmserve engine        {ours_s:7.2f} s  {audio_s / ours_s:7.1f} audio-s/s  WER {result['mmserve']['wer']:.3f}  "
        f"(temperature fallbacks: {engine.num_fallback_decodes}{', with word timestamps' if args.words else ''})",
        flush=True,
    )
    if not args.skip_baseline:
        result["transformers"] = {}
        for bs in args.baseline_batch_size:
            base_s, base_text = run_transformers(path, clips, bs, args.device)
            same = sum(a.strip() == b.strip() for a, b in zip(ours_text, base_text, strict=True))
            r = {"s": base_s, "audio_s_per_s": audio_s / base_s, "wer": word_error_rate(refs, base_text)}
            result["transformers"][f"batch_size={bs}"] = {**r, "speedup": base_s / ours_s, "same_text": same}
            print(
                f"  transformers pipeline {base_s:7.2f} s  {audio_s / base_s:7.1f} audio-s/s  WER {r['wer']:.3f} "
                f"(batch_size={bs}): our speedup {base_s / ours_s:.2f}x, identical transcripts {same}/{args.clips}",
                flush=True,
            )
    for bs in args.generate_batch_size:
        from modalities.asr.model import load_whisper

        base_s, base_text = run_generate(load_whisper(args.model, device=args.device), clips, bs)
        same = sum(a.strip() == b.strip() for a, b in zip(ours_text, base_text, strict=True))
        r = {"s": base_s, "audio_s_per_s": audio_s / base_s, "wer": word_error_rate(refs, base_text)}
        result.setdefault("generate", {})[f"batch_size={bs}"] = {**r, "speedup": base_s / ours_s, "same_text": same}
        print(
            f"  transformers generate {base_s:7.2f} s  {audio_s / base_s:7.1f} audio-s/s  WER {r['wer']:.3f} "
            f"(batch_size={bs}): our speedup {base_s / ours_s:.2f}x, identical transcripts {same}/{args.clips}",
            flush=True,
        )
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0
