"""The garbage collector in a server process (``engine.heap``): ``mmserve serve`` freezes
start-up's objects once warmed, and ``/metrics`` reports every collection's pause. In a child
process: freezing is process-wide, and this test process builds many apps."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CHILD = """
import gc, json, re
from fastapi.testclient import TestClient
from gateway.app import create_app

def served(freeze):
    with TestClient(create_app({}, routers=[], freeze_heap=freeze)) as client:
        junk = [[] for _ in range(1000)]
        for j in junk:
            j.append(j)  # cycles: only a collection frees them
        del junk
        gc.collect()
        text = client.get("/metrics").text
    frozen = int(float(re.search(r"^mmserve_gc_frozen_objects (\\S+)$", text, re.M).group(1)))
    full = re.search(r'^mmserve_gc_pause_seconds_count[{]generation="2"[}] (\\S+)$', text, re.M)
    return {"frozen": frozen, "full_collections": float(full.group(1)) if full else 0.0}

print(json.dumps([served(False), served(True)]))
"""


def test_serve_freezes_start_up_objects_and_metrics_time_collections() -> None:
    out = subprocess.run([sys.executable, "-c", CHILD], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    plain, frozen = json.loads(out.stdout.splitlines()[-1])
    assert plain["frozen"] == 0  # an app built without freeze_heap (tests, library use) freezes nothing
    assert frozen["frozen"] > 10_000  # what start-up made (fastapi, the gateway)
    assert plain["full_collections"] >= 1 and frozen["full_collections"] >= 1  # gc.collect() was timed
