"""Batch/long-job plugin: the ``/v1/jobs``, ``/v1/files`` and ``/v1/batches`` routes and their options.

Jobs follow the gateway's ``--dispatch``: ``local`` runs them in the gateway process (state in
memory), ``celery`` on ``mmserve worker`` processes of each kind's modality (state in Redis at
``--redis-url``, queues under ``--prefix``). Finished jobs, their result files and uploaded files
are deleted after ``--jobs-ttl-h`` hours. ``POST /v1/files`` streams uploads of up to
``--files-max-mb`` to the result store (its own body limit, not the gateway's ``--max-body-mb``).
"""

from __future__ import annotations

import argparse
from typing import Any

from gateway.argtypes import at_least, directory, positive
from workers.jobs import api, batch, files  # noqa: F401 - batch and files add their routes to api.router
from workers.jobs.runner import JobsConfig

__all__ = ["add_serve_args", "body_limits", "config_from_args", "router"]

DEFAULT_FILES_MAX_MB = 200.0
DEFAULT_TTL_H = 24.0

router = api.router  # /v1/jobs, /v1/files, /v1/batches


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    g = parser.add_argument_group("jobs")
    g.add_argument(
        "--results-dir",
        type=directory,
        default=None,
        help="job result store directory (default $MMSERVE_CACHE/results)",
    )
    g.add_argument("--results-s3-bucket", default=None, help="store job results in this S3-compatible bucket")
    g.add_argument("--results-s3-endpoint", default=None, help="S3 endpoint URL (MinIO, Ceph, ...); default AWS")
    g.add_argument("--results-s3-prefix", default="mmserve/", help="key prefix inside the bucket")
    g.add_argument("--jobs-max-attempts", type=at_least(int, 1), default=3, help="attempts per job before it is failed")
    g.add_argument(
        "--jobs-lease-s", type=positive, default=30.0, help="a job whose worker is silent this long is retried"
    )
    g.add_argument(
        "--jobs-max-queued", type=at_least(int, 1), default=10_000, help="waiting jobs before submissions get 429"
    )
    g.add_argument(
        "--jobs-ttl-h",
        type=positive,
        default=DEFAULT_TTL_H,
        help="hours a finished job's record and result files, and an uploaded file, are kept (default 24)",
    )
    g.add_argument(
        "--files-max-mb",
        type=positive,
        default=DEFAULT_FILES_MAX_MB,
        help="largest POST /v1/files upload (default 200)",
    )


def body_limits(args: Any) -> dict[str, int]:
    """``POST /v1/files`` streams its body under ``--files-max-mb`` (gateway.plugins hook)."""
    mb = getattr(args, "files_max_mb", None) or DEFAULT_FILES_MAX_MB
    return {"POST /v1/files": int(mb * (1 << 20))}


def config_from_args(args: Any) -> JobsConfig:
    """The job settings for ``mmserve serve`` options (missing ones take the defaults)."""
    store = None
    if getattr(args, "results_s3_bucket", None):
        store = {
            "type": "s3",
            "bucket": args.results_s3_bucket,
            "prefix": args.results_s3_prefix,
            "endpoint_url": args.results_s3_endpoint,
            "region": None,
        }
    elif getattr(args, "results_dir", None):
        store = {"type": "local", "root": str(args.results_dir)}
    prefix = getattr(args, "prefix", None) or "mmserve"
    return JobsConfig(
        dispatch=getattr(args, "dispatch", "local") or "local",
        redis_url=getattr(args, "redis_url", None) or JobsConfig.redis_url,
        key_prefix=f"{prefix}:jobs",
        queue_prefix=prefix,
        store=store,
        max_attempts=getattr(args, "jobs_max_attempts", 3),
        lease_s=getattr(args, "jobs_lease_s", 30.0),
        max_queued=getattr(args, "jobs_max_queued", 10_000),
        result_ttl_s=(getattr(args, "jobs_ttl_h", None) or DEFAULT_TTL_H) * 3600.0,
    )
