"""The ``mmserve`` command: serve, worker, bench, models."""

from __future__ import annotations

import argparse
import logging
import os
import struct
import sys
import time
from pathlib import Path

from engine import allocator
from gateway import argtypes
from gateway.plugins import MODALITIES

# A bad file or value in a command's input: one line naming it, no traceback (the trace at debug).
USER_ERRORS = (OSError, ValueError, struct.error)


def _comma_list(value: str) -> list[str]:
    items = [v.strip() for v in value.split(",") if v.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"name at least one of {', '.join(MODALITIES)}")
    unknown = [v for v in items if v not in MODALITIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown modality {', '.join(unknown)}; choose from {', '.join(MODALITIES)}")
    return items


def _serve(args: argparse.Namespace) -> int:
    from gateway.app import build_app  # the API engineer's module; imported only when serving
    from gateway.drain import run_server
    from gateway.logs import configure_logging

    # Before the engines load, so their start-up records (kernels, GGUF blocks) are kept too.
    configure_logging(getattr(args, "log_format", "json"), getattr(args, "log_level", "info"))
    try:
        app = build_app(args, freeze_heap=True)  # a server process: start-up's objects live on
    except USER_ERRORS as exc:  # a bad model or option (before the server starts: exit 2)
        logging.getLogger("mmserve.gateway").debug("start-up failed", exc_info=True)
        print(f"mmserve serve: error: {exc}", file=sys.stderr)
        return 2
    run_server(app, args)  # graceful drain on SIGTERM
    return 0


def _worker(args: argparse.Namespace) -> int:
    from workers.worker import run_worker

    return run_worker(args)


def _models_list(args: argparse.Namespace) -> int:
    from engine.model_loader import DEFAULT_LLM, cache_root, gguf_cache_dir, smollm2_gguf_path

    print(f"cache: {cache_root()}  (set MMSERVE_CACHE to move it)")
    try:
        gguf = smollm2_gguf_path()
        cached = gguf_cache_dir(gguf)
        state = "converted" if cached.is_dir() else "not converted yet (run `mmserve models convert-gguf`)"
        print(f"llm  {DEFAULT_LLM} (default): {gguf}\n     -> {cached} [{state}]")
    except FileNotFoundError as exc:
        print(f"llm  {DEFAULT_LLM} (default): unavailable: {exc}")
    from gateway.plugins import servable, tiny_archs

    print(f"tiny test models (`mmserve models make-tiny ARCH DIR`): {', '.join(tiny_archs())}")
    try:
        from modalities.embed.model import DEFAULT_EMBED, default_embed_path

        print(f"embed {DEFAULT_EMBED} (default): {default_embed_path()}")
    except FileNotFoundError as exc:
        print(f"embed: unavailable: {exc}")
    from modalities.asr.model import DEFAULT_ASR, packaged_asr

    for spec, found in packaged_asr().items():
        name = f"asr  whisper-{spec}{' (default)' if spec == DEFAULT_ASR else ''}"
        if isinstance(found, FileNotFoundError):
            print(f"{name}: unavailable: {found}")
        else:
            state = "converted" if found[1].is_dir() else "converted on first use"
            print(f"{name}: {found[0]}\n     -> {found[1]} [{state}]")
    try:
        from modalities.tts.piper_engine import default_voice_path

        print(f"tts  piper (default voice): {default_voice_path()}")
    except FileNotFoundError as exc:
        print(f"tts  piper: unavailable: {exc}")

    print(f"not built yet: {', '.join(m for m in MODALITIES if m not in servable()) or 'none'}")
    return 0


def _models_make_tiny(args: argparse.Namespace) -> int:
    from gateway.plugins import tiny_archs

    start = time.perf_counter()
    argtypes.new_output_dir(args.dir)
    out = tiny_archs()[args.arch](args.dir, args.seed)
    print(f"wrote tiny {args.arch} (seed {args.seed}) to {out} in {time.perf_counter() - start:.1f}s")
    return 0


def _models_convert_gguf(args: argparse.Namespace) -> int:
    from engine.model_loader import DEFAULT_LLM, convert_gguf, gguf_cache_dir, gguf_source

    if args.src and not Path(args.src).expanduser().is_file():
        raise FileNotFoundError(f"no such file: {args.src}")
    src = gguf_source(args.src or DEFAULT_LLM)
    if src is None:
        raise ValueError(f"not a .gguf file: {args.src}")
    dst = Path(args.dst) if args.dst else gguf_cache_dir(src)
    if args.dst:
        argtypes.new_output_dir(dst, src)
    elif dst.exists():
        print(f"{dst} already exists; nothing to do (delete it to convert again)")
        return 0
    start = time.perf_counter()
    out = convert_gguf(src, dst)
    print(f"converted {src} -> {out} in {time.perf_counter() - start:.1f}s (cold start)")
    return 0


def _bench(argv: list[str]) -> int:
    if argv[:1] == ["embed"]:  # the embeddings benchmark has its own parser
        from bench.embed import main as bench_main

        argv = argv[1:]
    else:
        from bench.cli import main as bench_main
    try:
        return int(bench_main(argv) or 0)
    except Exception as exc:  # noqa: BLE001 - a bad argument or an unreachable server: one line, no traceback
        logging.getLogger("mmserve").debug("bench failed", exc_info=True)
        print(f"mmserve bench: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 1


def build_parser() -> argparse.ArgumentParser:
    from gateway import auth, plugins

    parser = argparse.ArgumentParser(prog="mmserve", description="multimodal inference server")
    sub = parser.add_subparsers(dest="command", required=True)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument("--host", default="127.0.0.1")
    serve.add_argument("--port", type=argtypes.port, default=8000)
    serve.add_argument("--only", type=_comma_list, default=None, help=f"comma list of {','.join(MODALITIES)}")
    serve.add_argument(
        "--no-warmup",
        action="store_true",
        help="skip the start-up warm-up (a spoken turn through the voice pipeline when LLM, ASR and TTS are served)",
    )
    serve.add_argument("--api-key", type=argtypes.api_key, default=None, help="require Authorization: Bearer <key>")
    serve.add_argument(
        "--max-body-mb", type=argtypes.positive, default=None, help="largest request body accepted (default 32)"
    )
    serve.add_argument(
        "--dispatch",
        choices=["local", "celery"],
        default="local",
        help="local: engines in this process; celery: forward to `mmserve worker` processes through Redis",
    )
    serve.add_argument(
        "--redis-url",
        type=argtypes.redis_url,
        default=os.environ.get("MMSERVE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="Redis for --dispatch celery (default $MMSERVE_REDIS_URL or local db 0)",
    )
    serve.add_argument("--prefix", default="mmserve", help="cluster queue/key prefix (must match the workers')")
    plugins.add_serve_args(serve)
    auth.add_serve_args(serve)  # --keys-file, --limit, --drain-*, --log-format
    serve.add_argument("--log-level", type=argtypes.log_level, default="info")
    serve.set_defaults(func=_serve)

    worker = sub.add_parser("worker", help="run one modality's engines as a Celery worker (--dispatch celery)")
    from workers.worker import add_worker_args

    add_worker_args(worker)
    plugins.add_serve_args(worker)
    worker.set_defaults(func=_worker)

    auth.add_keys_command(sub)
    sub.add_parser("bench", help="benchmarks (see `mmserve bench --help`)", add_help=False)

    models = sub.add_parser("models", help="list, convert and generate models")
    msub = models.add_subparsers(dest="models_command", required=True)
    msub.add_parser("list", help="default models and where they resolve").set_defaults(func=_models_list)
    tiny = msub.add_parser("make-tiny", help="write a tiny random model (tests)")
    tiny.add_argument("arch", choices=list(plugins.tiny_archs()))
    tiny.add_argument("dir")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(func=_models_make_tiny)
    conv = msub.add_parser("convert-gguf", help="dequantize a GGUF file into a safetensors directory")
    conv.add_argument("src", nargs="?", default=None, help="a .gguf file (default: the smollm2 GGUF)")
    conv.add_argument("dst", nargs="?", default=None, help="output directory (default: the model cache)")
    conv.set_defaults(func=_models_convert_gguf)
    for plugin in plugins.load_plugins().values():
        if hasattr(plugin, "add_models_commands"):
            plugin.add_models_commands(msub)
    return parser


OPENMP_DEFAULTS = {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}


def openmp_defaults() -> None:
    """Default libgomp to active waits, before torch loads it (the user's settings win).

    Several threads of one process run torch ops (the engine's, other modalities' owner threads,
    the event loop's), and each gets its own OpenMP team. Once the teams hold more threads than
    there are CPUs, libgomp's default stops spinning: every parallel region then pays a futex
    wake-up (a batch-2 linear 100 -> 150-220 us; decode steps on either thread 1.25-1.4x slower,
    ``mmserve bench threads``). Active waits with libgomp's usual spin count (300k) keep the fast
    hand-off on every thread, and idle teams still go to sleep soon after their last region."""
    if "torch" in sys.modules:
        return
    added = [k for k in OPENMP_DEFAULTS if k not in os.environ]
    os.environ.update({k: OPENMP_DEFAULTS[k] for k in added})
    if added:  # benchmarks start peers (vLLM) without them: see bench.offline.vllm_env
        os.environ["MMSERVE_OMP_DEFAULTS"] = ",".join(added)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    openmp_defaults()
    allocator.keep_freed_memory()
    if argv and argv[0] == "bench":  # everything after `bench` belongs to bench.cli
        return _bench(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except USER_ERRORS as exc:
        logging.getLogger("mmserve").debug("%s failed", args.command, exc_info=True)
        print(f"mmserve {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
