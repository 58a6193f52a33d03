"""argparse types for the command line's values (numbers, ports, keys, URLs, directories): a bad
value is a usage error naming its flag (``argument --port: must be 0-65535, got 73676``) before
anything loads, not a server that starts and then hangs, refuses every request, or listens
elsewhere."""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from pathlib import Path


def at_least(kind: type[int] | type[float], low: float) -> Callable[[str], float]:
    """A finite number of ``kind`` >= ``low``."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not a {'whole ' if kind is int else ''}number: {text!r}") from None
        if not math.isfinite(value) or value < low:
            raise argparse.ArgumentTypeError(f"must be {low:g} or more, got {text}")
        return value

    return parse


def count_or_unbounded(text: str) -> int | None:
    """A ``--*-max-requests`` / ``--max-waiting`` value: a count, or 0 for no bound (``None``)."""
    try:
        return int(at_least(int, 0)(text)) or None
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{exc} (0: no bound)") from None


def positive(text: str) -> float:
    """A finite number > 0."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be a number more than 0, got {text}")
    return value


def port(text: str) -> int:
    value = int(at_least(int, 0)(text))
    if value > 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {text}")
    return value


def api_key(text: str) -> str:
    """A key clients can send: not empty, no spaces (an empty one would turn authentication off)."""
    if not text or text != text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError("must be a non-empty key without spaces")
    return text


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def log_level(text: str) -> str:
    if text.lower() not in LOG_LEVELS:
        raise argparse.ArgumentTypeError(f"choose from {', '.join(LOG_LEVELS)}, got {text!r}")
    return text.lower()


def new_output_dir(path: str | Path, *sources: str | Path) -> Path:
    """``path`` for a command to write a model into: new or an empty directory, and none of
    ``sources`` (writing into a model would mix two models' files, or overwrite the source)."""
    out = Path(path)
    if any(out.resolve() == Path(src).resolve() for src in sources):
        raise ValueError(f"{path} is the source too: give another output directory")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ValueError(f"{path} exists and is not an empty directory: give a new one")
    return out


def directory(text: str) -> str:
    """A directory to write into: one, or a path to make one at (not a file)."""
    if Path(text).exists() and not Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is not a directory")
    return text


def redis_url(text: str) -> str:
    if text.partition("://")[0] not in ("redis", "rediss", "unix") or "://" not in text:
        raise argparse.ArgumentTypeError(f"a redis://, rediss:// or unix:// URL, got {text!r}")
    return text


def counts(text: str) -> str:
    """A comma list of whole numbers >= 1 (e.g. a benchmark's concurrency levels), kept as given."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items or not all(t.isdigit() and int(t) >= 1 for t in items):
        raise argparse.ArgumentTypeError(f"a comma list of whole numbers >= 1, got {text!r}")
    return text


def output_file(text: str) -> Path:
    """A file to write results to (checked before the work that fills it: not a directory)."""
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text} is a directory: name a file")
    return Path(text)
