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
