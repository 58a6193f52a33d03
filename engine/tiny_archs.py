"""The families ``engine.tiny_models`` can make, as plain data: importing this module is cheap
(no torch), so the CLI can list them in ``mmserve --help`` and argument choices."""

from __future__ import annotations

# Per-family settings beyond tiny_models' common shape; tie_word_embeddings follows what the family's small models do.
ARCHS: dict[str, dict] = {
    "llama": dict(model_type="llama", tie_word_embeddings=False),
    "qwen2": dict(model_type="qwen2", tie_word_embeddings=True),  # q/k/v projections carry a bias
    "qwen3": dict(model_type="qwen3", tie_word_embeddings=True),  # RMSNorm on q and k per head
    "gemma": dict(model_type="gemma", tie_word_embeddings=True, hidden_activation="gelu_pytorch_tanh"),
    "mistral": dict(model_type="mistral", tie_word_embeddings=False, sliding_window=None, num_hidden_layers=3),
    "phi3": dict(model_type="phi3", tie_word_embeddings=False),  # fused qkv_proj / gate_up_proj
}
