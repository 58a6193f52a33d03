"""Minimal Prometheus text exposition: gateway counters/histograms plus engine ``stats()`` gauges.

Series (all prefixed ``mmserve_``; ``modality`` is ``llm``, ``embed``, ``asr``, ``tts``,
``diffusion``, ``gateway``, ``jobs``, ...):

- every HTTP route (``HTTPMetricsMiddleware``): ``http_requests_total{modality,path,status}``,
  ``http_request_errors_total{modality,path,status}`` (status >= 400),
  ``http_request_duration_seconds{modality,path}`` (end to end, streams until their last byte),
  ``http_inflight_requests``;
- per request, from the routes: ``request_queue_seconds``, ``request_inference_seconds``
  ``{modality,model}``, recorded (with the log fields) by any modality's route as
  ``headers["Server-Timing"] = server_timing_header(record_timing(request, "tts", model, queue_s,
  inference_s, total_s))``; the LLM routes add
  ``time_to_first_token_seconds``, ``time_per_output_token_seconds``,
  ``e2e_request_latency_seconds`` and ``requests_total{model,endpoint,status}``;
- per engine, from its ``stats()``: every numeric stat as ``engine_<stat>{model}``, and the
  standard series below ``{modality,model}`` when the engine reports the matching stat key.
  Engines of any modality should use these keys: ``num_waiting`` (or ``num_pending``) ->
  ``queue_depth``, ``num_running`` -> ``running_batch_size``, ``kv_cache_usage`` ->
  ``kv_cache_usage_ratio``, ``prefix_cache_hit_rate``, ``num_preemptions`` -> ``preemptions_total``.
  An engine's modality is its ``modality`` attribute, else its module (``modalities.<name>``).
"""

from __future__ import annotations

import math
import re
import threading
import time
from collections import defaultdict
from collections.abc import Mapping
from typing import Any

from starlette.requests import Request
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from gateway.logs import annotate, route_info

LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

Labels = tuple[tuple[str, str], ...]


def _fmt_labels(labels: Labels) -> str:
    if not labels:
        return ""
    inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels)
    return "{" + inner + "}"


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _metric_name(name: str) -> str:
    return re.sub(r"[^a-zA-Z0-9_]", "_", name)


class Metrics:
    """Thread-safe counters and histograms, rendered as Prometheus text."""

    def __init__(self, prefix: str = "mmserve") -> None:
        self.prefix = prefix
        self._lock = threading.Lock()
        self._counters: dict[str, dict[Labels, float]] = defaultdict(lambda: defaultdict(float))
        self._hists: dict[str, dict[Labels, list[float]]] = defaultdict(dict)  # bucket counts + [sum, count]
        self._gauges: dict[str, dict[Labels, float]] = defaultdict(dict)
        self._help: dict[str, str] = {}

    def inc(self, name: str, value: float = 1.0, help: str = "", **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._counters[name][key] += value
            self._help.setdefault(name, help)

    def set_gauge(self, name: str, value: float, help: str = "", **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._gauges[name][key] = value
            self._help.setdefault(name, help)

    def observe(self, name: str, value: float, help: str = "", **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            h = self._hists[name].setdefault(key, [0.0] * (len(LATENCY_BUCKETS) + 2))
            for i, bound in enumerate(LATENCY_BUCKETS):
                if value <= bound:
                    h[i] += 1
            h[-2] += value
            h[-1] += 1
            self._help.setdefault(name, help)

    def render(
        self,
        engine_stats: Mapping[str, Mapping[str, Any]] | None = None,
        engine_modalities: Mapping[str, str] | None = None,
    ) -> str:
        """Prometheus text for the gateway metrics and, per model, the engine's numeric stats
        (``engine_modalities``: model -> modality, for the standard per-modality series)."""
        lines: list[str] = []
        p = self.prefix
        with self._lock:
            for name, series in sorted(self._counters.items()):
                full = f"{p}_{name}"
                lines += [f"# HELP {full} {self._help.get(name) or name}", f"# TYPE {full} counter"]
                lines += [f"{full}{_fmt_labels(k)} {v:g}" for k, v in sorted(series.items())]
            for name, series in sorted(self._hists.items()):
                full = f"{p}_{name}"
                lines += [f"# HELP {full} {self._help.get(name) or name}", f"# TYPE {full} histogram"]
                for key, h in sorted(series.items()):
                    for i, bound in enumerate(LATENCY_BUCKETS):
                        lines.append(f"{full}_bucket{_fmt_labels(key + (('le', f'{bound:g}'),))} {h[i]:g}")
                    lines.append(f"{full}_bucket{_fmt_labels(key + (('le', '+Inf'),))} {h[-1]:g}")
                    lines.append(f"{full}_sum{_fmt_labels(key)} {h[-2]:g}")
                    lines.append(f"{full}_count{_fmt_labels(key)} {h[-1]:g}")
            for name, values in sorted(self._gauges.items()):
                full = f"{p}_{name}"
                lines += [f"# HELP {full} {self._help.get(name) or name}", f"# TYPE {full} gauge"]
                lines += [f"{full}{_fmt_labels(k)} {v:g}" for k, v in sorted(values.items())]
        lines += _standard_series(p, engine_stats or {}, engine_modalities or {})
        lines += _engine_gauges(p, engine_stats or {})
        return "\n".join(lines) + "\n"


# standard series: (name, type, help, stat keys in order of preference)
_STANDARD = (
    ("queue_depth", "gauge", "requests (or inputs) waiting for the engine", ("num_waiting", "num_pending")),
    ("running_batch_size", "gauge", "requests (or inputs) in the running batch", ("num_running",)),
    ("kv_cache_usage_ratio", "gauge", "fraction of KV cache blocks in use", ("kv_cache_usage",)),
    ("prefix_cache_hit_rate", "gauge", "prompt tokens served from the prefix cache", ("prefix_cache_hit_rate",)),
    ("preemptions_total", "counter", "running requests preempted for KV space", ("num_preemptions",)),
)


def engine_modality(engine: Any) -> str:
    """``engine.modality``, else ``<name>`` of the first ``modalities.<name>`` module in its class
    hierarchy, ``llm`` for the shared engine's classes."""
    explicit = getattr(engine, "modality", None)
    if isinstance(explicit, str):
        return explicit
    return _module_modality(engine) or "other"


def plugin_modality(engine: Any) -> str:
    """The modality whose plugin serves ``engine`` (``gateway.plugins.MODALITIES``: a worker's
    ``--modality`` and queue): ``engine_modality`` but by class first, so a diffusion engine
    (``modality`` ``image`` or ``video``) is ``diffusion``'s."""
    return _module_modality(engine) or engine_modality(engine)


def _module_modality(engine: Any) -> str | None:
    for cls in type(engine).__mro__:  # through subclasses such as the Celery proxies
        parts = cls.__module__.split(".")
        if parts[0] == "modalities" and len(parts) > 1:
            return parts[1]
        if parts[0] == "engine":
            return "llm"
    return None


def _standard_series(
    prefix: str, engine_stats: Mapping[str, Mapping[str, Any]], modalities: Mapping[str, str]
) -> list[str]:
    lines: list[str] = []
    for name, kind, help, keys in _STANDARD:
        rows = []
        for model, stats in engine_stats.items():
            value = next((stats[k] for k in keys if isinstance(stats.get(k), int | float)), None)
            if value is not None and math.isfinite(value):
                labels = (("modality", modalities.get(model, "other")), ("model", model))
                rows.append(f"{prefix}_{name}{_fmt_labels(labels)} {float(value):g}")
        if rows:
            lines += [f"# HELP {prefix}_{name} {help}", f"# TYPE {prefix}_{name} {kind}", *rows]
    return lines


def record_timing(
    request: Request, modality: str, model: str, queue_s: float, inference_s: float, total_s: float
) -> dict[str, float]:
    """Record a request's time split in the metrics and its log line; returns it in ms
    (``queue_ms``, ``inference_ms``, ``total_ms``), ready for ``server_timing_header``."""
    metrics: Metrics | None = getattr(request.app.state, "metrics", None)
    if metrics is not None:
        labels = {"modality": modality, "model": model}
        metrics.observe("request_queue_seconds", queue_s, help="time waiting for the engine", **labels)
        metrics.observe("request_inference_seconds", inference_s, help="time in the engine", **labels)
    timing = {
        k: round(v * 1e3, 1) for k, v in (("queue_ms", queue_s), ("inference_ms", inference_s), ("total_ms", total_s))
    }
    annotate(request, model=model, **timing)
    return timing


def server_timing_header(timing: dict[str, float]) -> str:
    """``{"queue_ms": 1.5, ...}`` -> ``"queue;dur=1.5, ..."`` (the ``Server-Timing`` syntax)."""
    return ", ".join(f"{k.removesuffix('_ms')};dur={v:g}" for k, v in timing.items())


def _engine_gauges(prefix: str, engine_stats: Mapping[str, Mapping[str, Any]]) -> list[str]:
    by_stat: dict[str, list[tuple[str, float]]] = defaultdict(list)
    for model, stats in engine_stats.items():
        for key, value in stats.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                continue
            by_stat[_metric_name(key)].append((model, float(value)))
    lines: list[str] = []
    for stat, values in sorted(by_stat.items()):
        full = f"{prefix}_engine_{stat}"
        lines += [f"# HELP {full} engine stat {stat}", f"# TYPE {full} gauge"]
        lines += [f'{full}{{model="{_escape(m)}"}} {v:g}' for m, v in values]
    return lines


class HTTPMetricsMiddleware:
    """Pure ASGI middleware: responses by modality, route template and status, errors, end-to-end
    latency (streaming-safe: measured until the body is complete)."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = {"code": 500}
        start = time.perf_counter()

        async def _send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            m = self.metrics
            path, modality = route_info(scope)
            code = str(status["code"])
            m.inc("http_requests_total", help="HTTP responses", modality=modality, path=path, status=code)
            if status["code"] >= 400:
                m.inc(
                    "http_request_errors_total", help="HTTP error responses", modality=modality, path=path, status=code
                )
            m.observe(
                "http_request_duration_seconds",
                time.perf_counter() - start,
                help="HTTP request latency, end to end",
                modality=modality,
                path=path,
            )
