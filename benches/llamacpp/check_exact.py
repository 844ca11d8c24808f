"""Does mbd-rs compute exactly the weights a llama.cpp-quantized GGUF file stores?

Loads FILE.gguf (e.g. llama-quantize's Q4_K_M of a Qwen2 checkpoint written by scripts/write_gguf.py) in mbd-rs,
and next to it an f32 safetensors twin of the same model whose every tensor is gguf-py's dequantization of the
file's tensor (llama.cpp's own Python reader and dequantizer, not ours). The two must give the same logits bit for
bit (a quantized matrix in our kernel computes as its dequantized f32 matrix), for one-row, few-row and long
windows. Prints the formats held, bytes, and the largest difference (0 when exact).

    python benches/llamacpp/check_exact.py /tmp/llamacpp/ours/model-q4_k_m.gguf --src /tmp/mbd-bench/qwen2.5-0.5b-shape
"""
import argparse
import json
import os
import shutil
import sys
import tempfile

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "scripts"))


def main():
    import gguf
    from safetensors import safe_open
    from safetensors.numpy import save_file
    from write_gguf import ARCH

    import mbd_rs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("gguf_file")
    ap.add_argument("--src", required=True, help="the HF directory the file was written from (config, tokenizer)")
    ap.add_argument("--cases", default="0:1,16:1,16:3,16:8,0:64", help="P:W windows compared")
    a = ap.parse_args()

    with open(os.path.join(a.src, "config.json")) as f:
        cfg = json.load(f)
    arch = ARCH[cfg["architectures"][0]]
    tmap = gguf.get_tensor_name_map(arch, cfg["num_hidden_layers"])
    reader = gguf.GGUFReader(a.gguf_file)
    stored = {t.name: t for t in reader.tensors}
    deq, kinds = {}, {}
    with safe_open(os.path.join(a.src, "model.safetensors"), "np") as f:
        names = list(f.keys())
    for name in names:
        g = tmap.get_name(name, try_suffixes=(".weight", ".bias"))
        t = stored[g]
        v = gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float32)
        deq[name] = np.ascontiguousarray(v.reshape([int(x) for x in reversed(t.shape)]))
        kinds[t.tensor_type.name] = kinds.get(t.tensor_type.name, 0) + 1
    print("tensor types in the file:", kinds)
    with tempfile.TemporaryDirectory() as tmp:
        for f in os.listdir(a.src):  # config, tokenizer files
            if not f.endswith(".safetensors"):
                shutil.copy(os.path.join(a.src, f), tmp)
        save_file(deq, os.path.join(tmp, "model.safetensors"))
        del deq
        q = mbd_rs.Engine.load(a.gguf_file, device="cpu")
        f32 = mbd_rs.Engine.load(tmp, device="cpu")
        print(f"mbd-rs holds {q.info.weight_format}, {q.info.weight_bytes / 2**20:.1f} MiB "
              f"(file {os.path.getsize(a.gguf_file) / 2**20:.1f} MiB); f32 twin {f32.info.weight_bytes / 2**20:.1f} MiB")
        rng = np.random.default_rng(0)
        worst = 0.0
        for case in a.cases.split(","):
            p, w = (int(x) for x in case.split(":"))
            ids = [int(x) for x in rng.integers(0, 300, p + w)]
            lq = q.logits(ids, attention="causal", prefix_len=p)
            lf = f32.logits(ids, attention="causal", prefix_len=p)
            d = float(np.abs(lq - lf).max())
            worst = max(worst, d)
            print(f"P={p} W={w}: max |diff| {d:.3g} (logits up to {float(np.abs(lf).max()):.3g})")
    print("EXACT" if worst == 0.0 else f"NOT EXACT: {worst:.3g}")
    return 0 if worst == 0.0 else 1


if __name__ == "__main__":
    sys.exit(main())
