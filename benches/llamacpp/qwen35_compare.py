"""One window forward of a Qwen3.5 hybrid on the CPU, mbd-rs against llama.cpp, on the same GGUF file.

Both sides: a W-token window at positions P..P+W-1 after a P-token prefix (the softmax layers over their cache, the
Gated DeltaNet layers from their state), logits for every window row, the window dropped again after each forward
(mbd-rs: Model.bench_forward, whose forward leaves the cache as it was; llama.cpp: benches/llamacpp/driver.cpp, which
re-fills the prefix untimed since a recurrent state cannot drop positions). Same thread count; the engines alternate
over --rounds rounds; medians over all repetitions, ratios mbd-rs / llama.cpp.

    benches/llamacpp/build.sh
    python benches/forward/qwen35_forward.py --cases 0:1       # makes /tmp/mbd-bench/qwen3.5-0.8b-shape if absent
    python scripts/write_gguf.py /tmp/mbd-bench/qwen3.5-0.8b-shape /tmp/llamacpp/q35/model-f32.gguf
    /tmp/llamacpp/build/bin/llama-quantize /tmp/llamacpp/q35/model-f32.gguf /tmp/llamacpp/q35/model-q8_0.gguf Q8_0
    .venv/bin/python benches/llamacpp/qwen35_compare.py --gguf /tmp/llamacpp/q35/model-q8_0.gguf
Writes --out (benches/results/qwen35/qwen35_llamacpp.json).
"""
import argparse
import json
import os
import statistics
import subprocess
import sys

import mbd_rs

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gguf", required=True)
    ap.add_argument("--driver", default=os.path.join(os.environ.get("LLAMACPP_WORK", "/tmp/llamacpp"), "build", "bin",
                                                     "mbd-llama-driver"))
    ap.add_argument("--cases", default="512:32,512:8,512:1,0:32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--fa", type=int, default=0, help="llama.cpp's flash attention (0 or 1)")
    ap.add_argument("--int8", type=int, default=1, help="mbd-rs int8_activations (1: llama.cpp's own arithmetic)")
    ap.add_argument("--out", default=os.path.join(ROOT, "benches", "results", "qwen35", "qwen35_llamacpp.json"))
    args = ap.parse_args()
    threads = os.cpu_count()
    eng = mbd_rs.Engine.load(args.gguf, device="cpu", int8_activations=bool(args.int8))
    cases = [tuple(int(x) for x in c.split(":")) for c in args.cases.split(",")]
    times = {c: {"llama_cpp": [], "mbd_rs": []} for c in cases}
    for _ in range(args.rounds):
        p = subprocess.run([args.driver, args.gguf, "--cases", args.cases, "--reps", str(args.reps), "--warmup", "1",
                            "--fa", str(args.fa), "--threads", str(threads)], capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{args.driver} failed ({p.returncode}):\n{p.stderr[-3000:]}")
        for line in p.stdout.splitlines():
            d = json.loads(line)
            if d.get("kind") == "case":
                times[(d["prefix"], d["window"])]["llama_cpp"] += d["times_ms"]
        for c in cases:
            times[c]["mbd_rs"] += [1e3 * t for t in eng._core.bench_forward(c[0], c[1], args.reps + 1)[1:]]
    rows = []
    for (pre, w), t in times.items():
        ms = {k: statistics.median(v) for k, v in t.items()}
        rows.append(dict(prefix=pre, window=w, llama_cpp_ms=ms["llama_cpp"], mbd_rs_ms=ms["mbd_rs"],
                         ratio=ms["mbd_rs"] / ms["llama_cpp"]))
        print(f"prefix {pre:5d} W {w:3d}: llama.cpp {ms['llama_cpp']:8.1f} ms; mbd-rs {ms['mbd_rs']:8.1f} ms "
              f"= {ms['mbd_rs'] / ms['llama_cpp']:.2f}x", flush=True)
    json.dump(dict(gguf=args.gguf, weight_format=eng.info.weight_format, int8_activations=bool(args.int8),
                   threads=threads, rounds=args.rounds, reps=args.reps, flash_attn=args.fa, rows=rows),
              open(args.out, "w"), indent=1)


if __name__ == "__main__":
    main()
