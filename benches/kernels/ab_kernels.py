"""A/B of the CPU kernel settings in one process, configurations interleaved round by round (the machine is shared
and noisy, so only same-run ratios mean anything): candle's matmul everywhere vs the skinny kernel at several
parallel thresholds and row limits, with a bf16 checkpoint's weights held as f32 or as bf16 (* = the defaults). Reports the median over rounds of (a) one forward of a W-token window over a P-token prefix
and (b) end-to-end chat requests with multi-block and AR decoding. `--set stack`: q/k/v and gate/up as one
stacked matrix each (the default) vs one product per layer (`_kernels=dict(stack=False)`), any checkpoint and
`--quantize` format. `--set packed`: dense matrices packed at load (the default on AVX2 CPUs) vs held row-major
(few-row windows through the skinny kernel, `_kernels=dict(packed_weights=False)`). `--set avx512`: the packed
product's AVX-512 tiles (the default where the CPU has them) vs its AVX2 ones. `--set quant`: bf16 against q8_0 and q4_k (each
packed at load, and held in its blocks).

    python benches/kernels/ab_kernels.py [--model DIR] [--rounds 15]
    python benches/kernels/ab_kernels.py --set stack [--model DIR] [--quantize q8_0] [--forward 0:1,16:4] [--no-e2e]
"""
import argparse
import statistics
import sys
import time

import mbd_rs
from mbd_rs import _core

# (weights held as, kernel settings); a bf16 checkpoint's matrices stay bf16 by default ("bf16"), or are widened
# to f32 at load ("f32", the state before that change).
CONFIGS = {"f32 w, gemm only": ("f32", dict(skinny=False, par_min_macs=1 << 14, max_rows=64)),
           "f32 w, skinny <=64, par 2^22": ("f32", dict(skinny=True, par_min_macs=1 << 22, max_rows=64)),
           "f32 w, skinny <=32, par 2^14": ("f32", dict(skinny=True, par_min_macs=1 << 14, max_rows=32)),
           "f32 w, skinny <=64, par 2^14": ("f32", dict(skinny=True, par_min_macs=1 << 14, max_rows=64)),
           "f32 w, skinny <=128, par 2^14": ("f32", dict(skinny=True, par_min_macs=1 << 14, max_rows=128)),
           "bf16 w, skinny <=64, par 2^14 *": ("bf16", dict(skinny=True, par_min_macs=1 << 14, max_rows=64))}
SETS = {"kernels": CONFIGS,
        "stack": {"separate products": ("bf16", dict(stack=False)), "stacked q/k/v, gate/up *": ("bf16", {})},
        "packed": {"row-major, few-row kernel": ("bf16", dict(packed_weights=False)), "packed at load *": ("bf16", {})},
        "avx512": {"packed product, AVX2 tiles": ("bf16", dict(packed_avx512=False)),
                   "packed product, AVX-512 tiles *": ("bf16", {})},
        # a third element picks the engine's quantize= (over --quantize): the formats against bf16 in one run, and q8_0
        # and q4_k (q5_0 on rows that are not whole super-blocks) packed at load (the default on AVX2 CPUs) against
        # held in blocks (`packed_weights=False`: their few-row windows through the few-row kernel, long ones
        # dequantized per call)
        "quant": {"bf16 *": ("bf16", {}, None),
                  "q8_0 packed *": ("bf16", {}, "q8_0"), "q8_0 in blocks": ("bf16", dict(packed_weights=False), "q8_0"),
                  "q4_k packed *": ("bf16", {}, "q4_k"), "q4_k in blocks": ("bf16", dict(packed_weights=False), "q4_k")}}

def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=None)
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--forward", default="0:1,16:2,16:4,16:12,16:35,0:64,0:100", help="P:W pairs")
    ap.add_argument("--set", choices=sorted(SETS), default="kernels")
    ap.add_argument("--quantize", default=None)
    ap.add_argument("--reps", type=int, default=6, help="forwards per case and round (the first is dropped)")
    ap.add_argument("--no-e2e", action="store_true", help="forwards only (no chat requests)")
    args = ap.parse_args()
    configs = SETS[args.set]
    # one engine per configuration: kernel choices are load options (the tiny model loads in milliseconds)
    engines = {c: mbd_rs.Engine.load(args.model, device="cpu", quantize=(spec + (args.quantize,))[2],
                                     _kernels=dict(keep_bf16_weights=spec[0] == "bf16", **spec[1]))
               for c, spec in configs.items()}
    held_bytes = {c: engines[c].info.weight_bytes for c in configs}
    pw = [tuple(map(int, x.split(":"))) for x in args.forward.split(",")]
    prompts = ["sort 5 3 8 1 9 2", "reverse hello world", "repeat ab 3", "add 12+30"]
    modes = {"multi-block": {}, "AR": dict(block_size=1, block_add_threshold=1.0, acceptance="confidence", threshold=1.0)}
    if args.no_e2e:
        modes = {}
    fwd = {(c, p, w): [] for c in configs for p, w in pw}
    e2e = {(c, m): [] for c in configs for m in modes}
    for r in range(args.rounds):
        order = list(configs) if r % 2 == 0 else list(reversed(configs))
        for c in order:
            eng = engines[c]
            for p, w in pw:
                fwd[(c, p, w)].append(statistics.median(eng._core.bench_forward(p, w, args.reps)[1:]))
            for m, kw in modes.items():
                t = time.perf_counter()
                toks = 0
                for q in prompts:
                    toks += eng.chat([{"role": "user", "content": q}], max_tokens=40, **kw).usage.completion_tokens
                e2e[(c, m)].append(toks / (time.perf_counter() - t))
    print(f"model {eng.info.path}, {_core.cpu_threads} threads, median of {args.rounds} interleaved rounds; weights "
          "held: " + ", ".join(f"{b / 2**20:.1f} MiB by {c}" for c, b in held_bytes.items())
          + (f" (quantize={args.quantize})" if args.quantize else ""))
    print(f"{'config':32s} " + " ".join(f"{f'P{p} W{w}':>9s}" for p, w in pw) + "  (ms per forward)  "
          + " ".join(f"{m + ' tok/s':>17s}" for m in modes) + ("  multi/AR" if modes else ""))
    for c in configs:
        ms = [1e3 * statistics.median(fwd[(c, p, w)]) for p, w in pw]
        tps = [statistics.median(e2e[(c, m)]) for m in modes]
        print(f"{c:32s} " + " ".join(f"{x:9.3f}" for x in ms) + " " * 19 + " ".join(f"{x:17.1f}" for x in tps)
              + (f"  {tps[0] / tps[1]:8.2f}" if modes else ""))
    if args.set == "stack":
        a, b = list(configs)
        print("stacked / separate, per forward case: " + ", ".join(
            f"P{p} W{w} {statistics.median(fwd[(b, p, w)]) / statistics.median(fwd[(a, p, w)]):.3f}" for p, w in pw)
            + "".join(f"; {m} tok/s {statistics.median(e2e[(b, m)]) / statistics.median(e2e[(a, m)]):.3f}"
                      for m in modes))


if __name__ == "__main__":
    sys.exit(main())
