"""The job system under the local runner, over real HTTP (uvicorn on a loopback port): /v1/jobs
(submit, status, SSE and WebSocket progress, cancel, idempotency, errors), /v1/files and
/v1/batches with the real embedding model (batch output equals /v1/embeddings)."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import openai
import pytest
import websockets.exceptions
import websockets.sync.client

from modalities.embed.engine import EmbeddingEngine
from modalities.embed.model import DEFAULT_EMBED
from tests import test_jobs_kinds as kinds
from tests.helpers import serve_app, serving

API_KEY = "jobs-key"
BOB_KEY = "bob-key"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
BOB = {"Authorization": f"Bearer {BOB_KEY}"}


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from gateway.app import create_app
    from gateway.auth import KeyStore
    from modalities.embed.api import router as embed_router
    from workers.jobs.plugin import router as jobs_router
    from workers.jobs.runner import JobsConfig, JobService

    keys = KeyStore()
    keys.add_plain_key("alice", API_KEY)
    keys.add_plain_key("bob", BOB_KEY)
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.llm_engine import LLMEngine
    from engine.model_loader import load_model
    from engine.tiny_models import tiny_model_dir
    from modalities.llm.api import router as llm_router

    loaded = load_model(str(tiny_model_dir("llama")), max_model_len=256)
    config = EngineConfig(model=str(loaded.path), max_model_len=256, num_kv_blocks=96, max_num_seqs=8)
    engines = {DEFAULT_EMBED: EmbeddingEngine.from_path(None), "tiny": AsyncEngine(LLMEngine(config, loaded=loaded))}
    app = create_app(engines, keys=keys, routers=[embed_router, llm_router, jobs_router])
    root = tmp_path_factory.mktemp("results")
    app.state.jobs = JobService(JobsConfig(store={"type": "local", "root": str(root)}), app.state.engines)
    with serve_app(app) as url:
        yield url


def post(base: str, path: str, body: Any, **kw: Any) -> httpx.Response:
    return httpx.post(f"{base}{path}", json=body, headers={**HEADERS, **kw.pop("headers", {})}, timeout=30, **kw)


def get(base: str, path: str, **kw: Any) -> httpx.Response:
    return httpx.get(f"{base}{path}", headers=HEADERS, timeout=30, **kw)


def wait(base: str, job_id: str, statuses: tuple[str, ...] = ("succeeded", "failed", "cancelled")) -> dict[str, Any]:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        job = get(base, f"/v1/jobs/{job_id}").json()
        if job["status"] in statuses:
            return job
        time.sleep(0.02)
    raise AssertionError(f"job {job_id} did not reach {statuses}: {job}")


def sse(base: str, path: str) -> list[tuple[str, dict[str, Any]]]:
    events = []
    with httpx.stream("GET", f"{base}{path}", headers=HEADERS, timeout=30) as resp:
        assert resp.status_code == 200 and resp.headers["content-type"].startswith("text/event-stream")
        name = ""
        for line in resp.iter_lines():
            if line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                events.append((name, json.loads(line[6:])))
    return events


def error(resp: httpx.Response, status: int) -> dict[str, Any]:
    assert resp.status_code == status, resp.text
    err = resp.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["message"]
    return err


@pytest.mark.parametrize("kind", ["test.steps", "test.sync_steps"])
def test_submit_runs_and_reports(base: str, kind: str) -> None:
    resp = post(base, "/v1/jobs", {"kind": kind, "params": {"steps": 4}})
    assert resp.status_code == 202, resp.text
    job = resp.json()
    assert job["id"].startswith("job_") and job["status"] in ("queued", "running", "succeeded")
    assert resp.headers["location"] == f"/v1/jobs/{job['id']}"
    done = wait(base, job["id"])
    assert done["status"] == "succeeded" and done["attempts"] == 1 and done["error"] is None
    assert done["progress"] == {"step": 4, "total": 4} and done["result"]["steps"] == 4
    assert done["timings"]["queue_s"] >= 0 and done["timings"]["run_s"] > 0
    if kind == "test.steps":  # result files are fetched by URL
        (f,) = done["files"]
        assert done["result"]["url"] == f["url"] and f["name"] == "out.txt" and f["bytes"] == len(b"4 steps, attempt 1")
        content = get(base, f["url"])
        assert content.status_code == 200 and content.content == b"4 steps, attempt 1"
        assert content.headers["content-type"].startswith("text/plain")
        assert get(base, f"/v1/files/{f['id']}").json()["purpose"] == "job_result"


def test_sse_progress_in_order_with_previews_on_request(base: str) -> None:
    job = post(base, "/v1/jobs", {"kind": "test.steps", "params": {"steps": 6}, "preview": True}).json()
    events = sse(base, f"/v1/jobs/{job['id']}/events?previews=true")
    assert [e[1]["status"] for e in events if e[0] == "status"] == ["queued", "running", "succeeded"]
    progress = [e[1] for e in events if e[0] == "progress"]
    assert [(p["step"], p["total"]) for p in progress] == [(i, 6) for i in range(1, 7)]
    assert [p["preview"] for p in progress] == ["AA==", "AQ==", "Ag==", "Aw==", "BA==", "BQ=="]  # bytes([i]) in b64
    assert [e[0] for e in events][-1] == "status"  # the stream ends with the final status
    # without ?previews the same log comes back without preview payloads
    assert all("preview" not in e[1] for e in sse(base, f"/v1/jobs/{job['id']}/events"))


def test_sse_keepalive_while_a_step_runs(base: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import workers.jobs.api

    monkeypatch.setattr(workers.jobs.api, "SSE_KEEPALIVE_S", 0.05)
    job = post(base, "/v1/jobs", {"kind": "test.steps", "params": {"steps": 2, "delay": 0.3}}).json()
    with httpx.stream("GET", f"{base}/v1/jobs/{job['id']}/events", headers=HEADERS, timeout=30) as resp:
        text = "".join(resp.iter_text())
    blocks = [b for b in text.split("\n\n") if b.strip()]
    assert ": keep-alive" in blocks and '"status": "succeeded"' in blocks[-1]


def test_websocket_events_and_cancel(base: str) -> None:
    job = post(base, "/v1/jobs", {"kind": "test.steps", "params": {"steps": 2000, "delay": 0.01}}).json()
    url = base.replace("http://", "ws://") + f"/v1/jobs/{job['id']}/ws"
    seen = []
    with websockets.sync.client.connect(url, additional_headers=HEADERS) as ws:
        for raw in ws:
            ev = json.loads(raw)
            seen.append(ev)
            if ev["type"] == "progress" and ev["step"] == 3:
                ws.send(json.dumps({"type": "cancel"}))
    assert seen[-1] == {**seen[-1], "type": "status", "status": "cancelled"}
    assert wait(base, job["id"])["status"] == "cancelled"


@pytest.mark.parametrize("kind", ["test.steps", "test.sync_steps"])
def test_cancel_stops_a_running_job(base: str, kind: str) -> None:
    tag = f"cancel-{kind}"
    job = post(base, "/v1/jobs", {"kind": kind, "params": {"steps": 5000, "delay": 0.005, "tag": tag}}).json()
    wait(base, job["id"], ("running",))
    time.sleep(0.1)
    resp = post(base, f"/v1/jobs/{job['id']}/cancel", None)
    assert resp.status_code == 200 and resp.json()["status"] == "cancelled"
    time.sleep(0.2)  # a sync job stops at its next check_cancelled()
    step = get(base, f"/v1/jobs/{job['id']}").json()["progress"]["step"]
    time.sleep(0.3)
    after = get(base, f"/v1/jobs/{job['id']}").json()
    assert after["status"] == "cancelled" and after["progress"]["step"] == step < 5000  # it stopped
    assert kinds.RUNS[tag] == 1
    assert post(base, f"/v1/jobs/{job['id']}/cancel", None).status_code == 200  # idempotent


def test_idempotency_key_returns_the_same_job(base: str) -> None:
    body = {"kind": "test.steps", "params": {"steps": 3, "tag": "idem"}}
    first = post(base, "/v1/jobs", body, headers={"Idempotency-Key": "k-1"})
    again = [post(base, "/v1/jobs", body, headers={"Idempotency-Key": "k-1"}) for _ in range(3)]
    assert {r.json()["id"] for r in again} == {first.json()["id"]}
    assert all(r.status_code == 202 and r.headers["idempotent-replayed"] == "true" for r in again)
    wait(base, first.json()["id"])
    assert kinds.RUNS["idem"] == 1  # no duplicate work
    assert post(base, "/v1/jobs", body, headers={"Idempotency-Key": "k-1"}).json()["status"] == "succeeded"
    other = {"kind": "test.steps", "params": {"steps": 4, "tag": "idem"}}
    assert error(post(base, "/v1/jobs", other, headers={"Idempotency-Key": "k-1"}), 409)["param"] == "Idempotency-Key"


def test_failed_job_reports_the_error(base: str) -> None:
    job = post(base, "/v1/jobs", {"kind": "test.steps", "params": {"steps": 2, "fail": True}}).json()
    done = wait(base, job["id"])
    assert done["status"] == "failed" and done["attempts"] == 1
    assert done["error"]["message"] == "RuntimeError: boom"
    assert error(post(base, f"/v1/jobs/{job['id']}/cancel", None), 409)["code"] == "job_finished"


def test_errors_are_retried_when_the_kind_asks() -> None:
    from gateway.app import create_app
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobsConfig, JobService

    app = create_app({}, routers=[router])
    app.state.jobs = JobService(JobsConfig(max_attempts=3), serving("embed"))
    with serve_app(app) as url:
        ok = httpx.post(f"{url}/v1/jobs", json={"kind": "test.flaky", "params": {"fail_attempts": 2}}).json()
        done = wait(url, ok["id"])
        assert done["status"] == "succeeded" and done["attempts"] == 3 and done["result"] == {"attempt": 3}
        bad = httpx.post(f"{url}/v1/jobs", json={"kind": "test.flaky", "params": {"fail_attempts": 5}}).json()
        failed = wait(url, bad["id"])
        assert failed["status"] == "failed" and failed["attempts"] == 3
        assert failed["error"]["message"].startswith("RuntimeError: flaky attempt 3 (gave up after 3 attempts)")
        bad_input = httpx.post(f"{url}/v1/jobs", json={"kind": "test.flaky", "params": {"bad_input": True}}).json()
        refused = wait(url, bad_input["id"])  # the input's fault: not retried, reported as a route would
        assert refused["status"] == "failed" and refused["attempts"] == 1, refused
        assert refused["error"] == {
            "message": "params.bad_input: this input can't be processed",
            "type": "invalid_request_error",
            "param": "params.bad_input",
            "code": "invalid_value",
        }, refused


def check_unserved_kinds_are_400(cfg: Any) -> None:
    """A gateway serving only an ASR model, and one serving no model at all (``--only diffusion``
    without ``--image`` or ``--video``; it queued every kind), their jobs under ``cfg``: a batch
    of every endpoint and a job of an ``embed`` kind are 400s naming the field that chose them,
    and nothing is queued (the check lives in ``JobService.submit``, whatever the runner)."""
    from gateway.app import create_app
    from workers.jobs.batch import ENDPOINTS
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobService

    for engines in (serving("asr"), {}):
        app = create_app({}, routers=[router])
        app.state.jobs = JobService(cfg, engines)
        with serve_app(app) as url:
            for endpoint, modality in ENDPOINTS.items():
                line = {"custom_id": "a", "method": "POST", "url": endpoint, "body": {"input": "x"}}
                files = {"file": ("in.jsonl", json.dumps(line).encode(), "application/jsonl")}
                up = httpx.post(f"{url}/v1/files", files=files, data={"purpose": "batch"}, timeout=30).json()
                body = {"input_file_id": up["id"], "endpoint": endpoint, "completion_window": "24h"}
                err = error(httpx.post(f"{url}/v1/batches", json=body, timeout=30), 400)
                assert err["param"] == "endpoint" and f"needs a model of modality {modality!r}" in err["message"], err
            err = error(httpx.post(f"{url}/v1/jobs", json={"kind": "test.steps"}, timeout=30), 400)
            assert err["param"] == "kind" and "needs a model of modality 'embed'" in err["message"], err
            assert httpx.get(f"{url}/v1/batches", timeout=30).json()["data"] == []


def test_kinds_whose_modality_is_not_served_are_400(tmp_path: Path) -> None:
    from workers.jobs.runner import JobsConfig

    check_unserved_kinds_are_400(JobsConfig(store={"type": "local", "root": str(tmp_path)}))


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"kind": "nope"}, "kind"),
        ({"params": {}}, "kind"),
        ({"kind": "test.steps", "params": {"steps": 0}}, "params"),
        ({"kind": "test.steps", "params": []}, "params"),
        ({"kind": "test.steps", "extra": 1}, "extra"),
    ],
)
def test_bad_job_requests(base: str, body: dict[str, Any], param: str) -> None:
    assert error(post(base, "/v1/jobs", body), 400)["param"] == param


def test_unknown_ids_and_auth(base: str) -> None:
    for path in (
        "/v1/jobs/job_nope",
        "/v1/jobs/job_nope/events",
        "/v1/files/file-nope",
        "/v1/files/x/content",
        "/v1/batches/batch_nope",
        "/v1/files/file-job_x--out.txt/content",
        "/v1/files/..%2Fetc",
    ):
        error(get(base, path), 404)
    error(post(base, "/v1/jobs/job_nope/cancel", None), 404)
    assert "No batch found" in error(get(base, "/v1/batches/batch_nope"), 404)["message"]
    error(httpx.post(f"{base}/v1/jobs", json={"kind": "test.steps"}), 401)
    ws_base = base.replace("http://", "ws://")
    with pytest.raises(websockets.exceptions.InvalidStatus) as rejected:
        websockets.sync.client.connect(f"{ws_base}/v1/jobs/job_nope/ws")
    assert rejected.value.response.status_code == 401
    with websockets.sync.client.connect(f"{ws_base}/v1/jobs/job_nope/ws", additional_headers=HEADERS) as ws:
        assert json.loads(ws.recv())["error"]["code"] == "not_found"
    key_only = [f"openai-insecure-api-key.{API_KEY}"]  # a browser's: its answer must name what it offered
    with websockets.sync.client.connect(f"{ws_base}/v1/jobs/job_nope/ws", subprotocols=key_only) as ws:  # type: ignore[list-item]
        assert ws.subprotocol == key_only[0] and json.loads(ws.recv())["error"]["code"] == "not_found"
    resp = httpx.post(f"{base}/v1/jobs", content=b"{not json", headers={**HEADERS, "content-type": "application/json"})
    error(resp, 400)


# -- files and batches with the real embedding model ------------------------------------------------

TEXTS = ["Hello world.", "A much longer passage that keeps going. " * 8, "short", "naïve café", "ok", "x " * 100]


def client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)


def test_the_openai_client_pages_through_files_and_batches(base: str) -> None:
    """Auto-paging with ``limit=1`` reads every file and batch once, newest first; a cursor that
    names nothing of the caller's is a 400 naming ``after`` (it listed from the top)."""
    c = client(base)
    for i in range(3):
        c.files.create(file=(f"page{i}.txt", b"page"), purpose="user_data")
    listed = c.files.list(limit=10_000).data
    whole, kept = [f.id for f in listed], [f.id for f in listed if not f.filename.startswith("page")]
    assert len(whole) >= 3 and [f.id for f in c.files.list(limit=1)] == whole
    batches = [b.id for b in c.batches.list(limit=100).data]
    assert [b.id for b in c.batches.list(limit=1)] == batches
    assert [f["id"] for f in get(base, "/v1/files?after=").json()["data"]] == whole  # (empty: from the top)
    for f in c.files.list(limit=1):  # deleting what it pages through: a deleted cursor still reads on
        if f.filename.startswith("page"):
            c.files.delete(f.id)
    assert [f.id for f in c.files.list(limit=1)] == kept
    for listing in (c.files.list, c.batches.list):
        with pytest.raises(openai.BadRequestError) as refused:
            listing(after="file-nothing")
        assert refused.value.body["param"] == "after" and "list again" in refused.value.body["message"]  # type: ignore[index]


def run_batch(base: str, lines: list[dict[str, Any]], endpoint: str) -> tuple[Any, list[dict[str, Any]]]:
    """Upload ``lines``, run them as a batch, return the finished batch and its output lines."""
    c = client(base)
    upload = c.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint=endpoint, completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := c.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    out = (
        [json.loads(x) for x in c.files.content(batch.output_file_id).text.splitlines()] if batch.output_file_id else []
    )
    return batch, out


@pytest.mark.parametrize("endpoint", ["/v1/chat/completions", "/v1/completions"])
def test_llm_batches_equal_the_online_endpoints(base: str, endpoint: str) -> None:
    prompts = ["Hello there", "Once upon a time", "1 2 3 4", "The capital of France"]
    bodies = [
        {"model": "tiny", "max_tokens": 8, "temperature": 0, "seed": 1}
        | ({"messages": [{"role": "user", "content": p}]} if "chat" in endpoint else {"prompt": p})
        for p in prompts
    ]
    lines = [{"custom_id": f"c{i}", "method": "POST", "url": endpoint, "body": b} for i, b in enumerate(bodies)]
    batch, out = run_batch(base, lines, endpoint)
    assert batch.status == "completed" and batch.request_counts.completed == len(prompts)
    for o, body in zip(out, bodies, strict=True):
        online = post(base, endpoint, body).json()
        got, want = o["response"]["body"]["choices"][0], online["choices"][0]
        key = "message" if "chat" in endpoint else "text"
        assert got[key] == want[key] and o["response"]["body"]["usage"] == online["usage"]


def test_a_cancelled_batch_keeps_the_lines_it_finished(base: str) -> None:
    """As OpenAI's: cancelling a batch mid-run leaves an output file of the lines done, in input
    order (the lines the cancel cut short are neither there nor counted as failed)."""
    bodies = [
        {"model": "tiny", "prompt": f"line {i}", "temperature": 0}
        | ({"max_tokens": 1} if i < 16 else {"max_tokens": 240, "ignore_eos": True})
        for i in range(120)
    ]
    lines = [
        {"custom_id": f"c{i}", "method": "POST", "url": "/v1/completions", "body": b} for i, b in enumerate(bodies)
    ]
    c = client(base)
    upload = c.files.create(file=("in.jsonl", "\n".join(json.dumps(x) for x in lines).encode()), purpose="batch")
    batch = c.batches.create(input_file_id=upload.id, endpoint="/v1/completions", completion_window="24h")
    deadline = time.monotonic() + 60
    while (batch := c.batches.retrieve(batch.id)).request_counts.completed < 16:
        assert time.monotonic() < deadline and batch.status != "completed", batch
        time.sleep(0.05)
    cancelled = c.batches.cancel(batch.id)  # (it answers once the finished lines are stored)
    assert cancelled.status == "cancelled" and cancelled.output_file_id is not None, cancelled
    batch = c.batches.retrieve(batch.id)
    out = [json.loads(x) for x in c.files.content(batch.output_file_id).text.splitlines()]
    done = [int(o["custom_id"][1:]) for o in out]
    assert set(range(16)) <= set(done) and len(done) < len(lines)
    assert all(o["response"]["status_code"] == 200 for o in out)
    assert batch.status == "cancelled" and batch.error_file_id is None
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(out), 0)


def test_embeddings_batch_equals_the_online_endpoint(base: str, tmp_path: Path) -> None:
    lines = [
        {
            "custom_id": f"r{i}",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": DEFAULT_EMBED, "input": text, **({"dimensions": 64} if i % 2 else {})},
        }
        for i, text in enumerate(TEXTS)
    ]
    lines.append(
        {
            "custom_id": "bad",
            "method": "POST",
            "url": "/v1/embeddings",
            "body": {"model": DEFAULT_EMBED, "input": "x", "dimensions": 9999},
        }
    )
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    c = client(base)
    upload = c.files.create(file=path.open("rb"), purpose="batch")
    assert upload.bytes == path.stat().st_size and upload.purpose == "batch"
    assert c.files.content(upload.id).content == path.read_bytes()
    batch = c.batches.create(
        input_file_id=upload.id, endpoint="/v1/embeddings", completion_window="24h", metadata={"who": "test"}
    )
    assert batch.id.startswith("batch_") and batch.request_counts.total == len(lines)
    deadline = time.monotonic() + 60
    while (batch := c.batches.retrieve(batch.id)).status not in ("completed", "failed", "cancelled"):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert batch.status == "completed", batch
    assert (batch.request_counts.completed, batch.request_counts.failed) == (len(TEXTS), 1)
    assert batch.metadata == {"who": "test"} and c.files.retrieve(batch.output_file_id).purpose == "batch_output"
    out = [json.loads(x) for x in c.files.content(batch.output_file_id).text.splitlines()]
    assert [o["custom_id"] for o in out] == [f"r{i}" for i in range(len(TEXTS))]  # input order
    for o, line in zip(out, lines, strict=False):
        assert o["response"]["status_code"] == 200 and o["error"] is None
        online = post(base, "/v1/embeddings", line["body"]).json()
        got = np.array(o["response"]["body"]["data"][0]["embedding"], dtype=np.float32)
        want = np.array(online["data"][0]["embedding"], dtype=np.float32)
        assert got.shape == want.shape and np.allclose(got, want, atol=1e-6)
        assert o["response"]["body"]["usage"] == online["usage"]
    (err,) = [json.loads(x) for x in c.files.content(batch.error_file_id).text.splitlines()]
    assert err["custom_id"] == "bad" and err["response"]["status_code"] == 400
    assert err["response"]["body"]["error"]["param"] == "dimensions"


@pytest.mark.parametrize(
    ("content", "endpoint", "needle"),
    [
        (b"{not json}\n", "/v1/embeddings", "line 1: not valid JSON"),
        (b'{"custom_id": "a", "url": "/v1/completions", "body": {}}\n', "/v1/embeddings", "line 1: 'url'"),
        (b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n' * 2, "/v1/embeddings", "duplicate custom_id"),
        (b"\n\n", "/v1/embeddings", "no requests"),
        (b'{"custom_id": "a", "url": "/v1/embeddings", "body": {}}\n', "/v1/images", "endpoint must be"),
    ],
)
def test_bad_batches_are_400(base: str, content: bytes, endpoint: str, needle: str) -> None:
    files = {"file": ("in.jsonl", content, "application/jsonl")}
    up = httpx.post(f"{base}/v1/files", files=files, data={"purpose": "batch"}, headers=HEADERS, timeout=30)
    assert up.status_code == 200, up.text
    body = {"input_file_id": up.json()["id"], "endpoint": endpoint, "completion_window": "24h"}
    assert needle in error(post(base, "/v1/batches", body), 400)["message"]


def test_bad_uploads(base: str) -> None:
    def upload(name: str, content: bytes, purpose: str) -> httpx.Response:
        files = {"file": (name, content, "application/octet-stream")}
        return httpx.post(f"{base}/v1/files", files=files, data={"purpose": purpose}, headers=HEADERS, timeout=30)

    assert error(upload("a.jsonl", b"{}", "fine-tune-nope"), 400)["param"] == "purpose"
    assert error(upload("a.txt", b"{}", "batch"), 400)["param"] == "file"
    assert error(upload("a.jsonl", b"", "batch"), 400)["param"] == "file"
    no_file = httpx.post(f"{base}/v1/files", files={"purpose": (None, "batch")}, headers=HEADERS)
    assert error(no_file, 400)["param"] == "file"
    missing = {"input_file_id": "file-nope", "endpoint": "/v1/embeddings", "completion_window": "24h"}
    error(post(base, "/v1/batches", missing), 404)
    up = upload("a.jsonl", b'{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}\n', "batch").json()
    assert client(base).files.delete(up["id"]).deleted
    error(get(base, f"/v1/files/{up['id']}"), 404)


def test_tenants_see_only_their_own_jobs_and_files(base: str) -> None:
    body = {"kind": "test.steps", "params": {"steps": 1}}
    mine = post(base, "/v1/jobs", body, headers={"Idempotency-Key": "shared-key"}).json()
    theirs = httpx.post(f"{base}/v1/jobs", json=body, headers={**BOB, "Idempotency-Key": "shared-key"}).json()
    assert theirs["id"] != mine["id"]  # idempotency keys are per tenant
    done = wait(base, mine["id"])
    for path in (
        f"/v1/jobs/{mine['id']}",
        f"/v1/jobs/{mine['id']}/events",
        f"/v1/files/{done['files'][0]['id']}",
        done["files"][0]["url"],
    ):
        error(httpx.get(f"{base}{path}", headers=BOB), 404)
    error(httpx.post(f"{base}/v1/jobs/{mine['id']}/cancel", headers=BOB), 404)
    files = {"file": ("a.jsonl", b'{"custom_id": "a", "url": "/v1/embeddings", "body": {"input": "x"}}\n', "x/y")}
    up = httpx.post(f"{base}/v1/files", files=files, data={"purpose": "batch"}, headers=HEADERS).json()
    assert up["id"] in [f["id"] for f in get(base, "/v1/files").json()["data"]]
    assert up["id"] not in [f["id"] for f in httpx.get(f"{base}/v1/files", headers=BOB).json()["data"]]
    batch = {"input_file_id": up["id"], "endpoint": "/v1/embeddings", "completion_window": "24h"}
    error(httpx.post(f"{base}/v1/batches", json=batch, headers=BOB), 404)
    created = post(base, "/v1/batches", batch).json()
    listed = get(base, "/v1/batches?limit=1").json()
    assert listed["data"][0]["id"] == created["id"] and listed["object"] == "list"
    assert httpx.get(f"{base}/v1/batches", headers=BOB).json()["data"] == []
    wait(base, created["id"])


def test_too_many_waiting_jobs_is_429() -> None:
    from gateway.app import create_app
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobsConfig, JobService

    app = create_app({}, routers=[router])
    app.state.jobs = JobService(JobsConfig(max_queued=1), serving("embed"))
    body = {"kind": "test.sync_steps", "params": {"steps": 1000, "delay": 0.01}}  # 2 run at once
    with serve_app(app) as url:
        ids = [httpx.post(f"{url}/v1/jobs", json=body).json()["id"] for _ in range(2)]
        for job_id in ids:
            wait(url, job_id, ("running",))
        ids.append(httpx.post(f"{url}/v1/jobs", json=body).json()["id"])  # waits
        full = httpx.post(f"{url}/v1/jobs", json=body)
        assert error(full, 429)["code"] == "rate_limit_exceeded" and full.headers["retry-after"] == "5"
        for job_id in ids:
            httpx.post(f"{url}/v1/jobs/{job_id}/cancel")


def test_unreachable_job_store_is_503() -> None:
    from gateway.app import create_app
    from workers.jobs.plugin import router
    from workers.jobs.runner import JobsConfig, JobService

    app = create_app({}, routers=[router])
    app.state.jobs = JobService(JobsConfig(dispatch="celery", redis_url="redis://127.0.0.1:1/0"), serving("embed"))
    with serve_app(app) as url:
        t0 = time.monotonic()
        error(httpx.post(f"{url}/v1/jobs", json={"kind": "test.steps"}), 503)
        error(httpx.get(f"{url}/v1/jobs/job_x"), 503)
        error(httpx.post(f"{url}/v1/jobs/job_x/cancel"), 503)
        files = {"file": ("a.jsonl", b"{}", "x/y")}
        error(httpx.post(f"{url}/v1/files", files=files, data={"purpose": "batch"}), 503)
        error(httpx.get(f"{url}/v1/batches"), 503)
        assert time.monotonic() - t0 < 20
