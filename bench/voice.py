"""``mmserve bench voice``: voice-to-voice latency on ``/v1/realtime``.

A real WebSocket client per session streams spoken questions (synthesised once with the Piper
voice, 24 kHz pcm16) at real-time pace in small chunks, like a microphone, and keeps streaming
silence until the reply has played (as a listener would: speaking sooner is a barge-in); the
server's VAD ends each turn. Per turn, from the end of speech (the moment the chunk holding the
last speech sample was sent):

- ``transcript``: the final transcript arrives;
- ``first_token``: the first reply text delta arrives (the LLM's first token);
- ``first_audio``: the first reply audio delta arrives (voice-to-voice);
- ``stall``: how long the reply's playback (from its first audio, at real time) ran dry waiting
  for audio: 0 when every chunk came before the audio ahead of it had played.

P50/P99 over all turns for each concurrency in ``--sessions`` (default 1 and 4 sessions at once).
``--transcription``: transcription sessions (``?intent=transcription``, no replies): the end of
speech to the transcript, and the transcripts' word error rate against the questions.
``--noise-snr``: white noise on everything the client sends (the speech and the silence between
turns), with ``--noise-reduction`` the session's setting against it.
The server is launched (``mmserve serve --only llm,asr,tts``) unless ``--url`` names one.
Times are from the end of the speech in the clip, not from the server's commit, so the silence
wait and any work done speculatively during it are all counted.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.report import Playback
from gateway.argtypes import at_least, counts, output_file
from pipelines.realtime_audio import FORMATS, RATE

BETA = {"OpenAI-Beta": "realtime=v1"}  # the client speaks the beta event protocol

QUESTIONS = [
    "What is the capital of France?",
    "How many legs does a spider have?",
    "What colour is the sky on a clear day?",
    "Who wrote Romeo and Juliet?",
    "What is two plus three?",
    "Name a fruit that is yellow.",
    "What is the boiling point of water?",
    "Which planet is closest to the sun?",
]
LABELS = {
    "transcript": "end of speech to transcript",
    "first_token": "end of speech to first token",
    "first_audio": "end of speech to first audio",
    "stall": "playback stall",
}


def add_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--url", default=None, help="an existing server (http://host:port); default: launch one")
    ap.add_argument("--llm", default=None, help="--llm for the launched server (default: SmolLM2)")
    ap.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the launched server")
    ap.add_argument(
        "--turns", type=at_least(int, 1), default=20, help="turns per concurrency level (split across sessions)"
    )
    ap.add_argument("--sessions", type=counts, default="1,4", help="comma list of concurrent session counts")
    ap.add_argument("--chunk-ms", type=int, default=40, help="audio chunk size sent by the client")
    ap.add_argument("--pace", type=float, default=1.0, help="1.0 = real time")
    ap.add_argument("--silence-ms", type=int, default=400, help="server VAD silence_duration_ms")
    ap.add_argument(
        "--semantic",
        action="store_true",
        help="turn_detection semantic_vad (eagerness auto) instead of server_vad with --silence-ms",
    )
    ap.add_argument(
        "--speculative-ms",
        type=int,
        default=None,
        help="turn_detection.speculative_silence_ms: the pause that starts a turn speculatively (default: the server's)",
    )
    ap.add_argument(
        "--audio-format",
        default="pcm16",
        choices=list(FORMATS),
        help="the session's input and output audio (G.711: 8 kHz, as a phone gateway sends it)",
    )
    ap.add_argument("--max-tokens", type=int, default=48, help="max_response_output_tokens")
    ap.add_argument(
        "--transcription", action="store_true", help="transcription sessions (?intent=transcription): no replies"
    )
    ap.add_argument(
        "--uploads",
        type=int,
        default=0,
        help="meanwhile, this many clients upload a ~60 s recording to /v1/audio/transcriptions in a loop",
    )
    ap.add_argument(
        "--noise-snr",
        type=float,
        default=None,
        help="white noise this many dB below each question's speech, on all the audio sent (between turns too)",
    )
    ap.add_argument(
        "--noise-reduction",
        choices=["near_field", "far_field"],
        default=None,
        help="the session's input_audio_noise_reduction (default: none)",
    )
    ap.add_argument("--timeout", type=float, default=120.0, help="per-turn timeout (s)")
    ap.add_argument("--out", type=output_file, default=None, help="write the results as JSON here")


def synthesise(texts: list[str]) -> list[tuple[bytes, float]]:
    """``(pcm16 at 24 kHz, end of speech in seconds)`` per text, with 0.3 s of lead-in silence."""
    from modalities.asr.speech_corpus import synth_piper
    from modalities.audio import to_pcm16

    out = []
    for audio in synth_piper(texts, RATE):
        voiced = np.flatnonzero(np.abs(audio) > 0.02)
        lead = np.zeros(RATE * 3 // 10, np.float32)
        end_s = (len(lead) + (voiced[-1] + 1 if voiced.size else len(audio))) / RATE
        out.append((to_pcm16(np.concatenate([lead, audio])), end_s))
    return out


async def _mic(
    ws: Any,
    pcm: bytes,
    end_s: float,
    marks: dict[str, float],
    done: asyncio.Event,
    args: argparse.Namespace,
    noise: tuple[float, np.random.Generator] | None = None,
) -> None:
    """Send ``pcm`` (in ``args.audio_format``) then silence in ``chunk_ms`` pieces at ``pace`` x
    real time until ``done``, all with white ``noise`` (its RMS and generator) if given;
    ``marks["end"]`` is when the chunk holding the end of speech went out."""
    fmt = FORMATS[args.audio_format]
    step = fmt.rate * args.chunk_ms // 1000 * fmt.width
    silence = fmt.encode(np.zeros(step // fmt.width, np.float32))
    noise_rms, rng = noise or (0.0, np.random.default_rng())
    t0 = time.monotonic()
    i = 0
    while not done.is_set():
        chunk = pcm[i * step : (i + 1) * step] if i * step < len(pcm) else silence
        if noise_rms:
            samples = fmt.decode(chunk)
            chunk = fmt.encode(samples + rng.standard_normal(samples.size).astype(np.float32) * noise_rms)
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(chunk).decode()}))
        if "end" not in marks and (i + 1) * step >= end_s * fmt.rate * fmt.width:
            marks["end"] = time.monotonic()
        i += 1
        await asyncio.sleep(max(0.0, t0 + i * args.chunk_ms / 1000 * args.pace - time.monotonic()))


async def _session(url: str, clips: list[tuple[bytes, float]], turns: int, args: argparse.Namespace) -> list[dict]:
    import websockets

    results: list[dict[str, Any]] = []
    if args.transcription:
        url += "?intent=transcription"
    async with websockets.connect(url, max_size=None, additional_headers=BETA) as ws:
        td: dict[str, Any] = {"type": "server_vad", "silence_duration_ms": args.silence_ms}
        if args.semantic:
            td = {"type": "semantic_vad"}
        elif args.speculative_ms is not None:
            td["speculative_silence_ms"] = args.speculative_ms
        session = {"temperature": 0, "max_response_output_tokens": args.max_tokens, "turn_detection": td}
        fmt = FORMATS[args.audio_format]
        session |= {"input_audio_format": fmt.name, "output_audio_format": fmt.name}
        if args.transcription:
            session = {"input_audio_format": fmt.name, "turn_detection": td}
        if args.noise_reduction:
            session["input_audio_noise_reduction"] = {"type": args.noise_reduction}
        kind = "transcription_session.update" if args.transcription else "session.update"
        await ws.send(json.dumps({"type": kind, "session": session}))
        # Steady noise, as a room's: one level for every question (a step up would sound like speech)
        noise = None
        if args.noise_snr is not None:
            from modalities.asr.speech_corpus import speech_rms

            rms = speech_rms(np.concatenate([fmt.decode(pcm) for pcm, _ in clips]))
            noise = (rms * 10 ** (-args.noise_snr / 20), np.random.default_rng(0))
        for turn in range(turns):
            pcm, end_s = clips[turn % len(clips)]
            marks: dict[str, float] = {}
            reply: list[str] = []
            heard = ""
            player = Playback(args.pace)
            done = asyncio.Event()

            sender = asyncio.create_task(_mic(ws, pcm, end_s, marks, done, args, noise))
            timed_out = False
            try:
                deadline = time.monotonic() + args.timeout
                while True:
                    ev = json.loads(await asyncio.wait_for(ws.recv(), max(0.1, deadline - time.monotonic())))
                    now, kind = time.monotonic(), ev["type"]
                    if kind == "conversation.item.input_audio_transcription.completed":
                        marks.setdefault("transcript", now)
                        heard = ev["transcript"]
                        if args.transcription:
                            break
                    elif kind in ("response.audio_transcript.delta", "response.text.delta"):
                        marks.setdefault("first_token", now)
                        reply.append(ev.get("delta", ""))
                    elif kind == "response.audio.delta":
                        marks.setdefault("first_audio", now)
                        player.add(now, len(base64.b64decode(ev["delta"])) / fmt.width / fmt.rate)
                    elif kind == "error":
                        print(f"server error: {ev['error']}", file=sys.stderr)
                    elif kind == "response.done":
                        marks["done"] = now
                        break
                # A listener speaks again once the reply has played (earlier would be a barge-in,
                # which truncates the reply to what was heard).
                await asyncio.sleep(0.0 if math.isnan(player.end) else max(0.0, player.end - time.monotonic()))
            except TimeoutError:  # (e.g. a turn in noise the VAD never hears end: the session ends here)
                timed_out = True
            finally:
                done.set()
                await sender
            end = marks.get("end", math.nan)
            times = {k: marks[k] - end for k in ("transcript", "first_token", "first_audio", "done") if k in marks}
            results.append(
                {**times, "stall": player.stall, "reply": "".join(reply), "heard": heard, "said": turn % len(clips)}
            )
            if timed_out:
                results[-1]["timed_out"] = True
                break
    return results


async def _level(url: str, clips: list[tuple[bytes, float]], sessions: int, args: argparse.Namespace) -> list[dict]:
    per = math.ceil(args.turns / sessions)
    outs = await asyncio.gather(*(_session(url, clips[i:] + clips[:i], per, args) for i in range(sessions)))
    for i, out in enumerate(outs):  # (session i's clips start at question i)
        for t in out:
            t["said"] = QUESTIONS[(i + t["said"]) % len(QUESTIONS)]
    return [t for o in outs for t in o]


def _recording(clips: list[tuple[bytes, float]]) -> tuple[bytes, float]:
    """A WAV of the questions over and over, ~60 s: two or three Whisper windows."""
    import io
    import wave

    pcm, seconds = b"", 0.0
    while seconds < 60:
        for clip, _ in clips:
            pcm += clip
            seconds += len(clip) / 2 / RATE
    buf = io.BytesIO()
    with wave.open(buf, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(RATE)
        w.writeframes(pcm)
    return buf.getvalue(), seconds


async def _with_uploads(
    base: str, voice: Any, recording: tuple[bytes, float], clients: int
) -> tuple[list[dict], dict[str, float]]:
    """Run ``voice`` while ``clients`` upload ``recording`` for transcription back to back: the
    voice turns' results, and the uploads' count and audio-seconds per second."""
    import httpx

    wav, seconds = recording
    done = [0]

    async def upload(client: httpx.AsyncClient) -> None:
        while True:
            r = await client.post("/v1/audio/transcriptions", files={"file": ("q.wav", wav)})
            r.raise_for_status()
            done[0] += 1

    t0 = time.monotonic()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        tasks = [asyncio.create_task(upload(client)) for _ in range(clients)]
        try:
            turns = await voice
        finally:
            for t in tasks:
                t.cancel()
            errors = [e for e in await asyncio.gather(*tasks, return_exceptions=True) if isinstance(e, Exception)]
    if errors:  # a failed upload ended its client: the figures would understate the load
        raise RuntimeError(f"{len(errors)} upload client(s) failed: {errors[0]!r}")
    wall = time.monotonic() - t0
    return turns, {"uploads": done[0], "audio_s_per_s": done[0] * seconds / wall}


def _launch(args: argparse.Namespace) -> Any:
    from bench.servers import free_port, launch

    port = free_port()
    only = "asr" if args.transcription else "llm,asr,tts"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--only", only, "--port", str(port)]
    cmd += ["--host", "127.0.0.1", "--log-level", "warning"]
    if args.llm:
        cmd += ["--llm", args.llm]
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return launch("mmserve-voice", cmd, env, Path("bench_results/logs"), ready_timeout=300)


def run(args: argparse.Namespace) -> dict[str, Any]:
    from bench.report import percentiles, print_table, result_head, save_result
    from modalities.asr.speech_corpus import word_error_rate
    from modalities.audio import from_pcm16, resample

    clips = synthesise(QUESTIONS)
    recording = _recording(clips) if args.uploads else None  # (pcm16 uploads)
    fmt = FORMATS[args.audio_format]
    if fmt.name != "pcm16":  # (pcm16 goes as synthesised)
        clips = [(fmt.encode(resample(from_pcm16(pcm), RATE, fmt.rate)), end_s) for pcm, end_s in clips]
    server = None if args.url else _launch(args)
    base = args.url or server.base_url
    url = base.replace("http://", "ws://").replace("https://", "wss://").rstrip("/") + "/v1/realtime"
    levels: dict[str, Any] = {}
    rows = []
    try:
        for n in [int(x) for x in str(args.sessions).split(",") if x]:
            uploads: dict[str, float] = {}
            if recording is not None:
                voice = _level(url, clips, n, args)
                turns, uploads = asyncio.run(_with_uploads(base, voice, recording, args.uploads))
                print(f"{n} session(s): {uploads['uploads']} uploads done, {uploads['audio_s_per_s']:.1f} audio-s/s")
            else:
                turns = asyncio.run(_level(url, clips, n, args))
            labels = ["transcript"] if args.transcription else LABELS
            stats = {k: percentiles([t[k] for t in turns if k in t], (50, 99)) for k in labels}
            wer = word_error_rate([t["said"] for t in turns], [t["heard"] for t in turns])
            print(f"{n} session(s): word error rate of the transcripts {wer:.1%}")
            if late := sum(1 for t in turns if t.get("timed_out")):
                print(
                    f"{n} session(s): {late} turn(s) timed out after --timeout {args.timeout:g} s (their sessions ended)"
                )
            levels[str(n)] = {"turns": turns, "stats": stats, "uploads": uploads, "wer": wer}
            for k, s in stats.items():
                rows.append(
                    {
                        "sessions": n,
                        "turns": len(turns),
                        "per turn": LABELS[k],
                        **{p: _ms(v) for p, v in s.items()},
                    }
                )
    finally:
        if server is not None:
            server.stop()
    print_table(rows, ["sessions", "turns", "per turn", "p50", "p99", "mean"])
    result = {**result_head("voice", args), "levels": levels}
    if args.out:
        save_result(result, args.out)
    return result


def _ms(v: float | None) -> str | None:
    return None if v is None or math.isnan(v) else f"{v * 1000:.0f} ms"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="mmserve bench voice", description=__doc__.split("\n\n")[0])
    add_args(ap)
    run(ap.parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
