"""Model loading: GGUF -> safetensors cache, tokenizer fidelity, tiny model generation."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import torch

from engine.model_loader import DEFAULT_LLM, gguf_parsed_once, load_model, resolve_model_path, smollm2_gguf_path
from engine.tiny_models import ARCHS, make_tiny

TEXTS = [
    "Hello, my name is",
    "héllo wörld 日本語 🤖\n\n  tabs\t end",
    "<|im_start|>user\nhi<|im_end|>\n",
    "def f(x):\n    return x ** 2  # squares",
]
EXPECTED_CLASS = {
    "llama": "LlamaForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
    "gemma": "GemmaForCausalLM",
    "mistral": "MistralForCausalLM",
    "phi3": "Phi3ForCausalLM",
}


@pytest.fixture(scope="module")
def smollm2(smollm2_dir: Path):
    return load_model(DEFAULT_LLM)


@pytest.fixture(scope="module")
def gguf_reference():
    """Model and tokenizer loaded straight from the GGUF file (dequantized by transformers; the
    file parsed once for both, as the conversion does)."""
    import gguf as gguf_py
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    kw = dict(gguf_file=gguf.name, local_files_only=True)
    with gguf_parsed_once():
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw).eval()
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, **kw)
        layers = model.config.num_hidden_layers  # (the shared name map is as a fresh one after the load)
        shared = gguf_py.get_tensor_name_map(gguf_py.MODEL_ARCH.LLAMA, layers).mapping
        assert shared == gguf_py.tensor_mapping.TensorNameMap(gguf_py.MODEL_ARCH.LLAMA, layers).mapping
    return model, tokenizer


def test_gguf_conversion_is_cached_and_reused(smollm2_dir: Path, smollm2) -> None:
    weights = smollm2_dir / "model.safetensors"
    assert weights.is_file() and (smollm2_dir / "config.json").is_file()
    mtime = weights.stat().st_mtime_ns
    assert resolve_model_path(DEFAULT_LLM) == smollm2_dir == smollm2.path
    assert weights.stat().st_mtime_ns == mtime  # not rewritten
    assert not list(smollm2_dir.parent.glob(f".{smollm2_dir.name}.*"))  # no temp dirs left behind
    config = (smollm2_dir / "config.json").read_text()
    assert "quantization_config" not in config


def test_gguf_parsed_once_shares_the_parse_then_restores_gguf(tmp_path: Path) -> None:
    import gguf
    import numpy as np

    path = tmp_path / "t.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("blk.0.attn_q.weight", np.arange(8, dtype=np.float32).reshape(2, 4))
    for write in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file):
        write()
    writer.close()
    real = gguf.GGUFReader, gguf.get_tensor_name_map
    with gguf_parsed_once():
        reader = gguf.GGUFReader(path)
        assert gguf.GGUFReader(str(path)) is reader
        assert gguf.GGUFReader(path, "c") is not reader  # (a writable map is its own)
        assert reader.tensors[0].data.tolist() == [[0, 1, 2, 3], [4, 5, 6, 7]]
        names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2)
        assert gguf.get_tensor_name_map(gguf.MODEL_ARCH.LLAMA, 2) is names
        assert names.get_name("model.layers.1.self_attn.q_proj") == "blk.1.attn_q"
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real
    with pytest.raises(RuntimeError), gguf_parsed_once():
        raise RuntimeError("a failed load")
    assert (gguf.GGUFReader, gguf.get_tensor_name_map) == real


def test_loaded_model_fields(smollm2) -> None:
    assert smollm2.name == "SmolLM2-135M-Instruct"
    assert smollm2.max_model_len == 8192
    assert type(smollm2.model).__name__ == "LlamaForCausalLM"
    assert not smollm2.model.training
    assert all(not p.requires_grad for p in smollm2.model.parameters())
    assert all(p.dtype == torch.float32 for p in smollm2.model.parameters())
    assert load_model(DEFAULT_LLM, max_model_len=1024).max_model_len == 1024


def test_cached_logits_match_gguf(smollm2, gguf_reference) -> None:
    ref_model, _ = gguf_reference
    ids = smollm2.tokenizer("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        ours = smollm2.model(ids).logits
        ref = ref_model(ids).logits
    torch.testing.assert_close(ours, ref, rtol=0, atol=0)
    out = smollm2.model.generate(ids, max_new_tokens=2, do_sample=False)
    assert smollm2.tokenizer.decode(out[0, ids.shape[1] :]).strip().startswith("Paris")


def test_tokenizer_matches_gguf_and_keeps_chat_template(smollm2, gguf_reference) -> None:
    _, ref_tok = gguf_reference
    tok = smollm2.tokenizer
    for text in TEXTS:
        assert tok(text).input_ids == ref_tok(text).input_ids, text
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.bos_token_id == 1 and tok.pad_token_id is not None
    assert smollm2.model.generation_config.eos_token_id == 2
    messages = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_bad_spec_raises(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "nope"))
    with pytest.raises(FileNotFoundError):
        resolve_model_path(str(tmp_path / "missing.gguf"))
    with pytest.raises(ValueError):
        load_model(DEFAULT_LLM, dtype="int3")


def test_bad_device_is_a_clear_error() -> None:
    """``--device`` / ``--asr-device``: a clear ValueError (one line at ``serve`` start), not
    torch's RuntimeError from deep inside loading."""
    from engine.config import EngineConfig
    from modalities.asr.model import load_whisper

    with pytest.raises(ValueError, match="unknown device"):
        EngineConfig(model="x", device="gpu0")
    with pytest.raises(ValueError, match="not supported"):
        EngineConfig(model="x", device="meta")
    missing = f"cuda:{torch.cuda.device_count()}"  # one past the last GPU, on any machine
    with pytest.raises(ValueError, match="CUDA GPUs"):
        EngineConfig(model="x", device=missing)
    with pytest.raises(ValueError, match="CUDA GPUs"):
        load_whisper(None, device=missing)


def _sha(path: Path) -> str:
    return hashlib.sha256((path / "model.safetensors").read_bytes()).hexdigest()


def test_make_tiny_is_deterministic(tmp_path: Path) -> None:
    a = make_tiny("qwen2", tmp_path / "a", seed=7)
    b = make_tiny("qwen2", tmp_path / "b", seed=7)
    c = make_tiny("qwen2", tmp_path / "c", seed=8)
    assert _sha(a) == _sha(b)
    assert _sha(a) != _sha(c)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", list(ARCHS))
def test_tiny_arch_loads_and_generates(arch: str, tiny_model_dir) -> None:
    loaded = load_model(str(tiny_model_dir(arch)))
    model, tok = loaded.model, loaded.tokenizer
    assert type(model).__name__ == EXPECTED_CLASS[arch]
    cfg = model.config
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.vocab_size) == (4, 2, 49152)
    assert cfg.hidden_size // cfg.num_attention_heads == 32
    assert loaded.max_model_len == 2048
    assert tok.chat_template and tok.eos_token_id == cfg.eos_token_id == 2
    ids = tok("Hello, my name is", return_tensors="pt").input_ids
    with torch.no_grad():
        top2 = model(ids).logits[0, -1].topk(2).values
    assert float(top2[0] - top2[1]) > 1e-3  # greedy argmax is not near-tied
    first = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    again = model.generate(ids, max_new_tokens=6, do_sample=False, min_new_tokens=6)
    assert first.shape == (1, ids.shape[1] + 6)
    assert torch.equal(first, again)
