"""Turn detection and ASR in noise, with and without a session's ``noise_reduction``.

Each of ``--clips`` Piper sentences of the ASR corpus, after ``--lead-s`` of silence and before
1.5 s more, gets noise (``white``: Gaussian; ``hum``: 60 + 120 Hz plus a random walk) at each
``--snr`` (dB below the speech's power). Per condition and noise reduction (off, near_field,
far_field): how many clips the live VAD (``pipelines.vad.VADSegmenter``, fed 40 ms chunks, a
session's defaults with 500 ms of silence) ends as exactly one turn, and the median of where that
turn's audio ends after the speech (the detector's last speech frame plus the 300 ms pad); and
tiny.en's word error rate on the noisy clips as they are and as the suppressor outputs them (in
a session the ASR hears the original audio: this is why).
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path
from typing import Any

import numpy as np

REDUCTIONS = (None, "near_field", "far_field")


def _turns(audio: np.ndarray, reduction: str | None, end_ms: int) -> float | None:
    """The end of the one turn the VAD hears, in ms after ``end_ms``; None unless it hears one."""
    from pipelines.vad import VADConfig, VADSegmenter

    seg = VADSegmenter(VADConfig(silence_duration_ms=500, noise_reduction=reduction))
    events = [e for i in range(0, audio.size, 640) for e in seg.feed(audio[i : i + 640]) if e.kind in ("start", "stop")]
    return events[1].ms - end_ms if [e.kind for e in events] == ["start", "stop"] else None


def _suppressed(audio: np.ndarray, reduction: str) -> np.ndarray:
    from modalities.vad import NOISE_SUPPRESSION, NoiseSuppressor

    return NoiseSuppressor(NOISE_SUPPRESSION[reduction])(audio)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.report import print_table, result_head, save_result
    from modalities.asr.engine import AsrConfig, AsrEngine, TranscriptionRequest
    from modalities.asr.speech_corpus import SENTENCES, corpus, in_noise, word_error_rate

    clips, refs = corpus("piper")[: args.clips], SENTENCES[: args.clips]
    lead, tail = np.zeros(round(args.lead_s * 16_000), np.float32), np.zeros(24_000, np.float32)
    engine = AsrEngine.from_config(AsrConfig())

    async def wer(audios: list[np.ndarray]) -> float:
        hyps = [(await engine.run(TranscriptionRequest(a, vad=False))).text for a in audios]
        return word_error_rate(refs, hyps)

    rows = []
    rng = np.random.default_rng(args.seed)
    try:
        for kind in args.noise.split(","):
            for snr in [float(s) for s in args.snr.split(",")]:
                noisy = [in_noise(np.concatenate([lead, c, tail]), snr, rng, kind) for c in clips]
                ends = [(lead.size + np.flatnonzero(np.abs(c) > 0.01)[-1] + 1) // 16 for c in clips]
                for reduction in REDUCTIONS:
                    stops = [_turns(a, reduction, e) for a, e in zip(noisy, ends, strict=True)]
                    heard = noisy if reduction is None else [_suppressed(a, reduction) for a in noisy]
                    done = [s for s in stops if s is not None]
                    rows.append(
                        {
                            "noise": kind,
                            "snr_db": snr,
                            "noise_reduction": reduction or "off",
                            "one_turn": f"{len(done)}/{len(clips)}",
                            "end_to_stop_ms": f"{np.median(done):.0f}" if done else "-",
                            "asr_wer": f"{asyncio.run(wer(heard)):.3f}",
                        }
                    )
                    print(rows[-1], flush=True)
    finally:
        asyncio.run(engine.shutdown())
    print_table(rows, ["noise", "snr_db", "noise_reduction", "one_turn", "end_to_stop_ms", "asr_wer"])
    result = {**result_head("noise", args), "rows": rows}
    if args.out:
        save_result(result, args.out)
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench noise", description=__doc__.split("\n\n")[0])
    ap.add_argument("--clips", type=int, default=12, help="Piper sentences of the ASR corpus")
    ap.add_argument("--snr", default="20,10,5", help="signal-to-noise ratios in dB, comma-separated")
    ap.add_argument("--noise", default="white,hum", help="noise kinds: white, hum")
    ap.add_argument("--lead-s", type=float, default=2.0, help="silence (then noise) before each clip")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=None, help="write the results as JSON here")
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
