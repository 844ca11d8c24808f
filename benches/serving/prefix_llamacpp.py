"""The prefix cache side by side with llama.cpp reusing its prefix (as its server's `cache_prompt` does), on the
same GGUF file: a request of P shared + W new tokens, after one that shared the P tokens.

- mbd-rs: the engine's time to first token (`usage.ttft_ms`) of a one-token generation: first a request with the
  P-token prefix and W tokens of its own (a miss: the cold time, prefill included; it fills the cache), then one
  with the same prefix and W other tokens (a hit: it prefills only its W tokens).
- llama.cpp (`mbd-llama-driver`, benches/llamacpp/driver.cpp): the P tokens decoded into its KV cache once in
  512-token batches (`fill_ms`: its cold time, but for the W tokens), then the W-token window at P..P+W-1 with the
  last row's logits (`--last-logits`), the window dropped after each repetition: its time to first token with the
  prefix reused.

The engines alternate within each round (mbd-rs in this process, llama.cpp as a child), both with every core;
ratios are paired per round, medians reported. The machine must be otherwise idle: llama.cpp's thread barriers
lose whole time slices to any other busy process.

    benches/llamacpp/build.sh && benches/llamacpp/same_file.sh /tmp/mbd-bench/qwen2.5-0.5b-shape /tmp/llamacpp/ours
    python benches/serving/prefix_llamacpp.py [--gguf /tmp/llamacpp/ours/model-q8_0.gguf] [--lengths 512,2048,8192]

Writes prefix_llamacpp-{gguf name}.json in benches/results/batching-serving/ (--out).
"""
import argparse
import json
import os
import random
import statistics
import subprocess

import mbd_rs
from serving import run_meta

ap = argparse.ArgumentParser()
ap.add_argument("--gguf", default="/tmp/llamacpp/ours/model-q8_0.gguf")
ap.add_argument("--driver", default="/tmp/llamacpp/build/bin/mbd-llama-driver")
ap.add_argument("--lengths", default="512,2048,8192")
ap.add_argument("--new", type=int, default=32, help="new tokens after the shared prefix (W)")
ap.add_argument("--rounds", type=int, default=2)
ap.add_argument("--reps", type=int, default=3, help="llama.cpp's window repetitions per round")
ap.add_argument("--out", default=None)
args = ap.parse_args()
name = os.path.splitext(os.path.basename(args.gguf))[0]
args.out = args.out or os.path.join(os.path.dirname(__file__), "..", "results", "batching-serving",
                                    f"prefix_llamacpp-{name}.json")
lengths = [int(x) for x in args.lengths.split(",")]
threads = os.cpu_count() or 1
meta = run_meta()  # before the run, so that a development build is warned of at once

eng = mbd_rs.Engine.load(args.gguf, mask_token_id=0)
V = eng.info.vocab_size
r = random.Random(0)


def ids(n):
    return [r.randrange(10, V) for _ in range(n)]


def ttft(prompt):
    c = eng.generate(prompt, max_tokens=1)
    return c.usage.ttft_ms, c.usage.cached_tokens


def llama(P):
    ctx = P + args.new + 64
    cmd = [args.driver, args.gguf, "--threads", str(threads), "--cases", f"{P}:{args.new}", "--reps",
           str(args.reps), "--warmup", "1", "--ctx", str(ctx), "--batch", "512", "--last-logits"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    case = next(json.loads(x) for x in out.splitlines() if '"kind":"case"' in x)
    return case["median_ms"], case["fill_ms"]


rows = []
for P in lengths:
    per = {"mbd_cold": [], "mbd_hit": [], "llama_reuse": [], "llama_fill": []}
    for rnd in range(args.rounds):
        eng.clear_prefix_cache()
        shared = ids(P)
        cold, c0 = ttft(shared + ids(args.new))
        hit, cached = ttft(shared + ids(args.new))
        assert c0 == 0 and cached >= P - 32, (c0, cached)
        reuse, fill = llama(P)
        for k, v in (("mbd_cold", cold), ("mbd_hit", hit), ("llama_reuse", reuse), ("llama_fill", fill)):
            per[k].append(v)
        print(f"P={P} round {rnd}: mbd-rs hit {hit:.0f} ms (cached {cached}), cold {cold:.0f} ms; llama.cpp "
              f"reusing its prefix {reuse:.0f} ms, filling it {fill:.0f} ms", flush=True)
    ratio = {"hit_over_llama_reuse": statistics.median(a / b for a, b in zip(per["mbd_hit"], per["llama_reuse"])),
             "cold_over_llama_fill": statistics.median(a / b for a, b in zip(per["mbd_cold"], per["llama_fill"])),
             "hit_over_cold": statistics.median(a / b for a, b in zip(per["mbd_hit"], per["mbd_cold"]))}
    rows.append({"prefix": P, "new": args.new, "median_ms": {k: statistics.median(v) for k, v in per.items()},
                 "ratios": ratio, "rounds": per})
    print(f"P={P}: mbd-rs hit / llama.cpp reuse {ratio['hit_over_llama_reuse']:.2f}, mbd-rs cold / llama.cpp "
          f"fill {ratio['cold_over_llama_fill']:.2f}, hit / cold {ratio['hit_over_cold']:.4f}", flush=True)

out = {
    **meta,
    "gguf": args.gguf,
    "rows": rows,
}
os.makedirs(os.path.dirname(args.out), exist_ok=True)
with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", args.out)
