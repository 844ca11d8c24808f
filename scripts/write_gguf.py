"""Write a Hugging Face Qwen2/Qwen3/Qwen3-MoE/Qwen3.5/Qwen3.5-MoE checkpoint as a GGUF file with llama.cpp's own Python package (`gguf`:
its writer, its tensor-name map, its quantizers), as llama.cpp's converter lays such files out: metadata under the
architecture's keys, the tokenizer.json's byte-level BPE as `tokenizer.ggml.*` (added tokens at their ids, control
when special, `[PAD<i>]` fillers up to the embedding's rows), MoE experts stacked per layer; Qwen3.5 with the
transforms of llama.cpp's converter (`conversion/qwen.py` in llama-cpp-python 0.3.36's llama.cpp: norm weights + 1
except the gated norm, `ssm_a` = -exp(A_log), the convolution squeezed, value heads reordered to tiled order, the
`ssm.*` keys and `attention.recurrent_layers`). For tests and benches:
llama.cpp's `convert_hf_to_gguf.py` refuses tokenizers whose pre-tokenizer it does not know (our small test
tokenizers), and needs torch.

    python scripts/write_gguf.py HF_DIR OUT.gguf [--type f32|f16|q8_0|q5_0|q4_0]

--type: the matrices' format (norms and biases stay f32; gguf's quantizers: q8_0, q5_0, q4_0 on rows that split
into blocks of 32, f16 otherwise). Needs numpy, safetensors and gguf (pip install gguf==0.19.0).
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys

import gguf
import numpy as np
from gguf import GGMLQuantizationType as Q

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from make_qwen_vocab_fixture import token_str  # noqa: E402  (GPT-2's byte alphabet)

ARCH = {"Qwen2ForCausalLM": gguf.MODEL_ARCH.QWEN2, "Qwen3ForCausalLM": gguf.MODEL_ARCH.QWEN3,
        "Qwen3MoeForCausalLM": gguf.MODEL_ARCH.QWEN3MOE, "Qwen3_5ForCausalLM": gguf.MODEL_ARCH.QWEN35,
        "Qwen3_5MoeForCausalLM": gguf.MODEL_ARCH.QWEN35MOE}
QWEN35 = (gguf.MODEL_ARCH.QWEN35, gguf.MODEL_ARCH.QWEN35MOE)
# Qwen3.5 tensors llama.cpp's converter keeps in f32 whatever the file type
QWEN35_F32 = ("linear_attn.conv1d.weight", "mlp.gate.weight", "mlp.shared_expert_gate.weight")
# A ChatML template (written for these files).
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def read_hf(src):
    """config.json and model.safetensors's tensors as numpy arrays (bfloat16 ones, which numpy lacks, as float32)."""
    with open(os.path.join(src, "config.json")) as f:
        cfg = json.load(f)
    path = os.path.join(src, "model.safetensors")
    with open(path, "rb") as f:  # read once, parsed here (safetensors' numpy loader has no bfloat16)
        n = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(n))
        data = f.read()
    tensors = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        raw = data[v["data_offsets"][0]:v["data_offsets"][1]]
        if v["dtype"] == "BF16":
            arr = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        elif v["dtype"] in ("F32", "F16"):
            arr = np.frombuffer(raw, {"F32": np.float32, "F16": np.float16}[v["dtype"]])
        else:
            raise ValueError(f"{path}: tensor {k} is {v['dtype']}; this script reads F32, F16 and BF16")
        tensors[k] = arr.reshape(v["shape"]).copy()
    return cfg, tensors


def vocab_fields(src, vocab_size):
    """tokens, token types and merges of the fixture's tokenizer.json, as llama.cpp's converter lays them out
    (added tokens at their ids, control when special; [PAD<i>] fillers up to the embedding's rows). GGUF's `gpt2`
    tokenizer is a byte-level BPE: a vocabulary that is not byte-level (mbd-tiny's characters, split without a
    pre-tokenizer) is respelled in GPT-2's byte alphabet (" " as "Ġ", "\n" as "Ċ"), the same tokenizer as a
    byte-level BPE."""
    with open(os.path.join(src, "tokenizer.json")) as f:
        tj = json.load(f)
    byte_level = "ByteLevel" in (str((tj.get("pre_tokenizer") or {}).get("type")),
                                 str((tj.get("decoder") or {}).get("type")))
    def spell(t):
        return t if byte_level else token_str(t.encode())

    tokens = [f"[PAD{i}]" for i in range(vocab_size)]
    types = [int(gguf.TokenType.USER_DEFINED)] * vocab_size
    for t, i in tj["model"]["vocab"].items():
        tokens[i], types[i] = spell(t), int(gguf.TokenType.NORMAL)
    for a in tj["added_tokens"]:
        tokens[a["id"]] = a["content"]
        types[a["id"]] = int(gguf.TokenType.CONTROL if a["special"] else gguf.TokenType.USER_DEFINED)
    merges = [" ".join(spell(p) for p in (m.split(" ") if isinstance(m, str) else m)) for m in tj["model"]["merges"]]
    return tokens, types, merges


def to_tiled(arr, axis, hk, hv):
    """Value heads from transformers' grouped order (head h uses key head h // (hv/hk)) to llama.cpp's tiled order
    (stored head j uses key head j % hk): along `axis` (hv heads of equal size), stored head j = i * hk + g holds
    head g * r + i."""
    r = hv // hk
    a = np.moveaxis(arr, axis, 0)
    shape = a.shape
    a = a.reshape(hk, r, -1, *shape[1:]).swapaxes(0, 1).reshape(shape)
    return np.ascontiguousarray(np.moveaxis(a, 0, axis))


def qwen35_tensors(cfg, tensors):
    """The tensors as llama.cpp's converter hands them to the name map: norms + 1 (the gated norm excepted),
    A_log as -exp(A_log), dt_bias as dt_proj.bias, the convolution (C, K), value heads in tiled order, a fused
    gate_up_proj split into per-expert gate and up matrices."""
    hk, hv = cfg["linear_num_key_heads"], cfg["linear_num_value_heads"]
    kd = hk * cfg["linear_key_head_dim"]
    out = {}
    for name, arr in tensors.items():
        arr = arr.astype(np.float32)
        if name.endswith("norm.weight") and ".linear_attn.norm." not in name:
            arr = arr + 1.0
        if ".linear_attn." in name and hk != hv:
            if name.endswith("in_proj_qkv.weight") or name.endswith("conv1d.weight"):
                arr = np.concatenate([arr[:2 * kd], to_tiled(arr[2 * kd:], 0, hk, hv)])
            elif name.endswith(("in_proj_z.weight", "in_proj_b.weight", "in_proj_a.weight", "A_log", "dt_bias")):
                arr = to_tiled(arr, 0, hk, hv)
            elif name.endswith("out_proj.weight"):
                arr = to_tiled(arr, 1, hk, hv)
        if name.endswith("A_log"):
            arr = -np.exp(arr)
        if name.endswith("conv1d.weight"):
            arr = arr.reshape(arr.shape[0], arr.shape[-1])
        if name.endswith("dt_bias"):
            name = name[:-len("dt_bias")] + "dt_proj.bias"
        if name.endswith(".mlp.experts.gate_up_proj"):
            inter = arr.shape[1] // 2
            for e in range(arr.shape[0]):
                out[f"{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = arr[e, :inter]
                out[f"{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = arr[e, inter:]
            continue
        if name.endswith(".mlp.experts.down_proj"):
            for e in range(arr.shape[0]):
                out[f"{name[:-len('down_proj')]}{e}.down_proj.weight"] = arr[e]
            continue
        out[name] = np.ascontiguousarray(arr)
    return out


def write_gguf(dst, cfg, tensors, tok_src, encode=None, extra_kv=None, raw_tensors=None):
    """Write `tensors` (HF names -> float arrays) of the model `cfg` as a GGUF file. `encode(name, array)` returns
    (bytes array, quant type) for a block-format tensor, or None to store the floats as they are."""
    arch = ARCH[cfg["architectures"][0]]
    n_layers = cfg["num_hidden_layers"]
    w = gguf.GGUFWriter(dst, gguf.MODEL_ARCH_NAMES[arch])
    w.add_block_count(n_layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(cfg["num_key_value_heads"])
    if "head_dim" in cfg:
        w.add_key_length(cfg["head_dim"])
        w.add_value_length(cfg["head_dim"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    theta = cfg.get("rope_theta") or cfg.get("rope_parameters", {}).get("rope_theta", 10000.0)
    w.add_rope_freq_base(theta)
    if arch == gguf.MODEL_ARCH.QWEN3MOE:
        w.add_expert_count(cfg.get("num_local_experts", cfg.get("num_experts")))
        w.add_expert_used_count(cfg["num_experts_per_tok"])
        w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
        w.add_expert_weights_norm(bool(cfg["norm_topk_prob"]))
    if arch in QWEN35:
        name = gguf.MODEL_ARCH_NAMES[arch]
        w.add_ssm_conv_kernel(cfg["linear_conv_kernel_dim"])
        w.add_ssm_state_size(cfg["linear_key_head_dim"])
        w.add_ssm_group_count(cfg["linear_num_key_heads"])
        w.add_ssm_time_step_rank(cfg["linear_num_value_heads"])
        w.add_ssm_inner_size(cfg["linear_value_head_dim"] * cfg["linear_num_value_heads"])
        w.add_array(f"{name}.attention.recurrent_layers", [t == "linear_attention" for t in cfg["layer_types"]])
        w.add_full_attention_interval(cfg.get("full_attention_interval", 4))
        rp = cfg.get("rope_parameters") or {}
        w.add_rope_dimension_count(int(cfg["head_dim"] * rp.get("partial_rotary_factor", 0.25)))
        w.add_rope_dimension_sections((rp.get("mrope_section") or [11, 11, 10]) + [0])
        if arch == gguf.MODEL_ARCH.QWEN35MOE:
            w.add_expert_count(cfg["num_experts"])
            w.add_expert_used_count(cfg["num_experts_per_tok"])
            w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
            w.add_expert_shared_feed_forward_length(cfg["shared_expert_intermediate_size"])
        tensors = qwen35_tensors(cfg, tensors)
    tokens, types, merges = vocab_fields(tok_src, tensors["model.embed_tokens.weight"].shape[0])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    eos = cfg.get("eos_token_id", 0)
    w.add_eos_token_id(int(eos[0] if isinstance(eos, list) else eos))
    w.add_chat_template(CHATML)
    for k, v in (extra_kv or {}).items():
        w.add_key_value(k, v[0], v[1])
    tmap = gguf.get_tensor_name_map(arch, n_layers)
    dense_map = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, n_layers)  # a MoE model's dense-MLP layers
    experts = {}
    for name, arr in tensors.items():
        if ".mlp.experts." in name:  # per-expert matrices, stacked as llama.cpp's converter does
            layer, rest = name.split(".mlp.experts.")
            e, proj = rest.split(".", 1)
            experts.setdefault((layer, proj), {})[int(e)] = arr
            continue
        out = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        out = out or dense_map.get_name(name, try_suffixes=(".weight", ".bias"))
        assert out is not None, name
        keep_f32 = arch in QWEN35 and name.endswith(QWEN35_F32)
        enc = encode(name, arr) if encode and not keep_f32 else None
        if enc is None:
            w.add_tensor(out, np.ascontiguousarray(arr))
        else:
            w.add_tensor(out, enc[0], raw_dtype=enc[1])
    for name, arr in (raw_tensors or {}).items():  # under their GGUF names
        w.add_tensor(name, arr)
    for (layer, proj), per in experts.items():
        kind = {"gate_proj.weight": "ffn_gate_exps", "up_proj.weight": "ffn_up_exps",
                "down_proj.weight": "ffn_down_exps"}[proj]
        w.add_tensor(f"blk.{layer.rsplit('.', 1)[1]}.{kind}.weight",
                     np.ascontiguousarray(np.stack([per[e] for e in sorted(per)])))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_dir(dst, src, cfg, tensors):
    """An HF directory: `src`'s tokenizer, `cfg`, and `tensors` as float32 safetensors."""
    from safetensors.numpy import save_file
    os.makedirs(dst, exist_ok=True)
    for f in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(src, f), dst)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    save_file({k: np.ascontiguousarray(v, dtype=np.float32) for k, v in tensors.items()},
              os.path.join(dst, "model.safetensors"))



def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src")
    ap.add_argument("out")
    ap.add_argument("--type", default="f32", choices=["f32", "f16", "q8_0", "q5_0", "q4_0"])
    a = ap.parse_args()
    cfg, tensors = read_hf(a.src)
    qtype = {"q8_0": Q.Q8_0, "q5_0": Q.Q5_0, "q4_0": Q.Q4_0}.get(a.type)

    def encode(name, arr):
        if arr.ndim != 2:
            return None
        if qtype is not None and arr.shape[1] % 32 == 0:
            return gguf.quants.quantize(arr.astype(np.float32), qtype), qtype
        return (arr.astype(np.float16).view(np.uint8), Q.F16) if a.type != "f32" else None

    write_gguf(a.out, cfg, tensors, a.src, encode)
    print(f"{a.out}: {os.path.getsize(a.out) / 2**20:.1f} MiB")


if __name__ == "__main__":
    main()
