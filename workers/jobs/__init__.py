"""Batch and long jobs: a registry of job kinds (``register_job_kind``), the ``/v1/jobs``,
``/v1/files`` and ``/v1/batches`` APIs, a local (in-process) and a Celery runner, and a result store.

Modalities only need ``register_job_kind`` and ``JobContext``; see ``workers.jobs.registry``.
"""

from workers.jobs.registry import (
    JobCancelled,
    JobContext,
    JobKind,
    ParamError,
    ProgressEvent,
    ResultStore,
    get_job_kind,
    job_kinds,
    parse_params,
    register_job_kind,
)

__all__ = [
    "JobCancelled",
    "JobContext",
    "JobKind",
    "ParamError",
    "ProgressEvent",
    "ResultStore",
    "get_job_kind",
    "job_kinds",
    "parse_params",
    "register_job_kind",
]
