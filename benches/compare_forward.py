"""One decode forward, side by side in one process: mbd-rs against PyTorch eager (HF transformers, same
computation: a W-token window over a P-token KV cache, logits for every window row, same thread count), and
mbd-rs with its skinny kernel switched off (candle's matmul everywhere) as an A/B of that kernel. The three
alternate over --rounds rounds (the machine is shared and noisy); each number is the median of all repetitions.

    python scripts/make_bench_model.py /tmp/mbd-bench/qwen2.5-0.5b-shape     # once, numpy + safetensors
    python benches/compare_forward.py [--model DIR] [--reps 7]
Needs torch + transformers in the same environment as mbd_rs. Writes benches/compare_forward.json.
"""
import argparse
import json
import os
import statistics
import time

import torch
import transformers

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default="512:32,512:4,2048:32,0:32")
    args = ap.parse_args()
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    eng = mbd_rs.Engine.load(args.model, device="cpu")
    # candle's matmul only, on f32-held weights (the engine before the skinny kernel): a second load
    gemm_eng = mbd_rs.Engine.load(args.model, device="cpu", _kernels=dict(skinny=False, keep_bf16_weights=False))
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()
    rows = []
    for case in args.cases.split(","):
        p, w = map(int, case.split(":"))
        ids = torch.randint(0, 150000, (1, p + w), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            cache = transformers.DynamicCache(config=hf.config)
            if p:
                hf(ids[:, :p], past_key_values=cache, use_cache=True)
            times, ours, gemm = [], [], []
            for _ in range(args.rounds):
                for i in range(args.reps + 1):
                    t = time.perf_counter()
                    hf(ids[:, p:], past_key_values=cache, use_cache=True,
                       position_ids=torch.arange(p, p + w)[None], attention_mask=torch.ones(1, p + w, dtype=torch.long))
                    if i:  # the first is a warm-up
                        times.append(time.perf_counter() - t)
                    cache.crop(-w)  # drop the window again (transformers >= 5: negative = tokens to remove)
                ours += eng._core.bench_forward(p, w, args.reps + 1)[1:]
                gemm += gemm_eng._core.bench_forward(p, w, args.reps + 1)[1:]
        torch_ms, ours_ms, gemm_ms = (1e3 * statistics.median(x) for x in (times, ours, gemm))
        rows.append(dict(prefix=p, window=w, mbd_rs_ms=ours_ms, mbd_rs_gemm_only_ms=gemm_ms, torch_eager_ms=torch_ms,
                         ratio=ours_ms / torch_ms, ratio_gemm_only=gemm_ms / torch_ms))
        print(f"prefix {p:5d} W {w:3d}: mbd-rs {ours_ms:8.1f} ms  (gemm only {gemm_ms:8.1f})  torch eager {torch_ms:8.1f} ms  "
              f"ratio {ours_ms / torch_ms:.2f} (gemm only {gemm_ms / torch_ms:.2f})", flush=True)
    out = dict(model=args.model, threads=threads, rounds=args.rounds, reps=args.reps, torch=torch.__version__, transformers=transformers.__version__, rows=rows)
    json.dump(out, open(os.path.join(ROOT, "benches", "compare_forward.json"), "w"), indent=1)


if __name__ == "__main__":
    main()
