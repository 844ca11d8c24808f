"""A random Qwen2 checkpoint whose rows split into q4_k super-blocks: tests/test_quantize.py and benches/gpu/quant.py
(numpy and safetensors only, no pytest)."""
import json
import pathlib
import shutil

import numpy as np
from safetensors.numpy import save_file

FIXTURE = pathlib.Path(__file__).parent / "fixtures" / "parity" / "qwen2_gqa_tied"


def random_checkpoint(path, hidden=256, inter=512, layers=2, seed=0, head_dim=64):
    """A random Qwen2 checkpoint whose rows split into q4_k super-blocks (256 values, by default), tied embeddings."""
    path.mkdir()
    rng = np.random.default_rng(seed)
    heads, kv, hd, vocab = 4, 2, head_dim, 320
    cfg = json.loads(open(FIXTURE / "config.json").read())
    cfg.update(hidden_size=hidden, intermediate_size=inter, num_hidden_layers=layers, num_attention_heads=heads,
               num_key_value_heads=kv, head_dim=hd, layer_types=["full_attention"] * layers)
    (path / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(FIXTURE / f, path / f)
    t = {"model.embed_tokens.weight": rng.normal(0, 1, (vocab, hidden)), "model.norm.weight": np.ones(hidden)}
    for i in range(layers):
        p = f"model.layers.{i}."
        for n, shape in [("self_attn.q_proj", (heads * hd, hidden)), ("self_attn.k_proj", (kv * hd, hidden)),
                         ("self_attn.v_proj", (kv * hd, hidden)), ("self_attn.o_proj", (hidden, heads * hd)),
                         ("mlp.gate_proj", (inter, hidden)), ("mlp.up_proj", (inter, hidden)),
                         ("mlp.down_proj", (hidden, inter))]:
            t[p + n + ".weight"] = rng.normal(0, 1 / np.sqrt(shape[1]), shape)
        for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
            t[p + n + ".bias"] = rng.normal(0, 0.1, t[p + n + ".weight"].shape[0])
        t[p + "input_layernorm.weight"] = np.ones(hidden)
        t[p + "post_attention_layernorm.weight"] = np.ones(hidden)
    save_file({k: v.astype(np.float32) for k, v in t.items()}, str(path / "model.safetensors"))
    return path
