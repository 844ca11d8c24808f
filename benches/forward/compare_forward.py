"""One decode forward, side by side in one process: mbd-rs against PyTorch eager (HF transformers, same
computation: a W-token window over a P-token KV cache, logits for every window row, same thread count), and
mbd-rs with its skinny kernel switched off (candle's matmul everywhere) as an A/B of that kernel, and mbd-rs with
its many-row panel products switched off (long windows through candle's matmul, a bf16 matrix widened whole per
call) as an A/B of those, and with its blocked attention switched off (candle's ops) as an A/B of that, and with
the packed product's AVX2 tiles on an AVX-512 CPU (avx512_off) (--engines picks the columns). The columns alternate over --rounds rounds (the machine is shared and noisy); each number is
the median of all repetitions. A case P:W:last asks for the last row's logits only (a prefill that goes on to
decode; PyTorch: logits_to_keep=1), P:W for every row's.

    python scripts/make_bench_model.py /tmp/mbd-bench/qwen2.5-0.5b-shape     # once, numpy + safetensors
    python benches/forward/compare_forward.py [--model DIR] [--reps 7] [--cases 0:512,0:512:last] [--out FILE]
Needs torch + transformers in the same environment as mbd_rs. Writes --out
(benches/results/cpu-forward/compare_forward.json).
"""
import argparse
import json
import os
import statistics
import time

import torch
import transformers

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--cases", default="512:32,512:4,2048:32,0:32")
    ap.add_argument("--engines", default="mbd_rs,panels_off,gemm_only,blocked_off",
                    help="mbd-rs columns to run (mbd_rs, panels_off, gemm_only, blocked_off, avx512_off)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benches", "results", "cpu-forward", "compare_forward.json"))
    args = ap.parse_args()
    threads = os.cpu_count()
    torch.set_num_threads(threads)
    kernels = {
        "mbd_rs": {},
        # long windows through candle's matmul (a bf16 matrix widened to f32 whole for each product)
        "panels_off": dict(panels=False),
        # candle's matmul only, on f32-held weights (the engine before the skinny kernel)
        "gemm_only": dict(skinny=False, panels=False, keep_bf16_weights=False),
        # long windows' attention through candle's ops (materialised scores, host mask, softmax, matmul)
        "blocked_off": dict(blocked_attention=False),
        # the packed product's AVX2 tiles where the CPU has AVX-512 (the same bits)
        "avx512_off": dict(packed_avx512=False),
    }
    engines = {name: mbd_rs.Engine.load(args.model, device="cpu", _kernels=kernels[name])
               for name in args.engines.split(",")}
    hf = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32, attn_implementation="eager").eval()
    rows = []
    for case in args.cases.split(","):
        p, w, *last = case.split(":")
        p, w, last = int(p), int(w), last == ["last"]
        ids = torch.randint(0, 150000, (1, p + w), generator=torch.Generator().manual_seed(0))
        times = {"torch_eager": [], **{name: [] for name in engines}}
        with torch.no_grad():
            cache = transformers.DynamicCache(config=hf.config)
            if p:
                hf(ids[:, :p], past_key_values=cache, use_cache=True)
            for _ in range(args.rounds):
                for i in range(args.reps + 1):
                    t = time.perf_counter()
                    hf(ids[:, p:], past_key_values=cache, use_cache=True, logits_to_keep=1 if last else 0,
                       position_ids=torch.arange(p, p + w)[None], attention_mask=torch.ones(1, p + w, dtype=torch.long))
                    if i:  # the first is a warm-up
                        times["torch_eager"].append(time.perf_counter() - t)
                    cache.crop(-w)  # drop the window again (transformers >= 5: negative = tokens to remove)
                for name, eng in engines.items():
                    times[name] += eng._core.bench_forward(p, w, args.reps + 1, last_row=last)[1:]
        ms = {name: 1e3 * statistics.median(x) for name, x in times.items()}
        row = dict(prefix=p, window=w, logits="last row" if last else "every row",
                   **{f"{name}_ms": v for name, v in ms.items()},
                   **{f"ratio_{name}": ms[name] / ms["torch_eager"] for name in engines})
        rows.append(row)
        print(f"prefix {p:5d} W {w:3d} ({row['logits']}): torch eager {ms['torch_eager']:8.1f} ms; "
              + "; ".join(f"{name} {ms[name]:8.1f} ms = {row['ratio_' + name]:.2f}x" for name in engines), flush=True)
    out = dict(model=args.model, threads=threads, rounds=args.rounds, reps=args.reps, torch=torch.__version__,
               transformers=transformers.__version__, rows=rows)
    json.dump(out, open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
