"""Write a random-weight checkpoint with the Qwen2.5-0.5B shape (hidden 896, 24 layers, 14 heads, 2 KV heads,
intermediate 4864, vocab 151936, tied embeddings) for the benchmarks. Not committed (about 2 GB in f32).
Needs only numpy + safetensors (pip install -r scripts/script-requirements.txt):
    python scripts/make_bench_model.py [/tmp/mbd-bench/qwen2.5-0.5b-shape] [--bf16]
--bf16 stores the same weights rounded to bfloat16 (1 GB), as real checkpoints ship. --hidden/--layers/--heads/
--inter change the shape (e.g. `--hidden 1024 --layers 4 --heads 16 --inter 2816`: rows of whole 256-value
k-quant super-blocks, which the 0.5B's 896-wide rows are not); give such a checkpoint its own directory.
"""
import json
import os
import shutil
import sys

import numpy as np
from safetensors.numpy import save_file

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # make_checkpoint.save

SHAPE = {"--hidden": 896, "--layers": 24, "--heads": 14, "--inter": 4864}
ARGV = sys.argv[1:]
for _flag in SHAPE:
    if _flag in ARGV:
        _i = ARGV.index(_flag)
        SHAPE[_flag] = int(ARGV[_i + 1])
        del ARGV[_i:_i + 2]
ARGS = [a for a in ARGV if not a.startswith("--")]
BF16 = "--bf16" in ARGV
OUT = ARGS[0] if ARGS else "/tmp/mbd-bench/qwen2.5-0.5b-shape" + ("-bf16" if BF16 else "")
H, L, NH, NKV, FF, V = SHAPE["--hidden"], SHAPE["--layers"], SHAPE["--heads"], 2, SHAPE["--inter"], 151936
D = H // NH


def save_bf16(tensors, path):
    """A safetensors file of bfloat16 tensors (make_checkpoint.save: round-to-nearest-even on the f32 bits)."""
    from make_checkpoint import save
    save({name: tensors[name] for name in sorted(tensors)}, path, bf16=True)


def main():
    os.makedirs(OUT, exist_ok=True)
    rng = np.random.default_rng(0)
    w = lambda *s: (rng.standard_normal(s, dtype=np.float32) / np.sqrt(s[-1])).astype(np.float32)  # noqa: E731
    t = {"model.embed_tokens.weight": w(V, H), "model.norm.weight": np.ones(H, np.float32)}
    for i in range(L):
        p = f"model.layers.{i}"
        t[f"{p}.input_layernorm.weight"] = np.ones(H, np.float32)
        t[f"{p}.post_attention_layernorm.weight"] = np.ones(H, np.float32)
        t[f"{p}.self_attn.q_proj.weight"] = w(NH * D, H)
        t[f"{p}.self_attn.q_proj.bias"] = np.zeros(NH * D, np.float32)
        t[f"{p}.self_attn.k_proj.weight"] = w(NKV * D, H)
        t[f"{p}.self_attn.k_proj.bias"] = np.zeros(NKV * D, np.float32)
        t[f"{p}.self_attn.v_proj.weight"] = w(NKV * D, H)
        t[f"{p}.self_attn.v_proj.bias"] = np.zeros(NKV * D, np.float32)
        t[f"{p}.self_attn.o_proj.weight"] = w(H, NH * D)
        t[f"{p}.mlp.gate_proj.weight"] = w(FF, H)
        t[f"{p}.mlp.up_proj.weight"] = w(FF, H)
        t[f"{p}.mlp.down_proj.weight"] = w(H, FF)
    if BF16:
        save_bf16(t, os.path.join(OUT, "model.safetensors"))
    else:
        save_file(t, os.path.join(OUT, "model.safetensors"))
    cfg = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": H, "num_hidden_layers": L,
           "num_attention_heads": NH, "num_key_value_heads": NKV, "intermediate_size": FF, "vocab_size": V,
           "tie_word_embeddings": True, "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
           "hidden_act": "silu", "torch_dtype": "bfloat16" if BF16 else "float32", "use_sliding_window": False, "sliding_window": None,
           "eos_token_id": 151643, "bos_token_id": 151643, "block_size": 32, "mask_token_id": 151665}
    json.dump(cfg, open(os.path.join(OUT, "config.json"), "w"), indent=1)
    here = os.path.dirname(os.path.abspath(__file__))
    shutil.copy(os.path.join(here, "..", "tests", "fixtures", "parity", "qwen2_gqa_tied", "tokenizer.json"), OUT)
    print("wrote", OUT)


if __name__ == "__main__":
    main()
