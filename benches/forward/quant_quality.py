"""Quantized weights: what they cost in accuracy and what they save in memory, per format.

Accuracy: logits of one call over N positions (random ids, causal attention) with the weights as loaded
against quantize="q8_0" / "q4_k" / "q6_k" (and GGUF files of the same weights, --gguf): max and mean relative error (|q - ref| over max / mean |ref|) and top-1
agreement. Memory: each format is loaded in a fresh child process, which reports its peak and current RSS after
loading against the weight bytes held (`info.weight_bytes`).

    python benches/forward/quant_quality.py [--model DIR] [--positions 1024]  # default: the 0.5B-shaped bf16 checkpoint
    python benches/forward/quant_quality.py --model /tmp/mbd-bench/h2048 --formats none,q6_k,q5_k,q4_0   # other formats
    python benches/forward/quant_quality.py --formats none,q8_0,q8_0+i8,q4_k,q4_k+i8   # "+i8": int8_activations=True
    python benches/forward/quant_quality.py --model /tmp/mbd-bench/qwen2.5-0.5b-shape --out /tmp/q.json \
        --gguf /tmp/llamacpp/ours/model-q4_k_m.gguf --gguf /tmp/llamacpp/ours/model-q6_k.gguf   # llama.cpp's files
Writes benches/results/quantization/quant_quality.json (or --out) and prints a markdown table.
"""
import argparse
import json
import os
import subprocess
import sys

import numpy as np

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FORMATS = "none,q8_0,q4_k,q6_k"  # "none": as loaded, the reference

CHILD = r"""
import json, sys, mbd_rs
q, i8 = sys.argv[2].removesuffix("+i8"), sys.argv[2].endswith("+i8")
e = mbd_rs.Engine.load(sys.argv[1], device="cpu", quantize=None if q == "none" else q, int8_activations=i8)
# VmHWM / VmRSS of this process image (ru_maxrss would carry the parent's peak across fork and exec)
st = dict(l.split(":", 1) for l in open("/proc/self/status"))
kb = lambda k: int(st[k].split()[0]) * 1024
print(json.dumps(dict(weight_bytes=e.info.weight_bytes, weight_format=e.info.weight_format + ("+i8" if i8 else ""),
                      peak_rss=kb("VmHWM"),
                      rss=kb("VmRSS"))))
"""


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape-bf16")
    ap.add_argument("--positions", type=int, default=1024)
    ap.add_argument("--out", default=os.path.join(ROOT, "benches", "results", "quantization", "quant_quality.json"))
    ap.add_argument("--formats", default=FORMATS, help="quantize= formats, the first the reference (none: as loaded; "
                    "a '+i8' suffix: with int8_activations=True)")
    ap.add_argument("--gguf", action="append", default=[],
                    help="a GGUF file of the same weights (e.g. llama-quantize's), measured as stored; repeatable; "
                    "a '+i8' suffix on the path: with int8_activations=True")
    args = ap.parse_args()
    # a bare interpreter with mbd_rs imported, for the RSS baseline
    base = subprocess.run([sys.executable, "-c", "import resource, mbd_rs; print(int(open('/proc/self/statm').read().split()[1]) * 4096)"],
                          capture_output=True, text=True, check=True)
    baseline = int(base.stdout)
    rows = []
    ref = ids = None
    runs = [(args.model, f) for f in args.formats.split(",")]
    runs += [(g.removesuffix("+i8"), "none+i8" if g.endswith("+i8") else "none") for g in args.gguf]
    for path, f in runs:
        r = subprocess.run([sys.executable, "-c", CHILD, path, f], capture_output=True, text=True, check=True)
        mem = json.loads(r.stdout)
        q = f.removesuffix("+i8")
        eng = mbd_rs.Engine.load(path, device="cpu", quantize=None if q == "none" else q,
                                 int8_activations=f.endswith("+i8"))
        if ids is None:
            ids = np.random.default_rng(0).integers(0, eng.info.vocab_size, args.positions).tolist()
        # causal attention for every row: a GGUF carries no block-diffusion fields, so its own attention would be
        # plain causal where the checkpoint's config says block-causal
        got = eng.logits(ids, attention="causal")
        if ref is None:
            ref = got
        err = np.abs(got - ref)
        label = mem["weight_format"] if path == args.model else f"{os.path.basename(path)} ({mem['weight_format']})"
        row = dict(weights=label, weight_bytes=mem["weight_bytes"], peak_rss=mem["peak_rss"], rss=mem["rss"],
                   rss_minus_baseline_over_weights=(mem["rss"] - baseline) / mem["weight_bytes"],
                   peak_minus_baseline_over_weights=(mem["peak_rss"] - baseline) / mem["weight_bytes"],
                   max_rel=float(err.max() / np.abs(ref).max()), mean_rel=float(err.mean() / np.abs(ref).mean()),
                   top1=float((got.argmax(1) == ref.argmax(1)).mean()))
        rows.append(row)
        del eng
    out = dict(model=args.model, positions=args.positions, baseline_rss=baseline, results=rows)
    json.dump(out, open(args.out, "w"), indent=1)
    print(f"{args.model}, {args.positions} positions; RSS over weights after subtracting the bare interpreter's "
          f"{baseline / 2**20:.0f} MiB")
    print("| weights | MiB held | RSS after load / weights | peak RSS / weights | max rel err | mean rel err | top-1 = unquantized |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['weights']} | {r['weight_bytes'] / 2**20:.1f} | {r['rss_minus_baseline_over_weights']:.3f} | "
              f"{r['peak_minus_baseline_over_weights']:.3f} | {r['max_rel']:.4f} | {r['mean_rel']:.4f} | {r['top1'] * 100:.1f}% |")


if __name__ == "__main__":
    main()
