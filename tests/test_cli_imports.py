"""``mmserve --help`` (and every CLI start) loads every plugin, and through it every modality's
router module; none of them may pull in the heavy inference libraries at import time (they are
imported when an engine is built or a route first runs). Checked in a fresh interpreter."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

HEAVY = ("torch", "transformers", "diffusers", "onnxruntime")

SCRIPT = f"""
import json, sys
import gateway.cli, gateway.plugins
gateway.cli.build_parser()
routers = gateway.plugins.routers()
print(json.dumps({{"routers": len(routers), "heavy": [m for m in {HEAVY!r} if m in sys.modules]}}))
"""


def test_building_the_parser_and_loading_routers_imports_no_heavy_library() -> None:
    root = Path(__file__).resolve().parents[1]
    proc = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=root, capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["routers"] >= 6, out  # every modality's router was really loaded
    assert out["heavy"] == [], f"imported at CLI start: {out['heavy']} (see `python -X importtime`)"


OPENMP = """
import json, os, sys
import gateway.cli
gateway.cli.openmp_defaults()
from bench.offline import vllm_env
peer = vllm_env(2, None, 1.0)
import torch  # libgomp reads the environment when it loads, after the defaults are in place
keys = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
print(json.dumps({"ours": {k: os.environ.get(k) for k in keys}, "peer": {k: peer.get(k) for k in keys}}))
"""


def test_serving_processes_default_openmp_to_short_active_waits_unless_the_user_set_them() -> None:
    import os

    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    outs = []
    for extra in ({}, {"OMP_WAIT_POLICY": "passive"}):
        proc = subprocess.run(
            [sys.executable, "-c", OPENMP], cwd=root, env={**env, **extra}, capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr
        outs.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    assert outs[0]["ours"] == {"OMP_WAIT_POLICY": "active", "GOMP_SPINCOUNT": "300000"}
    assert outs[0]["peer"] == {"OMP_WAIT_POLICY": None, "GOMP_SPINCOUNT": None}  # a benchmarked peer keeps its own
    assert outs[1]["ours"]["OMP_WAIT_POLICY"] == "passive"  # the user's choice wins, for the peer too
    assert outs[1]["peer"] == {"OMP_WAIT_POLICY": "passive", "GOMP_SPINCOUNT": None}


def test_serve_with_a_bad_model_says_why_and_exits_2(tmp_path: Path) -> None:
    """A start-up error in the user's options is one line on stderr and exit status 2, not a traceback."""
    root = Path(__file__).resolve().parents[1]
    missing = tmp_path / "no-such-model"
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--only", "llm", "--llm", str(missing), "--port", "0"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert f"mmserve serve: error: model '{missing}'" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_serve_only_a_modality_this_build_lacks_says_so() -> None:
    """``--only vlm`` was accepted and served nothing, silently."""
    root = Path(__file__).resolve().parents[1]
    cmd = [sys.executable, "-m", "gateway.cli", "serve", "--only", "vlm", "--port", "0"]
    proc = subprocess.run(cmd, cwd=root, capture_output=True, text=True, timeout=120, check=False)
    assert proc.returncode == 2, proc.stderr
    assert "mmserve serve: error: --only vlm: not served by this build" in proc.stderr
