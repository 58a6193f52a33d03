"""A cluster on loopback for tests and ``mmserve bench cluster``: a private ``redis-server`` and
``mmserve worker`` subprocesses, with helpers to wait for their heartbeats and to kill them."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis

from workers.wire import Keys


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RedisServer:
    """A throwaway ``redis-server`` (no persistence) on a free port; ``stop``/``start`` keep the port."""

    def __init__(self, port: int | None = None) -> None:
        self.port = port or free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def url(self, db: int = 0) -> str:
        return f"redis://127.0.0.1:{self.port}/{db}"

    def start(self, timeout_s: float = 10.0) -> None:
        exe = shutil.which("redis-server")
        if exe is None:
            raise FileNotFoundError("redis-server is not installed")
        cmd = [exe, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        client = redis.Redis(port=self.port, socket_connect_timeout=0.5)
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                client.ping()
                return
            except redis.exceptions.ConnectionError:
                if time.monotonic() > deadline or self.proc.poll() is not None:
                    raise RuntimeError(f"redis-server did not start on port {self.port}") from None
                time.sleep(0.05)
            finally:
                client.close()

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)
        self.proc = None


@dataclass
class WorkerProc:
    worker_id: str
    modality: str
    proc: subprocess.Popen[bytes]
    log: Path
    args: list[str] = field(default_factory=list)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            if sig in (signal.SIGKILL, signal.SIGTERM):
                self.proc.wait(30)

    def log_tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return ""


def start_worker(
    modality: str,
    redis_url: str,
    prefix: str,
    model_args: list[str],
    *,
    worker_id: str,
    concurrency: int = 4,
    heartbeat_s: float = 0.5,
    log_dir: Path | None = None,
    threads: int = 1,
) -> WorkerProc:
    """Start ``mmserve worker`` (its output goes to ``<log_dir>/<worker_id>.log``)."""
    log_dir = log_dir or Path(tempfile.mkdtemp(prefix="mmserve-cluster-"))
    log = log_dir / f"{worker_id}.log"
    args = [
        "--modality", modality, "--redis-url", redis_url, "--prefix", prefix, "--worker-id", worker_id,
        "--concurrency", str(concurrency), "--heartbeat-s", str(heartbeat_s), "--log-level", "warning",
        *model_args,
    ]  # fmt: skip
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        args.append("--allow-root")  # our own loopback Redis
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "worker", *args], stdout=out, stderr=subprocess.STDOUT, env=env
        )
    return WorkerProc(worker_id, modality, proc, log, args)


def wait_for_heartbeats(redis_url: str, prefix: str, workers: list[WorkerProc], timeout_s: float = 120.0) -> None:
    """Block until every worker in ``workers`` heartbeats (fail early if one exits)."""
    client = redis.Redis.from_url(redis_url, socket_timeout=2)
    keys = Keys(prefix)
    deadline = time.monotonic() + timeout_s
    try:
        while True:
            pending = [w for w in workers if not client.exists(keys.worker(w.worker_id))]
            if not pending:
                return
            for w in pending:
                if w.proc.poll() is not None:
                    raise RuntimeError(f"worker {w.worker_id} exited ({w.proc.returncode}):\n{w.log_tail()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"no heartbeat from {[w.worker_id for w in pending]} in {timeout_s:.0f}s")
            time.sleep(0.2)
    finally:
        client.close()
