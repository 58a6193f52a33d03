"""Result stores: where job outputs and uploaded batch files live.

- ``LocalStore``: a directory (default ``$MMSERVE_CACHE/results``, or ``--results-dir``); under
  celery the gateway and the workers must share it (one machine, or a shared mount).
- ``S3Store``: an S3-compatible bucket (``--results-s3-bucket``, ``--results-s3-endpoint`` for
  MinIO/Ceph/...; credentials from the usual AWS environment). ``boto3`` is imported only then.

Objects are addressed ``(job_id, name)``; ``put`` (bytes) and ``put_file`` (a file object, copied
in chunks) return the gateway URL that serves them, ``/v1/files/<file id>/content`` (the gateway
reads them back through the same store, so clients never need bucket credentials). Uploaded files
use the pseudo job id ``uploads``. ``entries()`` lists every object with its modification time, for
the retention sweep (``workers.jobs.upkeep.sweep``).
"""

from __future__ import annotations

import io
import mimetypes
import os
import re
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,199}$")
UPLOADS = "uploads"


def check_name(name: str) -> str:
    """A safe object name (no paths): letters, digits, ``._-``."""
    if not _NAME.match(name) or ".." in name:
        raise ValueError(f"invalid result name {name!r}: use letters, digits, '.', '_' and '-'")
    return name


def file_id(job_id: str, name: str) -> str:
    """The ``/v1/files`` id of a job output (uploads have their own ``file-<hex>`` ids)."""
    return name if job_id == UPLOADS else f"file-{job_id}--{name}"


def parse_file_id(fid: str) -> tuple[str, str]:
    """``(job_id, name)`` of a file id (``ValueError`` when it is not one of ours)."""
    if fid.startswith("file-") and "--" in fid:
        job_id, name = fid[5:].split("--", 1)
        return job_id, check_name(name)
    return UPLOADS, check_name(fid)


def file_url(job_id: str, name: str) -> str:
    return f"/v1/files/{file_id(job_id, name)}/content"


def _guess_type(name: str) -> str:
    if name.endswith(".jsonl"):
        return "application/jsonl"
    return mimetypes.guess_type(name)[0] or "application/octet-stream"


class LocalStore:
    """Files under ``root/<job_id>/<name>``."""

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, job_id: str, name: str) -> Path:
        return self.root / check_name(job_id) / check_name(name)

    def put(self, job_id: str, name: str, data: bytes, content_type: str) -> str:
        return self.put_file(job_id, name, io.BytesIO(data), content_type)

    def put_file(self, job_id: str, name: str, src: IO[bytes], content_type: str) -> str:
        """Like ``put``, copying ``src`` from its current position in chunks."""
        path = self._path(job_id, name)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        with tmp.open("wb") as out:
            shutil.copyfileobj(src, out, 1 << 20)
        tmp.replace(path)  # readers never see a half-written file
        return file_url(job_id, name)

    def get(self, job_id: str, name: str) -> tuple[bytes, str]:
        return self._path(job_id, name).read_bytes(), _guess_type(name)

    def delete(self, job_id: str, name: str) -> None:
        self._path(job_id, name).unlink(missing_ok=True)

    def delete_job(self, job_id: str) -> None:
        shutil.rmtree(self.root / check_name(job_id), ignore_errors=True)

    def entries(self) -> Iterator[tuple[str, str, float]]:
        """``(job_id, name, modified epoch seconds)`` of every file (half-written ones included)."""
        for job_dir in self.root.iterdir():
            if not job_dir.is_dir():
                continue
            for path in job_dir.iterdir():
                try:
                    yield job_dir.name, path.name, path.stat().st_mtime
                except FileNotFoundError:
                    continue  # deleted meanwhile

    def spec(self) -> dict[str, Any]:
        return {"type": "local", "root": str(self.root)}


class S3Store:
    """Objects ``<prefix><job_id>/<name>`` in an S3-compatible bucket."""

    def __init__(
        self, bucket: str, prefix: str = "mmserve/", endpoint_url: str | None = None, region: str | None = None
    ) -> None:
        import boto3  # optional dependency: only for S3 result stores

        self.bucket, self.prefix, self.endpoint_url, self.region = bucket, prefix, endpoint_url, region
        self.s3 = boto3.client("s3", endpoint_url=endpoint_url, region_name=region or "us-east-1")

    def _key(self, job_id: str, name: str) -> str:
        return f"{self.prefix}{check_name(job_id)}/{check_name(name)}"

    def put(self, job_id: str, name: str, data: bytes, content_type: str) -> str:
        self.s3.put_object(Bucket=self.bucket, Key=self._key(job_id, name), Body=data, ContentType=content_type)
        return file_url(job_id, name)

    def put_file(self, job_id: str, name: str, src: IO[bytes], content_type: str) -> str:
        """Like ``put``, streaming ``src`` (a multipart upload when it is large)."""
        key = self._key(job_id, name)
        self.s3.upload_fileobj(src, self.bucket, key, ExtraArgs={"ContentType": content_type})
        return file_url(job_id, name)

    def get(self, job_id: str, name: str) -> tuple[bytes, str]:
        try:
            obj = self.s3.get_object(Bucket=self.bucket, Key=self._key(job_id, name))
        except self.s3.exceptions.NoSuchKey as exc:
            raise FileNotFoundError(f"{job_id}/{name}") from exc
        return obj["Body"].read(), obj.get("ContentType") or _guess_type(name)

    def delete(self, job_id: str, name: str) -> None:
        self.s3.delete_object(Bucket=self.bucket, Key=self._key(job_id, name))

    def _objects(self, prefix: str) -> Iterator[dict[str, Any]]:
        for page in self.s3.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            yield from page.get("Contents", [])

    def delete_job(self, job_id: str) -> None:
        keys = [{"Key": obj["Key"]} for obj in self._objects(f"{self.prefix}{check_name(job_id)}/")]
        for i in range(0, len(keys), 1000):  # the most one request deletes
            self.s3.delete_objects(Bucket=self.bucket, Delete={"Objects": keys[i : i + 1000], "Quiet": True})

    def entries(self) -> Iterator[tuple[str, str, float]]:
        """``(job_id, name, modified epoch seconds)`` of every object under the prefix."""
        for obj in self._objects(self.prefix):
            job_id, _, name = obj["Key"][len(self.prefix) :].partition("/")
            if name:
                yield job_id, name, obj["LastModified"].timestamp()

    def spec(self) -> dict[str, Any]:
        return {
            "type": "s3",
            "bucket": self.bucket,
            "prefix": self.prefix,
            "endpoint_url": self.endpoint_url,
            "region": self.region,
        }


Store = LocalStore | S3Store


def default_results_dir() -> Path:
    cache = os.environ.get("MMSERVE_CACHE") or str(Path.home() / ".cache" / "mmserve")
    return Path(cache) / "results"


def make_store(spec: dict[str, Any] | None = None) -> Store:
    """A store from its ``spec()`` dict (``None``: the default local directory)."""
    spec = spec or {"type": "local", "root": str(default_results_dir())}
    if spec["type"] == "s3":
        return S3Store(spec["bucket"], spec.get("prefix") or "mmserve/", spec.get("endpoint_url"), spec.get("region"))
    return LocalStore(spec["root"])
