"""Context (sequence) parallelism for diffusion transformers (DiT image and video models).

One request runs across ``N`` processes: each holds the whole model and ``1/N`` of the image/video
token sequence. Attention is the only operation that mixes tokens; it becomes

- **Ulysses**: an all-to-all turns "my tokens, all heads" into "all tokens, my heads", attention runs
  locally, and a second all-to-all turns it back (needs heads divisible by the degree);
- **ring**: queries stay put, keys/values travel ``N - 1`` hops round a ring, and partial results are
  merged with an online softmax (log-sum-exp), exactly;
- **hybrid**: Ulysses inside groups of 2 ranks, ring across groups.

How (diffusers-style, the model code is untouched): a declarative per-model :class:`~.plans.CPPlan`
says which module inputs/outputs to split along which dimension on entry, what to all-gather on exit,
and which attention modules are sequence-sharded; :func:`~.hooks.apply_context_parallel` installs
forward hooks for it and routes those modules' ``scaled_dot_product_attention`` calls through the
sharded attention. Plans exist for PixArt, SD3, Flux and Wan transformers. diffusers' own
``enable_parallelism(ContextParallelConfig(...))`` was tried first: in the installed version it needs
an accelerator (``rank % torch.accelerator.device_count()`` divides by zero on CPU) and has no plan
for PixArt, hence this implementation, which runs on gloo (CPU) and NCCL (GPU).

Every collective is counted (:class:`~.comm.CommCounter`); :mod:`.volume` gives the analytic bytes
per forward, and the runner checks the two agree.

API for the diffusion engine::

    from modalities.diffusion.parallel import ContextParallelRunner

    runner = ContextParallelRunner(pipeline_dir, degree=2, mode="ulysses")  # or "ring" / "hybrid"
    runner.start()                                  # spawn + load on every rank (optional: lazy)
    frames = runner.generate(shape, items, on_step)  # same contract as DiffusionModel.generate
    runner.last_stats["bytes_per_step"]             # measured (== "expected_bytes_per_step")
    runner.close()

``generate`` raises ``ValueError`` (a 400) for sizes whose token count the degree does not divide,
before any compute. First-block caching combines with CP: each rank measures the first block's
residual change on its shard and an all-reduce makes the decision global, so all ranks skip the
same steps as one process would (``modalities.diffusion.fbcache``).

Serving: ``mmserve serve/worker --cp-degree N [--cp-mode ...]`` calls
:func:`~.serving.enable_context_parallel` on each DiT ``DiffusionEngine``: the engine keeps its local
model for validation and previews and runs batches through a :class:`~.serving.ContextParallelModel`.
"""

from modalities.diffusion.parallel.comm import CommCounter, ContextParallelConfig, CPGroups
from modalities.diffusion.parallel.hooks import CPHandle, apply_context_parallel
from modalities.diffusion.parallel.plans import PLANS, CPPlan, Split
from modalities.diffusion.parallel.runner import ContextParallelRunner
from modalities.diffusion.parallel.volume import ForwardShape, bytes_per_forward

__all__ = [
    "PLANS",
    "CPGroups",
    "CPHandle",
    "CPPlan",
    "CommCounter",
    "ContextParallelConfig",
    "ContextParallelRunner",
    "ForwardShape",
    "Split",
    "apply_context_parallel",
    "bytes_per_forward",
]
