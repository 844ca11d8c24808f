"""One window forward of a Qwen3.5 hybrid on the CPU, side by side in one process: mbd-rs against PyTorch eager (HF
transformers' Qwen3_5ForCausalLM, same computation: a W-token window after a P-token cached prefix, the softmax
layers over their K/V, the Gated DeltaNet layers from their recurrent state, logits for every window row, same
thread count). Interleaved over --rounds rounds (the machine is shared and noisy); each number is the median of all
repetitions. transformers' cache is restored from a copy before each repetition (the copy is not timed), as mbd-rs's
forward leaves its cache unchanged until a commit.

The checkpoint is Qwen3.5-0.8B's shape (hidden 1024, 24 layers of which 6 attention, 8/2 heads of 256, GDN 16/16
heads of 128, FFN 3584, vocab 248320, tied) with random weights, stored bf16 (computed in f32 by both), made with
transformers if absent:

    python benches/forward/qwen35_forward.py [--model DIR] [--layers 24] [--cases 512:32,512:8,2048:32,0:32] \
        [--out FILE]
Needs torch + transformers >= 5.23 in the same environment as mbd_rs. Writes --out
(benches/results/qwen35/qwen35_forward.json).
"""
import argparse
import copy
import json
import os
import statistics
import time

import torch
import transformers

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Qwen/Qwen3.5-0.8B's text config
SHAPE_08B = dict(vocab_size=248320, hidden_size=1024, intermediate_size=3584, num_hidden_layers=24,
                 num_attention_heads=8, num_key_value_heads=2, head_dim=256, linear_num_key_heads=16,
                 linear_num_value_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
                 linear_conv_kernel_dim=4, full_attention_interval=4, tie_word_embeddings=True,
                 max_position_embeddings=262144, rms_norm_eps=1e-6,
                 rope_parameters={"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25})


def make(path, layers, shape=None, dtype=torch.bfloat16):
    """A random Qwen3.5 checkpoint of `shape` (Qwen3.5-0.8B's by default) with `layers` layers, stored in `dtype`:
    every weight random, the zero-initialised norms, A_log and dt_bias included (benches/gpu/qwen35.py makes its
    parity model here too)."""
    shape = {**(shape or SHAPE_08B), "num_hidden_layers": layers}
    eos = min(248044, shape["vocab_size"] - 1)
    cfg = transformers.Qwen3_5TextConfig(**shape, eos_token_id=eos, bos_token_id=eos)
    torch.manual_seed(0)
    model = transformers.Qwen3_5ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.copy_(torch.randn(p.shape) / p.shape[-1] ** 0.5)
            elif name.endswith("A_log"):
                p.copy_(-1.5 + 0.5 * torch.randn(p.shape))
            else:
                p.copy_(0.1 * torch.randn(p.shape) + (1.0 if "linear_attn.norm" in name else 0.0))
    model.to(dtype).save_pretrained(path)
    # a tokenizer is needed to load the directory: the embedded model's (ids are passed directly)
    import shutil
    for f in ["tokenizer.json", "tokenizer_config.json"]:
        shutil.copy(os.path.join(mbd_rs.DEFAULT_MODEL, f), os.path.join(path, f))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/mbd-bench/qwen3.5-0.8b-shape")
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default="512:32,512:8,2048:32,0:32")
    ap.add_argument("--out", default=os.path.join(ROOT, "benches", "results", "qwen35", "qwen35_forward.json"))
    args = ap.parse_args()
    if not os.path.exists(os.path.join(args.model, "config.json")):
        make(args.model, args.layers)
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    eng = mbd_rs.Engine.load(args.model, device="cpu")
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32,
                                                           attn_implementation="eager").eval()
    rows = []
    for case in args.cases.split(","):
        p, w = (int(x) for x in case.split(":"))
        ids = torch.randint(0, 240000, (1, p + w), generator=torch.Generator().manual_seed(0))
        times = {"torch_eager": [], "mbd_rs": []}
        with torch.no_grad():
            base = transformers.DynamicCache(config=hf.config)
            if p:
                hf(ids[:, :p], past_key_values=base, use_cache=True)
            for _ in range(args.rounds):
                for i in range(args.reps + 1):
                    cache = copy.deepcopy(base)
                    t = time.perf_counter()
                    hf(ids[:, p:], past_key_values=cache, use_cache=True, position_ids=torch.arange(p, p + w)[None])
                    if i:  # the first is a warm-up
                        times["torch_eager"].append(time.perf_counter() - t)
                times["mbd_rs"] += eng._core.bench_forward(p, w, args.reps + 1)[1:]
        ms = {name: 1e3 * statistics.median(x) for name, x in times.items()}
        row = dict(prefix=p, window=w, torch_eager_ms=ms["torch_eager"], mbd_rs_ms=ms["mbd_rs"],
                   ratio=ms["mbd_rs"] / ms["torch_eager"])
        rows.append(row)
        print(f"prefix {p:5d} W {w:3d}: torch eager {ms['torch_eager']:8.1f} ms; mbd-rs {ms['mbd_rs']:8.1f} ms "
              f"= {row['ratio']:.2f}x", flush=True)
    out = dict(model=args.model, layers=args.layers, threads=threads, rounds=args.rounds, reps=args.reps,
               torch=torch.__version__, transformers=transformers.__version__, rows=rows)
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
