#!/usr/bin/env python3
"""Make a random-weight checkpoint with a published model's exact shape and config: the files a user would point
the engine at (config.json with the family's architecture and decoding fields, generation_config.json, sharded
safetensors with an index, a tokenizer with the family's special tokens at their real ids, the chat template), so
memory, speed and loading can be tried without a download. The weights are random: the text is garbage.

    python scripts/make_checkpoint.py --family sdar --shape 1.7b [OUT]       # JetLM/SDAR-1.7B-Chat's shape
    python scripts/make_checkpoint.py --family dream --shape 7b --layers 2     # Dream-v0-Instruct-7B, 2 layers
    python scripts/make_checkpoint.py --family fast_dllm_v2 --shape 7b --dtype float32

Families: sdar (Qwen3, block-causal, no logit shift, mask 151669, block 4), fast_dllm_v2 (Qwen2.5, shifted, mask
151665, bd_size 32), dream (Qwen2.5, full attention, shifted, mask 151666), qwen3 and qwen2 (plain causal). Shapes:
0.5b, 1.7b, 4b, 7b, 8b (each family has the ones it was published at; `--layers` cuts the depth). OUT defaults to
/tmp/mbd-checkpoints/<family>-<shape>.

The tokenizer is Qwen's real byte-level BPE vocabulary (151,643 tokens) when llama-cpp-python's sdist is at hand
(it vendors llama.cpp's vocabulary GGUF; `pip download --no-deps --no-binary llama-cpp-python
llama-cpp-python==0.3.36 -d ~/.cache/mbd-rs`, or $MBD_LLAMACPP_SDIST; needs `pip install gguf`), else the embedded
model's 100-token one (then config.json says so and the mask id is that tokenizer's). Needs numpy and safetensors
(`pip install -r scripts/script-requirements.txt`).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any, Dict, List, Optional

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

# Qwen2.5 / Qwen3 dimensions: hidden, layers, heads, kv heads, head_dim, intermediate, tied embeddings
QWEN3 = {"0.5b": None, "1.7b": (2048, 28, 16, 8, 128, 6144, True), "4b": (2560, 36, 32, 8, 128, 9728, True),
         "8b": (4096, 36, 32, 8, 128, 12288, False)}
QWEN25 = {"0.5b": (896, 24, 14, 2, 64, 4864, True), "1.7b": None, "4b": None,
          "7b": (3584, 28, 28, 4, 128, 18944, False)}

# Qwen's special tokens after the byte-level vocabulary (ids from 151643), Qwen2.5's then Qwen3's
QWEN_SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>",
                "<|box_start|>", "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>",
                "<|vision_pad|>", "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>",
                "<|fim_middle|>", "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>"]
QWEN3_SPECIAL = QWEN_SPECIAL + ["<tool_response>", "</tool_response>", "<think>", "</think>"]

FAMILIES: Dict[str, Dict[str, Any]] = {
    "sdar": dict(base="qwen3", arch="SDARForCausalLM", model_type="sdar", special=QWEN3_SPECIAL + ["<|MASK|>"],
                 mask="<|MASK|>", extra={"block_size": 4}, vocab=151936),
    "qwen3": dict(base="qwen3", arch="Qwen3ForCausalLM", model_type="qwen3", special=QWEN3_SPECIAL, mask=None,
                  extra={}, vocab=151936),
    "fast_dllm_v2": dict(base="qwen25", arch="Fast_dLLM_QwenForCausalLM", model_type="Fast_dLLM_Qwen",
                         special=QWEN_SPECIAL + ["|<MASK>|"], mask="|<MASK>|", extra={"bd_size": 32}, vocab=152064),
    "dream": dict(base="qwen25", arch="DreamModel", model_type="Dream",
                  special=QWEN_SPECIAL + ["<|beginoftext|>", "<|mask|>"], mask="<|mask|>", extra={}, vocab=152064),
    "qwen2": dict(base="qwen25", arch="Qwen2ForCausalLM", model_type="qwen2", special=QWEN_SPECIAL, mask=None,
                  extra={}, vocab=151936),
}


def shape_of(family: str, shape: str) -> tuple:
    table = QWEN3 if FAMILIES[family]["base"] == "qwen3" else QWEN25
    dims = table.get(shape)
    if dims is None:
        have = [s for s, d in table.items() if d is not None]
        raise SystemExit(f"--family {family} has no published {shape} shape; choose one of {', '.join(have)}")
    return dims


def config(family: str, dims: tuple, layers: int, dtype: str, mask_id: Optional[int], vocab: int) -> dict:
    f = FAMILIES[family]
    h, _, nh, nkv, d, inter, tied = dims
    qwen3 = f["base"] == "qwen3"
    cfg = {"architectures": [f["arch"]], "model_type": f["model_type"], "hidden_size": h, "num_hidden_layers": layers,
           "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": d, "intermediate_size": inter,
           "vocab_size": vocab, "tie_word_embeddings": tied, "max_position_embeddings": 40960 if qwen3 else 32768,
           "rope_theta": 1000000.0, "rms_norm_eps": 1e-6, "hidden_act": "silu", "torch_dtype": dtype,
           "use_sliding_window": False, "sliding_window": None, "bos_token_id": 151643,
           "eos_token_id": 151645 if qwen3 else 151643, "attention_bias": not qwen3}
    if mask_id is not None:
        cfg["mask_token_id"] = mask_id
    cfg.update(f["extra"])
    return cfg


def tensors(cfg: dict, rng: np.random.Generator) -> "Dict[str, np.ndarray]":
    """Name -> random f32 array, layer by layer (yielded in checkpoint order)."""
    h, nh, nkv, d, inter, v = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads",
                                                  "head_dim", "intermediate_size", "vocab_size"))
    qwen3 = cfg["model_type"] in ("sdar", "qwen3")

    def w(*s: int) -> np.ndarray:
        return (rng.standard_normal(s, dtype=np.float32) * (0.5 / np.sqrt(s[-1]))).astype(np.float32)

    def norm(n: int) -> np.ndarray:
        return (1.0 + 0.1 * rng.standard_normal(n, dtype=np.float32)).astype(np.float32)

    out = {"model.embed_tokens.weight": w(v, h)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}"
        out[f"{p}.input_layernorm.weight"] = norm(h)
        out[f"{p}.post_attention_layernorm.weight"] = norm(h)
        for name, rows in (("q", nh * d), ("k", nkv * d), ("v", nkv * d)):
            out[f"{p}.self_attn.{name}_proj.weight"] = w(rows, h)
            if not qwen3:
                out[f"{p}.self_attn.{name}_proj.bias"] = (0.02 * rng.standard_normal(rows)).astype(np.float32)
        if qwen3:
            out[f"{p}.self_attn.q_norm.weight"] = norm(d)
            out[f"{p}.self_attn.k_norm.weight"] = norm(d)
        out[f"{p}.self_attn.o_proj.weight"] = w(h, nh * d)
        out[f"{p}.mlp.gate_proj.weight"] = w(inter, h)
        out[f"{p}.mlp.up_proj.weight"] = w(inter, h)
        out[f"{p}.mlp.down_proj.weight"] = w(h, inter)
    out["model.norm.weight"] = norm(h)
    if not cfg["tie_word_embeddings"]:
        out["lm_head.weight"] = w(v, h)
    return out


def save(t: "Dict[str, np.ndarray]", path: str, bf16: bool) -> int:
    """One safetensors file (bf16: the f32 values rounded to nearest even); returns its data bytes."""
    header: Dict[str, Any] = {}
    blobs: List[bytes] = []
    off = 0
    for name, a in t.items():
        if bf16:
            u = a.astype(np.float32).view(np.uint32)
            b = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype("<u2").tobytes()
        else:
            b = a.astype("<f4").tobytes()
        header[name] = {"dtype": "BF16" if bf16 else "F32", "shape": list(a.shape), "data_offsets": [off, off + len(b)]}
        blobs.append(b)
        off += len(b)
    raw = json.dumps(header).encode()
    raw += b" " * ((8 - len(raw) % 8) % 8)
    with open(path, "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for b in blobs:
            f.write(b)
    return off


def write_weights(cfg: dict, out: str, bf16: bool, shard_bytes: int, seed: int) -> int:
    """Shards of about `shard_bytes` and model.safetensors.index.json (one file when it all fits)."""
    rng = np.random.default_rng(seed)
    every = tensors(cfg, rng)
    per = 2 if bf16 else 4
    shards: List[Dict[str, np.ndarray]] = [{}]
    size = 0
    for name, a in every.items():
        if shards[-1] and size + a.size * per > shard_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = a
        size += a.size * per
    total, weight_map = 0, {}
    n = len(shards)
    for i, s in enumerate(shards):
        fname = "model.safetensors" if n == 1 else f"model-{i + 1:05d}-of-{n:05d}.safetensors"
        total += save(s, os.path.join(out, fname), bf16)
        weight_map.update({k: fname for k in s})
    if n > 1:
        with open(os.path.join(out, "model.safetensors.index.json"), "w") as f:
            json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=1)
    return total


def write_tokenizer(family: str, out: str, sdist: Optional[str]) -> "tuple[Optional[int], int]":
    """The family's tokenizer in `out`; returns (mask id, tokenizer size)."""
    f = FAMILIES[family]
    if sdist and os.path.exists(sdist):
        import tempfile

        import make_qwen_vocab_fixture as q
        with tempfile.TemporaryDirectory() as tmp:
            v = q.read_vocab_gguf(q.extract_vocab(sdist, tmp)[q.VOCAB_NAME])
        tok = q.build_tokenizer_json(v)
        base = max(t["id"] for t in tok["added_tokens"]) + 1 - len(tok["added_tokens"])  # 151643
        tok["added_tokens"] = [q.added_token(base + i, s) for i, s in enumerate(f["special"])]
        with open(os.path.join(out, "tokenizer.json"), "w", encoding="utf-8") as fh:
            json.dump(tok, fh, ensure_ascii=False)
        tc = q.build_tokenizer_config(tok, eos_token="<|im_end|>" if f["base"] == "qwen3" else "<|endoftext|>",
                                      pad_token="<|endoftext|>")
        if f["mask"]:
            tc["mask_token"] = f["mask"]
        with open(os.path.join(out, "tokenizer_config.json"), "w", encoding="utf-8") as fh:
            json.dump(tc, fh, ensure_ascii=False, indent=1)
        mask = base + f["special"].index(f["mask"]) if f["mask"] else None
        return mask, base + len(f["special"])
    print("note: llama-cpp-python's sdist not found: the embedded model's 100-token tokenizer stands in",
          file=sys.stderr)
    tiny = os.path.join(HERE, "..", "python", "mbd_rs", "models", "mbd-tiny")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(tiny, name), out)
    with open(os.path.join(tiny, "tokenizer.json"), encoding="utf-8") as fh:
        t = json.load(fh)
    mask = next(a["id"] for a in t["added_tokens"] if a["content"] == "<|mask|>") if f["mask"] else None
    return mask, len(t["model"]["vocab"])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--family", required=True, choices=sorted(FAMILIES))
    ap.add_argument("--shape", required=True, choices=["0.5b", "1.7b", "4b", "7b", "8b"])
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the published depth")
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--shard-mb", type=int, default=2000, help="safetensors shard size (default 2000 MB)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sdist", default=os.environ.get("MBD_LLAMACPP_SDIST", os.path.expanduser(
        "~/.cache/mbd-rs/llama_cpp_python-0.3.36.tar.gz")))
    a = ap.parse_args()
    dims = shape_of(a.family, a.shape)
    layers = a.layers or dims[1]
    out = a.out or f"/tmp/mbd-checkpoints/{a.family}-{a.shape}" + (f"-{layers}l" if a.layers else "")
    os.makedirs(out, exist_ok=True)
    mask, tok_size = write_tokenizer(a.family, out, a.sdist)
    cfg = config(a.family, dims, layers, a.dtype, mask, FAMILIES[a.family]["vocab"])
    if tok_size < 1000:
        cfg["mbd_note"] = "a stand-in 100-token tokenizer: ids above it are never produced by tokenizing"
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(cfg, f, indent=1)
    gen = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False}
    with open(os.path.join(out, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=1)
    total = write_weights(cfg, out, a.dtype == "bfloat16", a.shard_mb << 20, a.seed)
    params = total // (2 if a.dtype == "bfloat16" else 4)
    print(f"wrote {out}: {a.family} {a.shape} shape, {layers} layers, {params / 1e9:.2f}B parameters, "
          f"{total / 2**30:.2f} GiB of {a.dtype} weights")
    return 0


if __name__ == "__main__":
    sys.exit(main())
