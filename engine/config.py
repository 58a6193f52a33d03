"""Engine configuration: one dataclass, validated once."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_MAX_WAITING = 1024  # requests waiting to run past which add_request refuses (``--max-waiting``)


def default_batched_tokens(device: str) -> int:
    """A step's token budget where none is given. On a GPU a 2048-token step takes tens of ms. On
    a few CPU cores a step is compute-bound from a few dozen tokens and 2048 prefill tokens take
    5-10 s, while every running stream, and an abort (a barge-in), waits for the step under way;
    256 keeps a step under ~1 s and prefills as fast (docs/BENCHMARKS.md)."""
    return 256 if str(device).startswith("cpu") else 2048


def check_device(device: str) -> None:
    """Raise ``ValueError`` unless ``device`` is a CPU or a CUDA GPU this machine has."""
    import torch

    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"unknown device {device!r}: use cpu or cuda[:N]") from None
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"device {device!r} is not supported: use cpu or cuda[:N]")
    if dev.type == "cuda" and (dev.index or 0) >= torch.cuda.device_count():
        raise ValueError(f"device {device!r}: this machine (or torch build) has {torch.cuda.device_count()} CUDA GPUs")


@dataclass
class EngineConfig:
    model: str  # local HF directory, a .gguf file, or a name resolved by engine.model_loader
    dtype: str = "float32"  # fp32 on CPUs without bf16 units; "bfloat16"/"float16" on GPUs
    device: str = "cpu"
    block_size: int = 16
    kv_cache_memory_bytes: int = 2 << 30  # KV budget; blocks are preallocated from it
    num_kv_blocks: int | None = None  # overrides the budget (tests force preemption with it)
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None  # tokens per step; None: ``default_batched_tokens(device)``
    max_model_len: int | None = None  # defaults to the model's context length
    enable_chunked_prefill: bool = True
    enable_prefix_caching: bool = True
    scheduling_policy: str = "fcfs"  # "fcfs" or "priority" (lower value runs first)
    max_waiting: int = DEFAULT_MAX_WAITING  # admission bound: beyond it add_request raises QueueFullError
    attention_backend: str = "auto"  # "auto", "torch" (portable) or "native" (CPU C kernel)
    model_impl: str = "auto"  # "auto": lean Llama-family path where it applies; "hf": transformers modules
    cpu_linear: str = "auto"  # "auto"/"onednn": oneDNN matmuls for fp32 on CPU; "torch": plain F.linear
    # None: the weights as loaded (fp32); "int8": weight-only module swap; "gguf": a .gguf model's
    # own Q4_1/Q8_0 blocks for decode-sized batches (engine.gguf_blocks); "auto": "gguf" where
    # that applies (a .gguf model, fp32 on CPU, the lean Llama path), else None.
    quantization: str | None = None
    num_threads: int | None = None  # torch intra-op threads on CPU (None: all cores)
    # Before each step, wait up to this long while a foreground hold (a TTS first piece) runs on
    # the same CPU (engine.foreground); 0: never wait.
    foreground_wait_s: float = 0.0
    seed: int = 0

    def __post_init__(self) -> None:
        if self.block_size < 1 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.model_impl not in ("auto", "fast", "hf"):
            raise ValueError(f"model_impl must be 'auto', 'fast' or 'hf', got {self.model_impl!r}")
        if self.cpu_linear not in ("auto", "onednn", "torch"):
            raise ValueError(f"cpu_linear must be 'auto', 'onednn' or 'torch', got {self.cpu_linear!r}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = default_batched_tokens(self.device)
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ValueError("max_num_batched_tokens and max_num_seqs must be positive")
        if self.foreground_wait_s < 0:
            raise ValueError(f"foreground_wait_s must be >= 0, got {self.foreground_wait_s}")
        check_device(self.device)
        if self.quantization not in (None, "int8", "gguf", "auto"):
            raise ValueError(f"quantization must be None, 'int8', 'gguf' or 'auto', got {self.quantization!r}")
