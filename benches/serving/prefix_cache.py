"""The prefix cache's time to first token: a request sharing a P-token prefix with an earlier one, against the
same request cold (prefix_cache=0), against the forward over its new tokens alone (bench_forward: W rows over a
P-token cache, logits for the last row, as a prefill chunk), and a miss (cache on, a prefix never seen) against
the cache off. Interleaved per round, ratios paired per round, medians reported.

    python scripts/make_bench_model.py                      # /tmp/mbd-bench/qwen2.5-0.5b-shape (f32)
    python benches/serving/prefix_cache.py [--model DIR] [--quantize q8_0] [--lengths 512,2048] [--rounds 3]

Writes prefix_cache-f32.json (or the --quantize format's name) in benches/results/batching-serving/ (--out).
One thread count for everything (the machine's).
"""
import argparse
import json
import os
import random
import statistics
import time

import mbd_rs
from serving import run_meta

ap = argparse.ArgumentParser()
ap.add_argument("--model", default="/tmp/mbd-bench/qwen2.5-0.5b-shape")
ap.add_argument("--quantize", default=None)
ap.add_argument("--lengths", default="512,2048")
ap.add_argument("--new", type=int, default=32, help="new tokens after the shared prefix")
ap.add_argument("--rounds", type=int, default=3)
ap.add_argument("--out", default=None, help="default: prefix_cache-[{model dir}-]{format}.json in the results folder")
args = ap.parse_args()
# the default model's file keeps its name; another model's carries the model directory's name
_model = "" if args.model == ap.get_default("model") else os.path.basename(os.path.normpath(args.model)) + "-"
args.out = args.out or os.path.join(os.path.dirname(__file__), "..", "results", "batching-serving",
                                    f"prefix_cache-{_model}{args.quantize or 'f32'}.json")

meta = run_meta()  # before the run, so that a development build is warned of at once

load = {"quantize": args.quantize} if args.quantize else {}
on = mbd_rs.Engine.load(args.model, mask_token_id=0, **load)
off = mbd_rs.Engine.load(args.model, mask_token_id=0, prefix_cache=0, **load)
V = on.info.vocab_size
r = random.Random(0)


def ids(n):
    return [r.randrange(10, V) for _ in range(n)]


def ttft(eng, prompt):
    """Seconds to the first token of a one-token generation (the engine's own ttft: prefill and first forward)."""
    t0 = time.perf_counter()
    c = eng.generate(prompt, max_tokens=1)
    wall = time.perf_counter() - t0
    return c.usage.ttft_ms / 1e3, wall, c.usage.cached_tokens


rows = []
for P in [int(x) for x in args.lengths.split(",")]:
    per = {"cold": [], "hit": [], "alone": [], "miss": [], "off_wall": [], "miss_wall": [], "cache_bytes": [],
           "cache_pages": []}
    for rnd in range(args.rounds):
        shared = ids(P)
        on.clear_prefix_cache()
        ttft(on, shared + ids(args.new))  # fill (untimed): a request with the same prefix
        new = shared + ids(args.new)
        st = on.prefix_cache_stats()  # what the fill left: its pages (K/V, and a hybrid's state snapshots)
        per["cache_bytes"].append(st.bytes)
        per["cache_pages"].append(st.pages)
        h, _, cached = ttft(on, new)
        c, cw, _ = ttft(off, new)
        alone = sorted(on._core.bench_forward(P, args.new, 3, last_row=True))[1]
        m, mw, mc = ttft(on, ids(P + args.new))  # a miss: nothing shared
        assert cached >= P - 32 and mc == 0, (cached, mc)
        for k, v in (("hit", h), ("cold", c), ("alone", alone), ("miss", m), ("off_wall", cw), ("miss_wall", mw)):
            per[k].append(v)
        print(f"P={P} round {rnd}: hit {h * 1e3:.0f} ms (cached {cached}), cold {c * 1e3:.0f} ms, "
              f"{args.new} new tokens alone {alone * 1e3:.0f} ms, miss {m * 1e3:.0f} ms", flush=True)
    med = {k: statistics.median(v) for k, v in per.items()}
    ratio = {
        "hit_over_cold": statistics.median(h / c for h, c in zip(per["hit"], per["cold"])),
        "hit_over_alone": statistics.median(h / a for h, a in zip(per["hit"], per["alone"])),
        "miss_over_off": statistics.median(m / c for m, c in zip(per["miss"], per["cold"])),
    }
    # the bytes the fill left in the cache per token of its prompt (K/V of every softmax layer, in whole pages; a
    # hybrid's recurrent-state snapshots on top)
    per_token = statistics.median(b / (P + args.new) for b in per["cache_bytes"])
    rows.append({"prefix": P, "new": args.new, "median_s": med, "ratios": ratio, "rounds": per,
                 "cache_bytes_per_prompt_token": per_token})
    print(f"P={P}: hit/cold {ratio['hit_over_cold']:.3f}, hit/alone {ratio['hit_over_alone']:.2f}, "
          f"miss/off {ratio['miss_over_off']:.3f}, cache {per_token / 1024:.1f} KiB per prompt token", flush=True)

out = {
    **meta,
    "model": args.model,
    "quantize": args.quantize,
    "rows": rows,
}
os.makedirs(os.path.dirname(args.out), exist_ok=True)
with open(args.out, "w") as f:
    json.dump(out, f, indent=1)
print("wrote", args.out)
