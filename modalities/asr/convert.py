"""CTranslate2 Whisper (``model.bin`` + ``config.json`` + ``tokenizer.json``) → a transformers
``WhisperForConditionalGeneration`` directory, without the ``ctranslate2`` package.

``model.bin`` layout (binary version >= 2, all little-endian)::

    u32 version | str spec_name | u32 spec_revision | u32 num_variables
    num_variables x ( str name | u8 rank | u32 dims[rank] | u8 dtype | u32 nbytes | bytes )
    u32 num_aliases | num_aliases x ( str alias | str target )

where ``str`` is ``u16 length`` (including a trailing NUL) then the bytes. CTranslate2 fuses the
q/k/v projections of self-attention (``linear_0`` = [q; k; v]) and k/v of cross-attention
(``linear_1`` = [k; v]); Whisper's k projections have no bias, so CT2 stores zeros there.
"""

from __future__ import annotations

import json
import shutil
import struct
from pathlib import Path
from typing import BinaryIO

import numpy as np

# CTranslate2's DataType enum order.
_DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
_BF16 = 5


def _read(f: BinaryIO, fmt: str) -> int:
    size = struct.calcsize("<" + fmt)
    return struct.unpack("<" + fmt, f.read(size))[0]


def _read_str(f: BinaryIO) -> str:
    return f.read(_read(f, "H"))[:-1].decode()


def _to_array(raw: bytes, dtype_id: int, dims: list[int]) -> np.ndarray:
    if dtype_id == _BF16:  # numpy has no bfloat16: widen the 16 bits into fp32's top half
        arr = (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32)
    elif dtype_id in _DTYPES:
        arr = np.frombuffer(raw, dtype=np.dtype(_DTYPES[dtype_id]).newbyteorder("<"))
    else:
        raise ValueError(f"unknown CTranslate2 dtype id {dtype_id}")
    return arr.reshape(dims) if dims else arr.reshape(())


def read_ct2_model(path: str | Path) -> tuple[str, dict[str, np.ndarray]]:
    """Parse a CTranslate2 ``model.bin``: (spec name, {variable name: array}), aliases resolved.
    int8/int16 weights are dequantized with their ``weight_scale``."""
    with open(path, "rb") as f:
        version = _read(f, "I")
        if version < 2 or version > 6:
            raise ValueError(f"unsupported CTranslate2 binary version {version}")
        spec = _read_str(f)
        _read(f, "I")  # spec revision
        variables: dict[str, np.ndarray] = {}
        for _ in range(_read(f, "I")):
            name = _read_str(f)
            dims = [_read(f, "I") for _ in range(_read(f, "B"))]
            if version >= 4:
                dtype_id, nbytes = _read(f, "B"), _read(f, "I")
            else:  # older files store the item size instead of a dtype id
                item = _read(f, "B")
                nbytes = _read(f, "I") * item
                dtype_id = {4: 0, 2: 4, 1: 1}[item]
            variables[name] = _to_array(f.read(nbytes), dtype_id, dims)
        tail = f.read(4)
        for _ in range(struct.unpack("<I", tail)[0] if len(tail) == 4 else 0):
            alias, target = _read_str(f), _read_str(f)
            variables[alias] = variables[target]
    for name in [n for n in variables if n.endswith("/weight_scale")]:
        base = name[: -len("_scale")]
        scale = variables.pop(name).astype(np.float32)
        w = variables[base]
        if w.dtype in (np.int8, np.int16):
            variables[base] = w.astype(np.float32) / scale.reshape(-1, *([1] * (w.ndim - 1)))
    return spec, variables


def _model_bin(src: Path, parts: list[Path], scratch: Path) -> Path:
    """``src/model.bin``, or the split parts (``model.bin.part1``, ``.part2``, ... found in ``src``
    plus ``parts`` given explicitly, in part order) concatenated into ``scratch``."""
    whole = src / "model.bin"
    if whole.is_file() and not parts:
        return whole
    found = sorted({*src.glob("model.bin.part*"), *parts}, key=lambda p: int("0" + p.name.rsplit("part", 1)[-1]))
    if not found:
        raise FileNotFoundError(f"no model.bin (or model.bin.partN) in {src}")
    with open(scratch, "wb") as out:
        for part in found:
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 16 << 20)
    return scratch


def _f32(a: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(a.astype(np.float32))


def _map_layer(v: dict[str, np.ndarray], src: str, dst: str, cross: bool, out: dict[str, np.ndarray]) -> None:
    """One encoder/decoder layer's weights, fused projections split back."""

    def ln(ct2: str, hf: str) -> None:
        out[f"{dst}.{hf}.weight"], out[f"{dst}.{hf}.bias"] = _f32(v[f"{src}/{ct2}/gamma"]), _f32(v[f"{src}/{ct2}/beta"])

    def lin(ct2: str, hf: str, bias: bool = True) -> None:
        out[f"{dst}.{hf}.weight"] = _f32(v[f"{src}/{ct2}/weight"])
        if bias:
            out[f"{dst}.{hf}.bias"] = _f32(v[f"{src}/{ct2}/bias"])

    ln("self_attention/layer_norm", "self_attn_layer_norm")
    qkv_w, qkv_b = v[f"{src}/self_attention/linear_0/weight"], v[f"{src}/self_attention/linear_0/bias"]
    for (w, b), name in zip(
        zip(np.split(qkv_w, 3), np.split(qkv_b, 3), strict=True), ("q_proj", "k_proj", "v_proj"), strict=True
    ):
        out[f"{dst}.self_attn.{name}.weight"] = _f32(w)
        if name != "k_proj":
            out[f"{dst}.self_attn.{name}.bias"] = _f32(b)
    lin("self_attention/linear_1", "self_attn.out_proj")
    if cross:
        ln("attention/layer_norm", "encoder_attn_layer_norm")
        lin("attention/linear_0", "encoder_attn.q_proj")
        kv_w, kv_b = v[f"{src}/attention/linear_1/weight"], v[f"{src}/attention/linear_1/bias"]
        k_w, v_w = np.split(kv_w, 2)
        out[f"{dst}.encoder_attn.k_proj.weight"] = _f32(k_w)
        out[f"{dst}.encoder_attn.v_proj.weight"] = _f32(v_w)
        out[f"{dst}.encoder_attn.v_proj.bias"] = _f32(np.split(kv_b, 2)[1])
        lin("attention/linear_2", "encoder_attn.out_proj")
    ln("ffn/layer_norm", "final_layer_norm")
    lin("ffn/linear_0", "fc1")
    lin("ffn/linear_1", "fc2")


def convert_whisper_ct2(src: str | Path, dst: str | Path, parts: list[Path] | None = None) -> Path:
    """Write a transformers Whisper directory (safetensors, config, generation config, tokenizer,
    feature extractor) to ``dst`` from the CTranslate2 model directory ``src`` (``parts``: extra
    ``model.bin.partN`` files living elsewhere, e.g. in a second package)."""
    import torch
    from transformers import WhisperConfig, WhisperFeatureExtractor, WhisperForConditionalGeneration

    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    scratch = dst / "model.bin.joined"
    try:
        spec, v = read_ct2_model(_model_bin(src, [Path(p) for p in parts or []], scratch))
    finally:
        scratch.unlink(missing_ok=True)
    if spec != "WhisperSpec":
        raise ValueError(f"{src} holds a {spec}, not a Whisper model")
    ct2_cfg = json.loads((src / "config.json").read_text()) if (src / "config.json").is_file() else {}
    tok = json.loads((src / "tokenizer.json").read_text())
    token_id = {t["content"]: t["id"] for t in tok["added_tokens"]}

    vocab, d_model = v["decoder/embeddings/weight"].shape
    n_enc = len({k.split("/")[1] for k in v if k.startswith("encoder/layer_") and k[14:15].isdigit()})
    n_dec = len({k.split("/")[1] for k in v if k.startswith("decoder/layer_") and k[14:15].isdigit()})
    heads_enc, heads_dec = int(v["encoder/num_heads"]), int(v["decoder/num_heads"])
    multilingual = vocab >= 51865
    eot = token_id["<|endoftext|>"]
    config = WhisperConfig(
        vocab_size=int(vocab),
        num_mel_bins=int(v["encoder/conv1/weight"].shape[1]),
        d_model=int(d_model),
        encoder_layers=n_enc,
        decoder_layers=n_dec,
        encoder_attention_heads=heads_enc,
        decoder_attention_heads=heads_dec,
        encoder_ffn_dim=int(v["encoder/layer_0/ffn/linear_0/weight"].shape[0]),
        decoder_ffn_dim=int(v["decoder/layer_0/ffn/linear_0/weight"].shape[0]),
        max_source_positions=int(v["encoder/position_encodings/encodings"].shape[0]),
        max_target_positions=int(v["decoder/position_encodings/encodings"].shape[0]),
        decoder_start_token_id=token_id["<|startoftranscript|>"],
        bos_token_id=eot,
        eos_token_id=eot,
        pad_token_id=eot,
        suppress_tokens=ct2_cfg.get("suppress_ids", []),
        begin_suppress_tokens=ct2_cfg.get("suppress_ids_begin", [220, eot]),
        tie_word_embeddings=True,
    )
    sd: dict[str, np.ndarray] = {
        "model.encoder.conv1.weight": _f32(v["encoder/conv1/weight"]),
        "model.encoder.conv1.bias": _f32(v["encoder/conv1/bias"]),
        "model.encoder.conv2.weight": _f32(v["encoder/conv2/weight"]),
        "model.encoder.conv2.bias": _f32(v["encoder/conv2/bias"]),
        "model.encoder.embed_positions.weight": _f32(v["encoder/position_encodings/encodings"]),
        "model.encoder.layer_norm.weight": _f32(v["encoder/layer_norm/gamma"]),
        "model.encoder.layer_norm.bias": _f32(v["encoder/layer_norm/beta"]),
        "model.decoder.embed_tokens.weight": _f32(v["decoder/embeddings/weight"]),
        "model.decoder.embed_positions.weight": _f32(v["decoder/position_encodings/encodings"]),
        "model.decoder.layer_norm.weight": _f32(v["decoder/layer_norm/gamma"]),
        "model.decoder.layer_norm.bias": _f32(v["decoder/layer_norm/beta"]),
    }
    for i in range(n_enc):
        _map_layer(v, f"encoder/layer_{i}", f"model.encoder.layers.{i}", False, sd)
    for i in range(n_dec):
        _map_layer(v, f"decoder/layer_{i}", f"model.decoder.layers.{i}", True, sd)

    model = WhisperForConditionalGeneration(config)
    missing, unexpected = model.load_state_dict({k: torch.from_numpy(a) for k, a in sd.items()}, strict=False)
    missing = [m for m in missing if m != "proj_out.weight"]  # tied to the token embeddings
    if missing or unexpected:
        raise ValueError(f"weight mapping mismatch: missing {missing[:5]}, unexpected {unexpected[:5]}")
    model.tie_weights()

    gen = model.generation_config
    gen._from_model_config = False  # else loading drops every Whisper-specific key below
    gen.decoder_start_token_id = config.decoder_start_token_id
    gen.eos_token_id = gen.pad_token_id = eot
    gen.no_timestamps_token_id = token_id["<|notimestamps|>"]
    gen.suppress_tokens = list(config.suppress_tokens)
    gen.begin_suppress_tokens = list(config.begin_suppress_tokens)
    gen.max_length = config.max_target_positions
    gen.is_multilingual = multilingual
    gen.return_timestamps = False
    if "alignment_heads" in ct2_cfg:
        gen.alignment_heads = ct2_cfg["alignment_heads"]
    if multilingual:
        gen.lang_to_id = {token_id_s: i for token_id_s, i in token_id.items() if _is_lang(token_id_s)}
        gen.task_to_id = {"transcribe": token_id["<|transcribe|>"], "translate": token_id["<|translate|>"]}
        gen.language, gen.task = "<|en|>", "transcribe"
    model.save_pretrained(dst)
    shutil.copyfile(src / "tokenizer.json", dst / "tokenizer.json")
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "WhisperTokenizer",
                "bos_token": "<|endoftext|>",
                "eos_token": "<|endoftext|>",
                "unk_token": "<|endoftext|>",
                "pad_token": "<|endoftext|>",
                "model_max_length": config.max_target_positions,
            },
            indent=2,
        )
    )
    WhisperFeatureExtractor(feature_size=config.num_mel_bins).save_pretrained(dst)  # mel filters computed locally
    return dst


def _is_lang(token: str) -> bool:
    inner = token[2:-2]
    return token.startswith("<|") and token.endswith("|>") and 2 <= len(inner) <= 3 and inner.isalpha()
