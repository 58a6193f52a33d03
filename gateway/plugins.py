"""Modality plugins: how the gateway and the CLI find what each modality serves.

Each modality package may have a ``plugin`` module (``modalities/<name>/plugin.py``) with:

- ``router``: a FastAPI ``APIRouter`` with the modality's endpoints (mounted under auth);
- ``add_serve_args(parser)``: its ``mmserve serve`` / ``mmserve worker`` options;
- ``build(args, explicit) -> Built``: the engines it serves for ``args`` (``explicit`` is true when
  the user asked for this modality with ``--only``: it then serves a model or raises
  ``ValueError`` saying which option is missing; otherwise a plugin whose default model is
  missing may skip itself with a warning);
- optionally ``add_models_commands(subparsers)``: extra ``mmserve models`` subcommands;
- optionally ``body_limits(args) -> {"METHOD /path": bytes}``: routes that stream their request
  body under a limit of their own instead of the gateway's ``--max-body-mb`` (``args`` may be
  ``None``: the defaults);
- optionally ``TINY_ARCHS``: ``{arch: make(dir, seed) -> Path}`` for ``mmserve models make-tiny``;
- optionally ``async warm_up(engines)``: work run once the engines have started and before
  ``/ready`` says so (``mmserve serve --no-warmup`` skips it), so that the first requests do not
  pay for first use;
- optionally ``WORKER_OPTIONS``: the ``dest`` of its options that size or bound the engine where
  it runs: a ``--dispatch celery`` gateway warns that it ignores those it was given.

Adding a modality means writing its plugin module; no gateway file changes. Services that are
not modalities (batch jobs, speech pipelines) use the same hooks from ``EXTRA_PLUGINS``; they
usually have a router and no engines.
"""

from __future__ import annotations

import argparse
import functools
import importlib
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

MODALITIES = ("llm", "vlm", "asr", "tts", "diffusion", "embed")
EXTRA_PLUGINS = ("workers.jobs.plugin", "pipelines.plugin")


@dataclass
class Built:
    """What a plugin serves: served name -> engine, and extra accepted names -> served name."""

    engines: dict[str, Any] = field(default_factory=dict)
    aliases: dict[str, str] = field(default_factory=dict)

    def alias(self, names: Iterable[str | None], served: str) -> Built:
        """``self`` with each of ``names`` (``None``s and ``served`` itself skipped) accepted for
        ``served``, unless it already names something."""
        for name in names:
            if name and name != served:
                self.aliases.setdefault(name, served)
        return self


def load_plugins() -> dict[str, ModuleType]:
    """The plugin module of every modality that has one (``MODALITIES`` order), then the extras
    (keyed by module path)."""
    plugins: dict[str, ModuleType] = {}
    for key, module in [*((m, f"modalities.{m}.plugin") for m in MODALITIES), *((e, e) for e in EXTRA_PLUGINS)]:
        try:
            plugins[key] = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module.startswith(exc.name):
                raise
    return plugins


def add_serve_args(parser: argparse.ArgumentParser) -> None:
    for plugin in load_plugins().values():
        if hasattr(plugin, "add_serve_args"):
            plugin.add_serve_args(parser)


def servable() -> list[str]:
    """The modalities this build can serve (a plugin that builds engines)."""
    plugins = load_plugins()
    return [m for m in MODALITIES if hasattr(plugins.get(m), "build")]


def only_of(args: Any) -> set[str]:
    """The modalities ``--only`` names (a string or a list; empty: all)."""
    only_raw = getattr(args, "only", None)
    return {only_raw} if isinstance(only_raw, str) else set(only_raw or [])


def only_flag(args: Any) -> str:
    """The flag that chose the modalities, for errors: ``mmserve worker``'s, else ``serve``'s."""
    return "--modality" if getattr(args, "modality", None) else "--only"


def enabled(name: str, only: set[str]) -> bool:
    return not only or name in only


def build_all(args: Any) -> Built:
    """Engines of every enabled modality (``args.only`` restricts them), names made unique."""
    only = only_of(args)
    served = servable()
    missing = sorted(only - set(served))
    if missing:
        raise ValueError(
            f"{only_flag(args)} {','.join(missing)}: not served by this build (served: {', '.join(served)})"
        )
    out = Built()
    for name, plugin in load_plugins().items():
        if not enabled(name, only) or not hasattr(plugin, "build"):
            continue
        built: Built = plugin.build(args, explicit=name in only)
        for served, engine in built.engines.items():
            if served in out.engines:
                raise ValueError(f"two engines are served as {served!r}; rename one (--served-model-name)")
            out.engines[served] = engine
        for alias, served in built.aliases.items():
            if alias not in out.engines:
                out.aliases.setdefault(alias, served)
    return out


def body_limits(args: Any) -> dict[str, int]:
    """The per-route request-body limits the plugins declare (``gateway.limits``)."""
    out: dict[str, int] = {}
    for plugin in load_plugins().values():
        if hasattr(plugin, "body_limits"):
            out.update(plugin.body_limits(args))
    return out


def routers() -> list[Any]:
    return [p.router for p in load_plugins().values() if hasattr(p, "router")]


def warm_ups() -> list[Callable[[dict[str, Any]], Awaitable[Any]]]:
    return [p.warm_up for p in load_plugins().values() if hasattr(p, "warm_up")]


def worker_options_given(args: Any) -> list[str]:
    """The enabled plugins' ``WORKER_OPTIONS`` that ``args`` sets to other than ``mmserve serve``'s
    defaults, as flags."""
    from gateway.cli import build_parser

    defaults = build_parser().parse_args(["serve"])
    only = only_of(args)
    given = []
    for name, plugin in load_plugins().items():
        if enabled(name, only):
            for dest in getattr(plugin, "WORKER_OPTIONS", ()):
                if getattr(args, dest, None) != getattr(defaults, dest, None):
                    given.append("--" + dest.replace("_", "-"))
    return given


def tiny_archs() -> dict[str, Any]:
    """Every ``make-tiny`` architecture and its maker, ``(dir, seed) -> path``: the engine's LLM
    archs first, then those plugins contribute."""
    from engine.tiny_archs import ARCHS

    archs: dict[str, Any] = {arch: functools.partial(_make_tiny_llm, arch) for arch in ARCHS}
    for plugin in load_plugins().values():
        archs.update(getattr(plugin, "TINY_ARCHS", {}))
    return archs


def _make_tiny_llm(arch: str, out_dir: str, seed: int) -> Any:
    from engine.tiny_models import make_tiny  # (torch and transformers: only when one is made)

    return make_tiny(arch, out_dir, seed=seed)
