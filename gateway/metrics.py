"""Minimal Prometheus text exposition: gateway counters/histograms plus engine ``stats()`` gauges."""

from __future__ import annotations

import math
import re
import threading
from collections import defaultdict
from collections.abc import Iterable, Mapping
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)

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
        self._help: dict[str, str] = {}

    def inc(self, name: str, value: float = 1.0, help: str = "", **labels: str) -> None:
        key = tuple(sorted(labels.items()))
        with self._lock:
            self._counters[name][key] += value
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

    def render(self, engine_stats: Mapping[str, Mapping[str, Any]] | None = None) -> str:
        """Prometheus text for the gateway metrics and, per model, the engine's numeric stats."""
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
        lines += _engine_gauges(p, engine_stats or {})
        return "\n".join(lines) + "\n"


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
    """Pure ASGI middleware counting responses by route path and status (streaming-safe)."""

    def __init__(self, app: ASGIApp, metrics: Metrics, paths: Iterable[str] | None = None) -> None:
        self.app = app
        self.metrics = metrics
        self.paths = set(paths) if paths is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        status = {"code": 500}

        async def _send(message: Message) -> None:
            if message["type"] == "http.response.start":
                status["code"] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, _send)
        finally:
            if self.paths is not None and path not in self.paths:
                path = "other"  # bound the label's cardinality (scanners, path parameters)
            self.metrics.inc(
                "http_requests_total", help="HTTP responses by path and status", path=path, status=str(status["code"])
            )
