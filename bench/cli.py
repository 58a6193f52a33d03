"""``mmserve bench {offline,online,all}``: entry point the gateway CLI forwards to (``bench.cli.main``)."""

from __future__ import annotations

import argparse
import sys


def build_parser() -> argparse.ArgumentParser:
    from bench.offline import add_offline_args
    from bench.online import add_online_args

    ap = argparse.ArgumentParser(prog="mmserve bench", description="offline throughput and online latency benchmarks")
    sub = ap.add_subparsers(dest="cmd", required=True)
    add_offline_args(sub.add_parser("offline", help="throughput: mmserve vs transformers vs vLLM, same workload"))
    add_online_args(sub.add_parser("online", help="latency under Poisson load against an OpenAI-compatible server"))
    both = sub.add_parser("all", help="offline, then online with --launch for each of --launch-all")
    add_offline_args(both)
    add_online_args(both, with_workload=False)
    both.add_argument("--launch-all", default="mmserve,vllm", help="servers to launch one after another for online")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(sys.argv[1:] if argv is None else argv)
    if args.cmd == "offline":
        from bench.offline import run_offline

        run_offline(args)
    elif args.cmd == "online":
        from bench.online import run_online_cli

        run_online_cli(args)
    else:
        from bench.offline import run_offline
        from bench.online import run_online_cli

        run_offline(args)
        for server in [s.strip() for s in args.launch_all.split(",") if s.strip()]:
            args.launch = server
            args.base_url = None
            run_online_cli(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
