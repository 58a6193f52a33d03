"""``mmserve bench {offline,online,profile,embed,all}``: entry point the gateway CLI forwards to (``bench.cli.main``)."""

from __future__ import annotations

import argparse
import importlib
import shlex
import sys

# ``mmserve bench NAME ...``: the module whose ``main(argv)`` parses the rest of the line.
OWN_PARSERS = {
    name: f"bench.{name}"
    for name in (
        "diffusion",
        "embed",
        "tts",
        "jobs",
        "cp",
        "cluster",
        "asr",
        "voice",
        "noise",
        "step",
        "threads",
        "attention",
    )
}


def build_parser() -> argparse.ArgumentParser:
    from bench.offline import add_offline_args
    from bench.online import add_online_args

    ap = argparse.ArgumentParser(prog="mmserve bench", description="offline throughput and online latency benchmarks")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_offline_args(sub.add_parser("offline", help="throughput: mmserve vs transformers vs vLLM, same workload"))
    add_online_args(sub.add_parser("online", help="latency under Poisson load against an OpenAI-compatible server"))
    from bench.profile_engine import add_profile_args

    add_profile_args(sub.add_parser("profile", help="per-phase time breakdown of mmserve decode steps"))
    sub.add_parser("diffusion", help="image/video generation: batching, video, step cache (see diffusion --help)")
    sub.add_parser("embed", help="embeddings: engine vs sentence-transformers, HTTP latency (see embed --help)")
    sub.add_parser("tts", help="TTS time-to-first-audio, 1 vs N concurrent, per backend (see tts --help)")
    sub.add_parser("jobs", help="job-queue throughput, concurrent submitters, local or celery (see jobs --help)")
    sub.add_parser("cp", help="context parallelism: single vs N ranks, bytes/step, GPU scaling model (see cp --help)")
    sub.add_parser(
        "cluster", help="celery cluster on loopback under load, with worker/Redis faults (see cluster --help)"
    )
    sub.add_parser("asr", help="speech-to-text throughput: engine vs transformers pipeline (see asr --help)")
    sub.add_parser("voice", help="voice-to-voice latency on /v1/realtime, 1 and 4 sessions (see voice --help)")
    sub.add_parser("noise", help="turn detection and ASR in noise, with and without noise reduction (see noise --help)")
    sub.add_parser("step", help="engine step time A/B: prepacked vs plain oneDNN weights (see step --help)")
    sub.add_parser("threads", help="engine decode step time on the main thread vs a worker thread (see threads --help)")
    both = sub.add_parser("all", help="offline, then online --launch mmserve,vllm (same workload flags)")
    add_offline_args(both)
    add_online_args(both, with_workload=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv and argv[0] in OWN_PARSERS:  # benchmarks that parse their own flags
        return int(importlib.import_module(OWN_PARSERS[argv[0]]).main(argv[1:]) or 0)
    args = build_parser().parse_args(argv)
    args.command_line = "mmserve bench " + shlex.join(argv)
    if args.cmd == "offline":
        from bench.offline import run_offline

        run_offline(args)
    elif args.cmd == "profile":
        from bench.profile_engine import run_profile

        run_profile(args)
    elif args.cmd == "online":
        from bench.online import run_online_cli

        run_online_cli(args)
    else:
        from bench.offline import run_offline
        from bench.online import run_online_cli

        run_offline(args)
        args.launch = args.launch or "mmserve,vllm"
        run_online_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
