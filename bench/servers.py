"""Start/stop a local OpenAI-compatible server (mmserve or the vLLM peer) on a free loopback port."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.offline import DEFAULT_VLLM_VENV, REPO_ROOT, vllm_env

HOST = "127.0.0.1"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((HOST, 0))
        return int(s.getsockname()[1])


@dataclass
class LaunchedServer:
    name: str
    proc: subprocess.Popen[bytes]
    base_url: str
    log_path: Path
    cmd: list[str]
    env: dict[str, str]
    startup_s: float = 0.0

    def stop(self, timeout: float = 30.0) -> None:
        if self.proc.poll() is not None:
            return
        try:  # the server runs in its own session: signal its group (its engine/worker children too)
            os.killpg(self.proc.pid, signal.SIGINT)
            self.proc.wait(timeout=timeout)
        except (subprocess.TimeoutExpired, ProcessLookupError):
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=10)


def server_command(
    name: str,
    model: Path,
    port: int,
    threads: int,
    max_num_seqs: int,
    max_num_batched_tokens: int,
    kv_cache_gib: float,
    vllm_venv: Path = DEFAULT_VLLM_VENV,
    vllm_bind: str | None = None,
    quantization: str = "none",
) -> tuple[list[str], dict[str, str]]:
    if name == "mmserve":
        env = dict(os.environ, OMP_NUM_THREADS=str(threads))
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        cmd = [
            sys.executable, "-m", "gateway.cli", "serve", "--llm", str(model), "--host", HOST, "--port", str(port),
            "--only", "llm", "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens",
            str(max_num_batched_tokens), "--kv-cache-gb", str(kv_cache_gib), "--dtype", "float32",
            "--quantization", quantization, "--log-level", "warning",
        ]  # fmt: skip
        return cmd, env
    if name == "vllm":
        py = vllm_venv / "bin" / "python"
        if not py.exists():
            raise FileNotFoundError(f"no vLLM venv at {vllm_venv}")
        env = vllm_env(threads, vllm_bind, kv_cache_gib)
        cmd = [
            str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(model), "--dtype", "float32",
            "--max-model-len", "2048", "--gpu-memory-utilization", "0.3", "--host", HOST, "--port", str(port),
            "--max-num-seqs", str(max_num_seqs), "--max-num-batched-tokens", str(max_num_batched_tokens),
            "--seed", "0", "--uvicorn-log-level", "warning",
        ]  # fmt: skip
        return cmd, env
    raise ValueError(f"unknown server {name!r}: mmserve or vllm")


def launch(name: str, cmd: list[str], env: dict[str, str], log_dir: Path, ready_timeout: float = 900) -> LaunchedServer:
    port = int(cmd[cmd.index("--port") + 1])
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"server-{name}.log"
    print(f"launching {name}: {' '.join(cmd)}  (log: {log_path})", file=sys.stderr, flush=True)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            cmd, env=env, cwd=REPO_ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
    srv = LaunchedServer(name, proc, f"http://{HOST}:{port}", log_path, cmd, env)
    t0 = time.perf_counter()
    while True:
        if proc.poll() is not None:
            tail = log_path.read_text(errors="replace")[-3000:]
            raise RuntimeError(f"{name} server exited with {proc.returncode} before becoming ready:\n{tail}")
        try:
            if httpx.get(f"{srv.base_url}/v1/models", timeout=2).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.perf_counter() - t0 > ready_timeout:
            srv.stop()
            raise TimeoutError(f"{name} server not ready after {ready_timeout}s (log: {log_path})")
        time.sleep(1)
    srv.startup_s = time.perf_counter() - t0
    print(f"{name} ready at {srv.base_url} after {srv.startup_s:.0f}s", file=sys.stderr, flush=True)
    return srv
