"""Context (sequence) parallelism for diffusion transformers. API documented in the full version below."""
