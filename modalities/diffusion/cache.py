"""Step caching for diffusion denoisers: first-block cache (DiT / video transformers) and DeepCache (UNets).

- **First-block cache** (ParaAttention's FBCache, the dynamic cousin of TeaCache): every step runs
  the first transformer block; when its residual changed by less than ``threshold`` (relative mean
  absolute difference) since the last full step, the remaining blocks are skipped and their cached
  residual is added instead. diffusers has it (``apply_first_block_cache``) but decides for the
  whole batch at once; ``fbcache.py`` is the same algorithm as diffusers hooks, deciding per request,
  so batched requests keep their solo outputs.
- **DeepCache** is not in diffusers, so it is written here as a diffusers ``ModelHook``
  (:class:`DeepCacheConfig`): every ``interval`` steps the UNet runs fully and each deep module
  (down blocks after the first, the mid block, up blocks before the last) stores its output; on the
  steps in between those modules return their stored output without computing, and only the
  shallow branch (``conv_in``, the first down block, the last up block, ``conv_out``) runs on the
  fresh input, with the current skip connections. Its schedule depends only on the step index, so
  batching is exact too.

:class:`BlockCounter` counts, per denoiser block, how many calls ran its body versus how many
were answered from a cache; tests and ``stats()`` use it to show that caching skipped work.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from engine.errors import InvalidParamError

# name -> (first-block threshold, DeepCache interval): what "light/medium/aggressive" mean per family.
PRESETS: dict[str, tuple[float, int]] = {"light": (0.05, 2), "medium": (0.1, 3), "aggressive": (0.2, 5)}
MAX_INTERVAL = 50


@dataclass(frozen=True)
class CacheSpec:
    """A resolved cache setting: ``kind`` is ``off``, ``fbc`` (first-block, ``threshold``) or
    ``deepcache`` (``interval``). Hashable: part of the batching key."""

    kind: str = "off"
    threshold: float = 0.0
    interval: int = 0

    @property
    def label(self) -> str:
        if self.kind == "fbc":
            return f"fbc@{self.threshold:g}"
        if self.kind == "deepcache":
            return f"deepcache/{self.interval}"
        return "off"


OFF = CacheSpec()


def resolve_cache(value: str | float | None, *, unet: bool, interval: int | None = None) -> CacheSpec:
    """Turn a request's ``cache`` (``None``/``"off"``, a preset name, or a first-block threshold) and
    ``interval`` (DeepCache steps between full passes) into a :class:`CacheSpec` for a UNet
    (``unet=True``) or a transformer denoiser. Raises ``ValueError`` (a 400) on nonsense."""
    if interval is not None:
        if not unet:
            raise InvalidParamError(
                "cache_interval applies to UNet models (DeepCache); use a cache threshold here", "cache_interval"
            )
        if not 1 <= interval <= MAX_INTERVAL:
            raise InvalidParamError(f"cache_interval must be between 1 and {MAX_INTERVAL}", "cache_interval")
        return OFF if interval == 1 else CacheSpec("deepcache", interval=interval)
    if value is None or value == "off" or value == 0:
        return OFF
    if isinstance(value, str):
        try:
            value = float(value)
        except ValueError:
            if value not in PRESETS:
                raise InvalidParamError(
                    f"unknown cache preset {value!r}; use off, {', '.join(PRESETS)} or a threshold", "cache"
                ) from None
            threshold, steps = PRESETS[value]
            return CacheSpec("deepcache", interval=steps) if unet else CacheSpec("fbc", threshold=threshold)
    if unet:
        raise InvalidParamError(
            "UNet models use DeepCache: give a preset name or cache_interval, not a threshold", "cache"
        )
    if not 0 < value <= 10:
        raise InvalidParamError("a cache threshold must be in (0, 10]", "cache")
    return CacheSpec("fbc", threshold=float(value))


# -- DeepCache ------------------------------------------------------------------------------------


@dataclass
class DeepCacheConfig:
    """DeepCache for ``UNet2DConditionModel``: a full pass every ``interval`` calls (the first
    call of a generation is always full), cached deep features in between."""

    interval: int = 3


class _DeepCacheState:
    def __init__(self) -> None:
        self.calls = 0
        self.outputs: dict[int, Any] = {}

    def reset(self) -> None:
        self.calls = 0
        self.outputs.clear()


def _deepcache_hooks() -> tuple[type, type]:
    from diffusers.hooks import ModelHook

    class Counter(ModelHook):
        """On the UNet itself: advances the step counter before each forward."""

        _is_stateful = True

        def __init__(self, state: _DeepCacheState) -> None:
            super().__init__()
            self.state = state

        def pre_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> tuple[Any, Any]:
            self.state.calls += 1
            return args, kwargs

        def reset_state(self, module: torch.nn.Module) -> torch.nn.Module:
            self.state.reset()
            return module

    class Deep(ModelHook):
        """On each deep module: compute and remember on full steps, replay on cached steps."""

        def __init__(self, state: _DeepCacheState, key: int, interval: int) -> None:
            super().__init__()
            self.state, self.key, self.interval = state, key, interval

        def new_forward(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
            full = (self.state.calls - 1) % self.interval == 0 or self.key not in self.state.outputs
            if full:
                self.state.outputs[self.key] = self.fn_ref.original_forward(*args, **kwargs)
            return self.state.outputs[self.key]

    return Counter, Deep


_DEEPCACHE_ROOT = "mmserve_deepcache_root"
_DEEPCACHE_BLOCK = "mmserve_deepcache_block"


def deep_modules(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules DeepCache skips: down blocks after the first, the mid block, up blocks before the last."""
    mods = [*list(unet.down_blocks)[1:], *([unet.mid_block] if unet.mid_block is not None else [])]
    return [*mods, *list(unet.up_blocks)[:-1]]


def apply_deepcache(unet: torch.nn.Module, config: DeepCacheConfig) -> None:
    from diffusers.hooks import HookRegistry

    counter_cls, deep_cls = _deepcache_hooks()
    state = _DeepCacheState()
    HookRegistry.check_if_exists_or_initialize(unet).register_hook(counter_cls(state), _DEEPCACHE_ROOT)
    for key, mod in enumerate(deep_modules(unet)):
        HookRegistry.check_if_exists_or_initialize(mod).register_hook(
            deep_cls(state, key, config.interval), _DEEPCACHE_BLOCK
        )


def remove_deepcache(unet: torch.nn.Module) -> None:
    from diffusers.hooks import HookRegistry

    registry = HookRegistry.check_if_exists_or_initialize(unet)
    registry.remove_hook(_DEEPCACHE_ROOT, recurse=False)
    for mod in deep_modules(unet):
        HookRegistry.check_if_exists_or_initialize(mod).remove_hook(_DEEPCACHE_BLOCK, recurse=False)


# -- applying a spec to a denoiser -----------------------------------------------------------------


class CacheSwitch:
    """Keeps one denoiser's hooks matching the :class:`CacheSpec` of the batch about to run."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        self.denoiser = denoiser
        self.unet = hasattr(denoiser, "up_blocks") and hasattr(denoiser, "down_blocks")
        self.current = OFF
        self.fbc: Any = None
        # context parallelism: an all-reduce sum over the ranks, so first-block decisions agree
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def set(self, spec: CacheSpec, requests: int = 1) -> None:
        """Install ``spec`` (removing the previous one) and reset the cache state for a new
        generation of ``requests`` outputs."""
        from diffusers.hooks import HookRegistry

        from modalities.diffusion.fbcache import BatchFBCConfig, apply_batch_fbc, remove_batch_fbc

        registry = HookRegistry.check_if_exists_or_initialize(self.denoiser)
        if spec != self.current:
            if self.current.kind == "fbc":
                remove_batch_fbc(self.denoiser)
            elif self.current.kind == "deepcache":
                remove_deepcache(self.denoiser)
            self.current = OFF
            if spec.kind == "fbc":
                self.fbc = BatchFBCConfig(threshold=spec.threshold, reduce=self.reduce)
                apply_batch_fbc(self.denoiser, self.fbc)
            elif spec.kind == "deepcache":
                apply_deepcache(self.denoiser, DeepCacheConfig(interval=spec.interval))
            registry.invalidate_child_registries_cache()
            self.current = spec
        if spec.kind == "fbc":
            self.fbc.requests = requests
        if spec.kind != "off":
            registry.reset_stateful_hooks(recurse=True)

    @contextlib.contextmanager
    def context(self) -> Iterator[None]:
        """A cache context around a whole pipeline call: pipelines that name their own (Wan's
        cond/uncond) override it per call; others (PixArt: one joint CFG batch per step) use this one."""
        if self.current.kind != "fbc":
            yield
            return
        from diffusers.hooks.hooks import CacheContext, _set_cache_context

        _set_cache_context(self.denoiser, CacheContext("default"))
        try:
            yield
        finally:
            _set_cache_context(self.denoiser, None)


def denoiser_blocks(denoiser: torch.nn.Module) -> list[torch.nn.Module]:
    """The blocks whose work caching saves: a UNet's DeepCache modules, a transformer's blocks."""
    if hasattr(denoiser, "up_blocks") and hasattr(denoiser, "down_blocks"):
        return deep_modules(denoiser)
    from diffusers.hooks._common import _ALL_TRANSFORMER_BLOCK_IDENTIFIERS

    return [
        block
        for name, child in denoiser.named_children()
        if name in _ALL_TRANSFORMER_BLOCK_IDENTIFIERS and isinstance(child, torch.nn.ModuleList)
        for block in child
    ]


class BlockCounter:
    """Counts block calls and block bodies run, with plain torch hooks: a block's own pre-hook
    fires on every call (cached or not), while the pre-hook on its first parameterised child
    fires only when the body really runs. ``skipped = calls - run``."""

    def __init__(self, denoiser: torch.nn.Module) -> None:
        self.calls = 0
        self.run = 0
        self._handles = []
        for block in denoiser_blocks(denoiser):
            inner = next(m for m in block.modules() if m is not block and any(True for _ in m.parameters(False)))
            self._handles.append(block.register_forward_pre_hook(self._on_call))
            self._handles.append(inner.register_forward_pre_hook(self._on_run))

    def _on_call(self, *_: Any) -> None:
        self.calls += 1

    def _on_run(self, *_: Any) -> None:
        self.run += 1

    @property
    def skipped(self) -> int:
        return self.calls - self.run
