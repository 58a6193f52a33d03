"""Declarative context-parallel plans: where a model's token sequence is split and gathered.

A plan names modules by their path in the model (``""`` is the model itself, ``*`` matches one path
component) and says, like diffusers' ``_cp_plan``:

- ``split_inputs``: forward arguments (by parameter name) to split before the module runs;
- ``split_outputs``: outputs (tuple index, or ``None`` for a single tensor) to split after it runs;
- ``gather_outputs``: outputs to all-gather (``None`` or index -> :class:`Split`) after it runs;
- ``sharded_attention``: attention modules whose queries, keys *and* values are all sequence-sharded
  (self-attention, or joint text+image attention when the text is split too); their SDPA call becomes
  Ulysses/ring attention. Attention not listed (cross-attention to replicated text) runs locally.

Everything between the splits and the gathers must be token-wise (linear layers, norms, MLPs,
per-sample modulation) or one of the sharded attentions; the model code is not changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class Split:
    """Split or gather along ``dim``; ``expected_dims`` guards against a wrong layout (error), unless
    ``optional``, in which case a tensor of another rank is passed through unchanged (e.g. Wan's
    timestep, per-sample in 2.1 but per-token in 2.2)."""

    dim: int
    expected_dims: int | None = None
    optional: bool = False


@dataclass(frozen=True)
class CPPlan:
    split_inputs: dict[str, dict[str, Split]] = field(default_factory=dict)
    split_outputs: dict[str, dict[int | None, Split]] = field(default_factory=dict)
    gather_outputs: dict[str, dict[int | None, Split]] = field(default_factory=dict)
    sharded_attention: tuple[str, ...] = ()


_SEQ = Split(1, 3)  # (batch, tokens, channels)

# PixArt-alpha/sigma: patch embedding (with positional embedding) -> blocks (self-attn, cross-attn to
# text) -> per-sample modulation -> proj_out -> unpatchify (needs every token: gather before it).
PIXART = CPPlan(
    split_outputs={"pos_embed": {None: _SEQ}},
    gather_outputs={"proj_out": {None: _SEQ}},
    sharded_attention=("transformer_blocks.*.attn1",),
)

# SD3/SD3.5 (MMDiT): joint attention over text + image, so both streams are split (the text length
# must be divisible by the degree); attn2 is SD3.5's extra image self-attention.
SD3 = CPPlan(
    split_outputs={"pos_embed": {None: _SEQ}, "context_embedder": {None: _SEQ}},
    gather_outputs={"proj_out": {None: _SEQ}},
    sharded_attention=("transformer_blocks.*.attn", "transformer_blocks.*.attn2"),
)

# Flux.1: packed latents come in as tokens; RoPE ids are split with them.
FLUX = CPPlan(
    split_inputs={
        "": {
            "hidden_states": _SEQ,
            "encoder_hidden_states": _SEQ,
            "img_ids": Split(0, 2),
            "txt_ids": Split(0, 2),
        }
    },
    gather_outputs={"proj_out": {None: _SEQ}},
    sharded_attention=("transformer_blocks.*.attn", "single_transformer_blocks.*.attn"),
)

# Wan 2.1/2.2: RoPE tables (1, tokens, 1, dim) and the patchified video tokens are split at the first
# block; text is cross-attention (replicated).
WAN = CPPlan(
    split_inputs={"blocks.0": {"hidden_states": _SEQ}, "": {"timestep": Split(1, 2, optional=True)}},
    split_outputs={"rope": {0: Split(1, 4), 1: Split(1, 4)}},
    gather_outputs={"proj_out": {None: _SEQ}},
    sharded_attention=("blocks.*.attn1",),
)

PLANS: dict[str, CPPlan] = {
    "PixArtTransformer2DModel": PIXART,
    "SD3Transformer2DModel": SD3,
    "FluxTransformer2DModel": FLUX,
    "WanTransformer3DModel": WAN,
}


def plan_for(model: object) -> CPPlan:
    name = type(model).__name__
    if name not in PLANS:
        raise ValueError(f"no context-parallel plan for {name}; supported: {', '.join(sorted(PLANS))}")
    return PLANS[name]
